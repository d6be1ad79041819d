"""The network: layers and the stacked, scanned decoder (`layers`, `transformer`), the output head and its losses
(`head`), which tokens see which (`visibility`) and cuDNN's packed attention (`cudnn_attention`), the reward model
and PPO's actor-critic (`reward`, `actor_critic`), LoRA adapters (`lora`), int8/fp8 matmuls (`quant`), a frozen
base stored in NF4 or int8 for QLoRA (`base_quant`, on `blockwise`'s quantisers), KV-cache sampling (`sample`),
and building a model from its config (`build`)."""

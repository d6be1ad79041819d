"""Context extension of the `make train` model from its 128-token context to 2048 tokens (docs/long-context.md).

    make train
    make long-context   # or: XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/train.py \
                        #         --config configs/long_context.py

Restores the parameters of runs/pretrain into the same model, rescales its rotary positions with YaRN (factor 16 over
the original 128 positions) and trains every parameter on 2048-token rows of the shipped corpus, whose documents
(plays) run to about 2,000 tokens, with each row's sequence split over 4 devices of `context` (ring attention).
The held-out loss at step 0 is the base model's on 2048-token windows with the new scaling, before any training.
Every field is documented on its dataclass in jaxllm/config/schema.py.
"""

from jaxllm.config.schema import default_config_dict


def get_config():
    config = default_config_dict()
    config.workdir = "runs/long_context"
    config.checkpoint.update(restore_from="runs/pretrain", every=50, keep=2)
    config.mesh.update(data=1, fsdp=2, tensor=1, stage=1, context=4)
    # configs/pretrain.py's model (a pretraining run restores parameters only, into the model its config names)
    config.model.update(vocab_size=512, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                        mlp_dim=768, rope_scaling="yarn", rope_scaling_factor=16.0, rope_original_context=128,
                        context_attention="ring")
    config.precision.update(params="float32", compute="float32", output="float32")
    config.optim.update(name="adamw", lr=1e-3, schedule="cosine", warmup_steps=10, weight_decay=0.1)
    config.train.update(steps=100, batch_size=4, seq_len=2048, eval_every=50, eval_batches=4, sample_prompt="ROMEO.")
    config.data.update(path="build/data/shakespeare", num_workers=0)
    config.lock()
    return config

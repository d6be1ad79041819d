"""PPO with fresh LoRA adapters on the `make sft` model (merged) and a critic sharing its frozen base, rewarded by
a registered Python function.

    python scripts/train.py --config configs/ppo.py --config.checkpoint.restore_from=runs/sft_lora \
        [--config.ppo.train_file=PROMPTS.jsonl] [--config.ppo.reward=fn:ends_sentence | rm:runs/reward]

The prompts default to the SFT task's (build/data/sft_task, made by `make sft`; their "prompt" fields are used).

Each iteration samples one response to each of ppo.prompts_per_iteration prompts with the current policy,
scores them (ppo.reward, jaxllm/objectives/reward_fns.py), has the critic value them, and takes ppo.epochs passes of
train.batch_size-row minibatches over them: here 64 responses, 2 epochs of 4 minibatches, 8 steps an iteration
(more fresh responses and fewer passes over each keep the update's noise, and so the KL it costs, down).
Prompts longer than 96 tokens are dropped: the rows are shorter and an iteration faster.
The reference is the base with the adapters off (no second copy). Every field is documented on its dataclass in
jaxllm/config/schema.py.
"""

from jaxllm.config.schema import default_config_dict


def get_config():
    config = default_config_dict()
    config.workdir = "runs/ppo"
    config.mesh.update(data=2, fsdp=2, tensor=2, stage=1)
    # The architecture comes from the base; this CPU default computes in float32 (see configs/pretrain.py).
    config.precision.update(params="float32", compute="float32", output="float32")
    config.lora.update(rank=16, alpha=32.0, dropout=0.0, targets="q_proj,v_proj")
    config.optim.update(name="adamw", lr=3e-3, schedule="constant", warmup_steps=0, weight_decay=0.0)
    config.train.update(objective="ppo", steps=288, batch_size=16, eval_every=1000)
    config.ppo.update(train_file="build/data/sft_task/train.jsonl", eval_file="build/data/sft_task/eval.jsonl",
                      template="alpaca", reward="fn:ends_sentence", max_prompt_tokens=96, max_new_tokens=32,
                      prompts_per_iteration=64, epochs=2, temperature=1.0, kl_coef=0.07, kl_estimator="k1",
                      gamma=1.0, lam=0.95, clip=0.2, value_clip=0.2, vf_coef=0.1, eval_prompts=32)
    config.data.update(num_workers=0)
    # Policy-gradient losses change sign and size with every rollout: spikes are reported, not acted on.
    config.anomaly.update(act_on_loss_spike=False)
    config.checkpoint.update(every=20, keep=2)
    config.lock()
    return config

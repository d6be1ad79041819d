"""Default pretraining job: a small Llama on the shipped Shakespeare corpus, 8 devices as (2, 2, 2, 1).

Runs on a laptop CPU with XLA_FLAGS=--xla_force_host_platform_device_count=8 in a few minutes. For GPUs pick a
preset and a mesh, e.g. --config.model.preset=llama_8b --config.mesh.fsdp=-1 (presets compute in bfloat16).
Every field is documented on its dataclass in jaxllm/config/schema.py and overridable as --config.section.key=value.
"""

from jaxllm.config.schema import default_config_dict


def get_config():
    config = default_config_dict()
    config.workdir = "runs/pretrain"
    config.mesh.update(data=2, fsdp=2, tensor=2, stage=1)
    config.model.update(vocab_size=512, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                        mlp_dim=768)
    # This CPU default computes in float32: CPUs without native bf16 run bf16 matmuls ~1.7x slower.
    config.precision.update(params="float32", compute="float32", output="float32")
    config.optim.update(name="adamw", lr=3e-3, schedule="cosine", warmup_steps=30, weight_decay=0.1)
    config.train.update(steps=300, batch_size=16, seq_len=128, eval_every=100, eval_batches=8, sample_prompt="ROMEO.")
    config.data.update(path="build/data/shakespeare", num_workers=0)
    config.checkpoint.update(every=100, keep=3)
    config.lock()
    return config

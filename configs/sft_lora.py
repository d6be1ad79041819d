"""LoRA supervised fine-tuning of the `make train` model on the shipped SFT task (`make sft`).

    python scripts/make_sft_task.py --out build/data/sft_task
    python scripts/train.py --config configs/sft_lora.py --config.checkpoint.restore_from=runs/pretrain

`checkpoint.restore_from` names the base: a jaxllm run (workdir, checkpoints directory or step directory) or a
Hugging Face model directory; the run takes the base's architecture and tokenizer. The same file with
`--config.lora.rank=0` fine-tunes every parameter. The data (sft.train_file, sft.eval_file: JSON lines of
{"prompt", "response"} or {"messages": [...]}) is prepared into data.path at the start of the run.
Every field is documented on its dataclass in jaxllm/config/schema.py.
"""

from jaxllm.config.schema import default_config_dict


def get_config():
    config = default_config_dict()
    config.workdir = "runs/sft_lora"
    config.mesh.update(data=2, fsdp=2, tensor=2, stage=1)
    # The architecture comes from the base; this CPU default computes in float32 (see configs/pretrain.py).
    config.precision.update(params="float32", compute="float32", output="float32")
    config.lora.update(rank=16, alpha=32.0, dropout=0.1, targets="q_proj,v_proj")
    config.optim.update(name="adamw", lr=5e-3, schedule="cosine", warmup_steps=20, weight_decay=0.0)
    # Positions restart in every packed example, so 256-token rows hold two or three examples of ~100 tokens
    # without leaving the positions the base was trained on.
    config.train.update(objective="sft", steps=200, batch_size=16, seq_len=256, eval_every=100, eval_batches=4)
    config.sft.update(train_file="build/data/sft_task/train.jsonl", eval_file="build/data/sft_task/eval.jsonl",
                      template="alpaca", overlong="truncate", eval_examples=400, max_new_tokens=24)
    config.data.update(path="build/data/sft_task/prepared", num_workers=0)
    config.checkpoint.update(every=100, keep=2)
    config.lock()
    return config

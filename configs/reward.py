"""A reward model on the shipped preference pairs, from the `make train` model (`make reward`).

    python scripts/make_preference_set.py --out build/data/preference
    python scripts/train.py --config configs/reward.py --config.checkpoint.restore_from=runs/pretrain

The model is the base decoder with a scalar head (D -> 1) scoring each sequence's last token, trained with the
Bradley-Terry loss. `checkpoint.restore_from` names the base (a jaxllm run, a LoRA SFT run, whose adapters are
merged first, or a Hugging Face model directory); the run takes its architecture and tokenizer. Every parameter
trains here; `--config.lora.rank=16` trains adapters and the head only. Pairs (preference.train_file,
preference.eval_file: JSON lines of {"prompt", "chosen", "rejected"}) are prepared into data.path at the start.
Every field is documented on its dataclass in jaxllm/config/schema.py.
"""

from jaxllm.config.schema import default_config_dict


def get_config():
    config = default_config_dict()
    config.workdir = "runs/reward"
    config.mesh.update(data=2, fsdp=2, tensor=2, stage=1)
    # The architecture comes from the base; this CPU default computes in float32 (see configs/pretrain.py).
    config.precision.update(params="float32", compute="float32", output="float32")
    config.lora.update(rank=0)
    config.optim.update(name="adamw", lr=1e-3, schedule="cosine", warmup_steps=20, weight_decay=0.0)
    # A row holds a pair's two sequences side by side (up to 128 positions each: the base's trained length).
    config.train.update(objective="reward", steps=250, batch_size=16, seq_len=256, eval_every=125, eval_batches=8)
    config.preference.update(train_file="build/data/preference/train.jsonl",
                             eval_file="build/data/preference/eval.jsonl", template="alpaca", pairs_per_row=2)
    config.data.update(path="build/data/preference/prepared", num_workers=0)
    # Pair losses near zero jump many times over between batches of 16 pairs in healthy runs: loss spikes are
    # reported, not acted on (non-finite steps still roll back).
    config.anomaly.update(act_on_loss_spike=False)
    config.checkpoint.update(every=100, keep=2)
    config.lock()
    return config

"""jaxllm's train step, its training loop, or scripts/plain_step.py's step, for the shapes of
scripts/bench_peers.py; prints ONE JSON line last: {"impl", "tokens_per_sec", "step_s", "compile_s"}.

    python scripts/peers/jaxllm_run.py --impl step|loop|plain --layers 6 --dim 256 --heads 4 --kv_heads 4 \\
        --mlp_dim 688 --vocab 8000 --seq 256 --batch 8 --steps 12 --dtype bfloat16 --devices 8 [--data DIR]

step  the compiled step the loop runs (scripts/bench_step.py's bare row): anomaly checks and veto, clipping,
      norms, AdamW, on one device-resident batch, back to back;
loop  jaxllm.train.loop.train on the token store at --data (its vocabulary must fit the model's);
plain scripts/plain_step.py: the same network (packed documents) and update in plain jax.numpy + optax.
The model is configs/pretrain.py's Llama at the given shapes (untied head, head_dim = dim / heads), float32
parameters computing in --dtype, AdamW (b2 0.95, weight decay 0.1) after global-norm clipping at 1.0, pure data
parallelism over --devices forced host devices.
"""

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("step", "loop", "plain"), required=True)
    for name, default in (("layers", 6), ("dim", 256), ("heads", 4), ("kv_heads", 4), ("mlp_dim", 688),
                          ("vocab", 8000), ("seq", 256), ("batch", 8), ("steps", 12), ("devices", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--data", default=str(ROOT / "build" / "data" / "shakespeare"))
    p.add_argument("--zero1", choices=("true", "false"), help="optim.zero1 (default: the config's)")
    return p.parse_args(argv)


def overrides(a) -> list[tuple[str, str]]:
    """configs/pretrain.py overrides for the model, batch, precision, optimizer and mesh of `a`."""
    values = {"mesh.data": a.devices, "mesh.fsdp": 1, "mesh.tensor": 1, "mesh.stage": 1,
              "model.num_layers": a.layers, "model.dim": a.dim, "model.num_heads": a.heads,
              "model.num_kv_heads": a.kv_heads, "model.head_dim": a.dim // a.heads, "model.mlp_dim": a.mlp_dim,
              "model.vocab_size": a.vocab, "model.tie_embeddings": "false", "train.seq_len": a.seq,
              "train.batch_size": a.batch, "precision.compute": a.dtype, "optim.weight_decay": 0.1,
              "optim.b2": 0.95, "optim.clip_norm": 1.0, "data.path": a.data}
    if a.zero1 is not None:
        values["optim.zero1"] = a.zero1
    return [(key, str(value)) for key, value in values.items()]


def main(argv) -> int:
    a = parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} " \
                              f"--xla_force_host_platform_device_count={a.devices}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_step import bare_step_throughput, bench_config, loop_throughput

    cfg = bench_config(str(ROOT / "configs" / "pretrain.py"), overrides(a))
    if a.impl == "step":
        result = bare_step_throughput(cfg, a.steps)
    elif a.impl == "loop":
        result = loop_throughput(cfg, a.steps)
    else:
        import jax

        from jaxllm.data.synthetic import synthetic_batch
        from plain_step import plain_step_throughput

        batch = synthetic_batch(0, a.batch, a.seq, a.vocab)
        result = plain_step_throughput(cfg, batch, a.steps, jax.devices()[:a.devices])
    print(json.dumps({"impl": a.impl, "tokens_per_sec": result["tokens_per_sec"], "step_s": result["step_s"],
                      "compile_s": result["compile_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

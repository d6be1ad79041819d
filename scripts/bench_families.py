"""Price of each model family's blocks: `python scripts/bench_families.py --config configs/pretrain.py [--steps N]
[--window_seq_len T] [--config.x=v]`.

Times the bare train step (scripts/bench_step.py's) of the config's model as every family of
jaxllm/config/families/ at the same width and depth, interleaved over 3 rounds, and prints each family's median
tokens/s over Llama's (what q/k/v biases, q/k norms, windows, GeGLU and sandwich norms cost). Mistral gets a
window of a quarter of the sequence, Gemma 3 every second layer global. Then, at `--window_seq_len` (4096), a
Mistral model with a window of 512 against the same model with full attention. One JSON line at the end.
"""

import dataclasses
import json
import sys

from bench_step import bare_step_throughput, bench_arguments

from jaxllm.config.families import FAMILIES


# The families whose layers have the dense MLP of the same shape (mixtures of experts: scripts/bench_moe.py).
DENSE_FAMILIES = tuple(name for name, family in FAMILIES.items() if not family.blocks.experts)


def family_variant(cfg, family: str, window: int):
    """`cfg` with its model as `family` at the same shape: the blocks come with the family; Mistral and Gemma 3
    get a sliding `window`, Gemma 3 every second layer global and its own local RoPE base."""
    extra = {"sliding_window": window} if FAMILIES[family].blocks.sliding_window else {}
    if FAMILIES[family].blocks.local_global:
        extra.update(global_every=2, local_rope_theta=10000.0)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, family=family, **extra))


def window_variants(cfg, seq_len: int, window: int):
    """(full attention, sliding window) Mistral configs at `seq_len`, one row a device's share of the batch."""
    rows = cfg.mesh.num_devices // (cfg.mesh.tensor * cfg.mesh.stage)
    long = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq_len, batch_size=rows))
    return family_variant(long, "mistral", 0), family_variant(long, "mistral", window)


def interleaved(configs: dict, steps: int, rounds: int = 3) -> dict:
    """{name: the median-tokens/s run of `rounds` interleaved rounds}."""
    runs = {name: [] for name in configs}
    for _ in range(rounds):
        for name, cfg in configs.items():
            runs[name].append(bare_step_throughput(cfg, steps))
    return {name: sorted(r, key=lambda x: x["tokens_per_sec"])[rounds // 2] for name, r in runs.items()}


def main(argv) -> int:
    args, cfg = bench_arguments(argv, __doc__, add=lambda p: p.add_argument(
        "--window_seq_len", type=int, default=4096, help="sequence length of the window comparison"))
    families = interleaved({name: family_variant(cfg, name, cfg.train.seq_len // 4) for name in DENSE_FAMILIES},
                           args.steps)
    base = families["llama"]["tokens_per_sec"]
    m = cfg.model
    print(f"model L{m.num_layers} D{m.dim} N{m.num_heads}/K{m.num_kv_heads} H{m.head_dim} F{m.mlp_dim} | batch "
          f"{cfg.train.batch_size}x{cfg.train.seq_len} | mesh {cfg.mesh.shape} | compute {cfg.precision.compute}")
    for name, r in families.items():
        print(f"{name:<8} {r['tokens_per_sec']:>10,.0f} tok/s  {r['tokens_per_sec'] / base:.3f} of llama  "
              f"temp {r['temp_mb']:.1f} MB/device")
    full, windowed = window_variants(cfg, args.window_seq_len, 512)
    window = interleaved({"full": full, "window_512": windowed}, max(2, args.steps // 5))
    ratio = window["window_512"]["tokens_per_sec"] / window["full"]["tokens_per_sec"]
    print(f"T {args.window_seq_len}: window 512 {window['window_512']['tokens_per_sec']:,.0f} tok/s vs full "
          f"{window['full']['tokens_per_sec']:,.0f}: {ratio:.3f}x")
    print(json.dumps({"bench": "families", "families": {k: v["tokens_per_sec"] for k, v in families.items()},
                      "over_llama": {k: v["tokens_per_sec"] / base for k, v in families.items()},
                      "window": {k: v["tokens_per_sec"] for k, v in window.items()}, "window_over_full": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

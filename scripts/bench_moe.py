"""Price of a mixture of experts: `python scripts/bench_moe.py --config configs/pretrain_moe.py [--steps N]
[--config.x=v]`.

Times the bare train step (scripts/bench_step.py's) of the config's mixture-of-experts model with dropless
dispatch (grouped matmuls over ragged groups), with capacity dispatch (`model.moe_capacity_factor`), and of the
dense model with the same active parameters (one MLP of experts_per_token x mlp_dim hidden units), interleaved over
3 rounds, and prints each one's median tokens/s over the dense model's, then with the experts split over
`--expert` devices of the mesh (the config's mesh with its data axis given to `expert`). One JSON line at the end.
"""

import dataclasses
import json
import sys

from bench_families import interleaved
from bench_step import bench_arguments

from jaxllm.config.schema import ConfigError


def variants(cfg, expert: int) -> dict:
    """The configs compared: dropless, capacity, the dense model of equal active parameters, and dropless with the
    experts over `expert` devices (taken from `data`)."""
    m = cfg.model
    if not m.num_experts:
        raise ConfigError("model.num_experts", "the config's model has no experts (try configs/pretrain_moe.py)")
    with_model = lambda **kw: dataclasses.replace(cfg, model=dataclasses.replace(m, **kw))
    out = {"dropless": with_model(moe_dispatch="dropless"), "capacity": with_model(moe_dispatch="capacity"),
           "dense": with_model(family="mistral", num_experts=0, mlp_dim=m.experts_per_token * m.mlp_dim)}
    if expert > 1 and cfg.mesh.data % expert == 0:
        mesh = dataclasses.replace(cfg.mesh, data=cfg.mesh.data // expert, expert=expert)
        out[f"dropless, expert={expert}"] = dataclasses.replace(out["dropless"], mesh=mesh)
    return out


def main(argv) -> int:
    args, cfg = bench_arguments(argv, __doc__, steps=5, add=lambda p: p.add_argument(
        "--expert", type=int, default=2, help="devices of the expert axis in the last variant (from data)"))
    try:
        configs = variants(cfg, args.expert)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs = interleaved(configs, args.steps)
    base = runs["dense"]["tokens_per_sec"]
    m = cfg.model
    print(f"model L{m.num_layers} D{m.dim} E{m.num_experts} top {m.experts_per_token} F{m.mlp_dim} (dense: F"
          f"{m.experts_per_token * m.mlp_dim}) | batch {cfg.train.batch_size}x{cfg.train.seq_len} | mesh "
          f"{cfg.mesh.shape} | capacity factor {m.moe_capacity_factor} | compute {cfg.precision.compute}")
    for name, r in runs.items():
        print(f"{name:<20} {r['tokens_per_sec']:>10,.0f} tok/s  {r['tokens_per_sec'] / base:.3f} of dense  "
              f"compile {r['compile_s']:.1f} s  temp {r['temp_mb']:.1f} MB/device")
    print(json.dumps({"bench": "moe", "tokens_per_sec": {k: v["tokens_per_sec"] for k, v in runs.items()},
                      "over_dense": {k: v["tokens_per_sec"] / base for k, v in runs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Benchmark checkpoints: `python scripts/bench_checkpoint.py [--dir DIR] [--repeats N] [--size SIZE]`.

Builds a train state of ~1 GB (parameters + AdamW moments, float32; `--size 200mb`: ~200 MB, `--size default`:
the default job's model, a few MB) on the 8-device (2,2,2,1) CPU mesh (any
other device count: all devices on fsdp, or `--mesh data,fsdp,tensor,stage`), then
times an async orbax save (the blocking part and the total until commit, which includes the checksum manifest),
the checksum verification a restore starts with, the restore itself (verification included) onto the mesh, and,
as the baseline, writing the same bytes with numpy to the same disk. Prints a table and one JSON line.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.runs.checkpoint import Checkpointer, directory_bytes  # noqa: E402
from jaxllm.config.schema import MeshConfig, ModelConfig, OptimConfig, PrecisionConfig  # noqa: E402
from jaxllm.parallel.mesh import make_mesh  # noqa: E402
from jaxllm.optim.chain import make_optimizer  # noqa: E402
from jaxllm.objectives.pretrain import abstract_train_state, create_train_state

# ~100M parameters: x3 (parameters, Adam mu and nu) x 4 bytes ~ 1.2 GB of state.
MODEL = ModelConfig(vocab_size=16384, dim=1024, num_layers=4, num_heads=16, num_kv_heads=16, head_dim=64,
                    mlp_dim=4096)
SIZES = {"1gb": MODEL,
         "200mb": ModelConfig(vocab_size=8192, dim=512, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=64,
                              mlp_dim=2048),
         # configs/pretrain.py's model
         "default": ModelConfig(vocab_size=512, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                mlp_dim=768)}
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")


def numpy_write(state, directory: Path) -> float:
    """Seconds to fetch every array to host and write it with numpy (fsynced), the plain-disk baseline."""
    directory.mkdir(parents=True)
    start = time.perf_counter()
    for i, leaf in enumerate(jax.tree.leaves(state)):
        with open(directory / f"{i}.npy", "wb") as f:
            np.save(f, np.asarray(leaf))
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mesh", default=None, help="data,fsdp,tensor,stage sizes (default: 2,2,2,1 on 8 devices, "
                                                 "else 1,<devices>,1,1)")
    p.add_argument("--pinned", choices=("auto", "on", "off"), default="auto",
                   help="copy to page-locked host memory first (auto: orbax's default, on for GPUs)")
    p.add_argument("--size", choices=sorted(SIZES), default="1gb", help="the model whose train state is saved")
    args = p.parse_args(argv)
    model = SIZES[args.size]
    n = jax.device_count()
    try:
        sizes = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else ((2, 2, 2, 1) if n == 8 else (1, n, 1, 1))
        if len(sizes) != 4 or np.prod(sizes) != n:
            raise ValueError
    except ValueError:
        p.error(f"--mesh: expected 4 comma-separated sizes whose product is the device count {n}, got {args.mesh!r}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="jaxllm-bench-ckpt-"))
    mesh = make_mesh(MeshConfig(*sizes))
    tx = make_optimizer(OptimConfig(), 100)
    _, state, _ = create_train_state(model, F32, tx, mesh, seed=0)
    # Random values everywhere (fresh Adam moments are zeros, which compress to nothing and flatter the writer).
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: jax.device_put(rng.standard_normal(x.shape, np.float32).astype(x.dtype), x.sharding)
                         if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, state)
    jax.block_until_ready(state)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))

    rows = []
    ckpt = Checkpointer(root / "orbax", keep=args.repeats + 1, log=lambda msg: None,
                        pinned_host_transfer={"auto": None, "on": True, "off": False}[args.pinned])
    for r in range(args.repeats):
        start = time.perf_counter()
        ckpt.save(r + 1, state, {"step": r + 1}, {})
        blocking = time.perf_counter() - start
        ckpt.wait()
        total = time.perf_counter() - start
        start = time.perf_counter()
        ckpt.verify(r + 1)
        verify = time.perf_counter() - start
        start = time.perf_counter()
        restored = ckpt.restore(r + 1, abstract_train_state(model, F32, tx), mesh, items=("state",))
        jax.block_until_ready(restored)
        restore = time.perf_counter() - start
        baseline = numpy_write(state, root / f"numpy{r}")
        rows.append(dict(blocking_s=blocking, total_s=total, restore_s=restore, verify_s=verify, numpy_write_s=baseline,
                         bytes=directory_bytes(root / "orbax" / str(r + 1))))
    ckpt.close()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)

    print(f"train state {state_bytes / 1e9:.2f} GB ({model.num_layers} layers, D={model.dim}, V={model.vocab_size}) "
          f"on mesh {sizes}, {jax.devices()[0].device_kind}, pinned host transfer {args.pinned}")
    print(f"{'run':<4} {'blocking s':>11} {'total s':>9} {'blocking/total':>15} {'restore s':>10} "
          f"{'verify s':>9} {'numpy write s':>14} {'total/numpy':>12} {'GB/s':>7}")
    for i, r in enumerate(rows):
        print(f"{i:<4} {r['blocking_s']:>11.2f} {r['total_s']:>9.2f} {r['blocking_s'] / r['total_s']:>15.2f} "
              f"{r['restore_s']:>10.2f} {r['verify_s']:>9.3f} {r['numpy_write_s']:>14.2f} {r['total_s'] / r['numpy_write_s']:>12.2f} "
              f"{r['bytes'] / r['total_s'] / 1e9:>7.2f}")
    worst = max(r["blocking_s"] / r["total_s"] for r in rows)
    print(f"blocking part of the async save: at most {100 * worst:.0f}% of the total over {len(rows)} saves, the "
          "first included (target <= 25%)")
    print(json.dumps({"bench": "checkpoint", "state_bytes": state_bytes, "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

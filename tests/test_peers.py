"""The peer benchmark's own parts that run without MaxText's environment (scripts/bench_peers.py): the bare
reference step computes the harness's model, and the driver refuses what it cannot run in one line. MaxText's
runner (scripts/peers/maxtext_run.py) needs build/peers/maxtext and is exercised by `make bench-peers` only."""

import json
import math
import subprocess
import sys

from train_runs import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "peers"))
import bare_llama  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import bench_matmul_floor  # noqa: E402

TINY = dict(layers=2, dim=64, heads=4, kv_heads=2, mlp_dim=172, vocab=512, seq=32, batch=8)


def test_the_bare_step_is_the_harness_model(capsys):
    """On 8 devices the bare step has exactly the parameter count of the harness's Llama (untied head, no biases,
    head_dim = dim / heads) and starts at the loss of a uniform guess, ln(vocabulary)."""
    args = [f"--{k}={v}" for k, v in TINY.items()] + ["--steps=1", "--devices=8", "--dtype=float32"]
    assert bare_llama.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    L, D, H, K, F, V = (TINY[k] for k in ("layers", "dim", "heads", "kv_heads", "mlp_dim", "vocab"))
    hd = D // H
    assert result["params"] == 2 * V * D + L * (D * (H + 2 * K) * hd + H * hd * D + 3 * D * F + 2 * D) + D
    assert abs(result["loss"] - math.log(V)) < 0.5 and result["tokens_per_sec"] > 0


def test_the_driver_refuses_an_unknown_config_or_a_missing_environment(tmp_path):
    """One line naming the option and what was expected, exit 2, before anything runs."""
    script = str(ROOT / "scripts" / "bench_peers.py")
    unknown = subprocess.run([sys.executable, script, "--configs", "huge", "--jaxllm_python", sys.executable,
                              "--maxtext_python", sys.executable], capture_output=True, text=True)
    missing = subprocess.run([sys.executable, script, "--configs", "small", "--jaxllm_python", sys.executable,
                              "--maxtext_python", str(tmp_path / "python")], capture_output=True, text=True)
    assert unknown.returncode == 2 and unknown.stderr == "error: --configs: unknown config 'huge', expected some of " \
                                                        "['medium', 'small']\n"
    assert missing.returncode == 2
    assert missing.stderr == f"error: --maxtext_python: no Python at {tmp_path / 'python'} (`make bench-peers` " \
                             "builds the environments)\n"


def test_the_matmul_floor_multiplies_every_weight_of_the_harness_model():
    """The floor's products take every matrix of the bare step's model (all but the embedding table, which is a
    gather, and the norms' scales) and give each a gradient: the products of a step, forward and backward."""
    import jax
    import jax.numpy as jnp

    loss_fn, weights, x = bench_matmul_floor.products_only(TINY, jnp.float32)
    grads = jax.grad(loss_fn)(weights, x)
    L, D, H, K, F, V = (TINY[k] for k in ("layers", "dim", "heads", "kv_heads", "mlp_dim", "vocab"))
    hd = D // H
    sizes = [g.size for g in jax.tree.leaves(grads)]
    assert sum(sizes) == V * D + L * (D * (H + 2 * K) * hd + H * hd * D + 3 * D * F)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads))

"""MFU's two halves: the peak FLOP/s table (by device kind and compute dtype) and the FLOPs-per-token count."""

import math
import os
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest
from flax import nnx

from jaxllm.observe import metrics
from jaxllm.config.schema import ModelConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.transformer import train_flops_per_token
from jaxllm.model.head import next_token_loss
from jaxllm.model.build import build_model


def gpu(kind: str):
    return SimpleNamespace(platform="gpu", device_kind=kind)


@pytest.mark.parametrize("kind,dtype,want", [
    ("NVIDIA H200", "bfloat16", 989e12), ("NVIDIA H200", "float32", 494.7e12),
    ("NVIDIA H100 80GB HBM3", "float16", 989e12), ("NVIDIA H100 80GB HBM3", "float32", 494.7e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12), ("NVIDIA A100-SXM4-80GB", "float32", 156e12),
])
def test_peak_follows_the_compute_dtype(kind, dtype, want):
    assert metrics.peak_flops_per_device(compute_dtype=dtype, device=gpu(kind)) == want


def test_unknown_device_gives_nan_mfu_and_warns_once(monkeypatch):
    monkeypatch.setattr(metrics, "_warned_kinds", set())
    monkeypatch.setattr(metrics.jax, "local_devices", lambda: [gpu("NVIDIA B200")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peaks = [metrics.peak_flops_per_device(compute_dtype="bfloat16") for _ in range(3)]
    assert all(math.isnan(p) for p in peaks)
    assert math.isnan(metrics.mfu(1e5, 1e9, 8, peaks[0]))
    assert len(caught) == 1 and "NVIDIA B200" in str(caught[0].message) and "peak_flops" in str(caught[0].message)
    assert metrics.peak_flops_per_device(override=1e15) == 1e15  # the config value still wins


def test_flops_per_token_matches_xla_count_of_forward_and_backward():
    """PaLM's 6N + 12*L*H*Q*T against XLA's own count of one gradient computation (non-causal: XLA computes the
    whole T x T score matrix, masked). One layer: cost_analysis counts a scan's body once, whatever its length.
    The rest (norms, softmax, RoPE, the loss) is elementwise and stays under 3% of the matmuls here."""
    cfg = ModelConfig(vocab_size=256, dim=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=512)
    batch_size, seq_len = 2, 128
    model = build_model(cfg, PrecisionConfig(params="float32", compute="float32", output="float32"),
                        jax.random.key(0))
    graphdef, params = nnx.split(model)
    batch = synthetic_batch(0, batch_size, seq_len, cfg.vocab_size)

    def loss(params):
        loss_sum, count, _ = next_token_loss(nnx.merge(graphdef, params), batch)
        return loss_sum / count

    cost = jax.jit(jax.grad(loss)).lower(params).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_per_token = cost["flops"] / (batch_size * seq_len)
    assert xla_per_token == pytest.approx(train_flops_per_token(cfg, seq_len), rel=0.03)


def test_tests_never_write_into_the_real_home_cache():
    """conftest.py points every cache at a session temporary directory: the CPU peak measurement (written on
    first use) lands there, and the training subprocesses inherit the same locations."""
    from train_runs import train_env

    real = (Path.home() / ".cache").resolve()
    temporary = Path(tempfile.gettempdir()).resolve()
    variables = ("XDG_CACHE_HOME", "JAXLLM_CACHE", "HF_HOME", "TORCH_HOME", "MPLCONFIGDIR")
    for name in variables:
        path = Path(os.environ[name]).resolve()
        assert path.is_relative_to(temporary) and not path.is_relative_to(real), (name, path)
        assert train_env()[name] == os.environ[name]
    assert metrics.CPU_PEAK_CACHE.resolve().is_relative_to(Path(os.environ["JAXLLM_CACHE"]).resolve())
    assert metrics.peak_flops_per_device(compute_dtype="float32", device=jax.devices("cpu")[0]) > 0
    assert metrics.CPU_PEAK_CACHE.exists()


def test_mfu_is_the_model_flops_over_every_device_s_peak():
    """MFU = tokens/s x (6N + 12*L*H*Q*T) / (devices x peak), with N counted here from the built model's own
    projection and head kernels (not from the formula under test), on 8 devices and on 1."""
    cfg = ModelConfig(vocab_size=512, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
    params = nnx.state(build_model(cfg, PrecisionConfig("float32", "float32", "float32"), jax.random.key(0)),
                       nnx.Param)
    n = sum(v.get_value().size for path, v in nnx.to_flat_state(params)
            if path[-1].endswith("_proj") or path[-1] == "lm_head")
    seq_len, tokens_per_sec, peak = 256, 2.5e4, 1e12
    per_token = 6 * n + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    assert train_flops_per_token(cfg, seq_len) == per_token
    on_8 = metrics.mfu(tokens_per_sec, per_token, 8, peak)
    assert on_8 == pytest.approx(tokens_per_sec * per_token / (8 * peak))
    assert metrics.mfu(tokens_per_sec, per_token, 1, peak) == pytest.approx(8 * on_8)

"""MFU's two halves: the peak FLOP/s table (by device kind and compute dtype) and the FLOPs-per-token count."""

import math
import warnings
from types import SimpleNamespace

import jax
import pytest
from flax import nnx

from jaxllm import metrics
from jaxllm.config import ModelConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.model.transformer import train_flops_per_token
from jaxllm.train.pretrain import next_token_loss
from jaxllm.train.state import build_model


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

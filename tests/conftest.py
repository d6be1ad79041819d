"""Test set-up: 8 fake CPU devices, fixed before JAX initialises its backend."""
import os

# 8 fake devices share 2 cores: under load one device thread can reach a collective long after the others,
# so XLA's 40 s rendezvous limit is raised to 180 s (still failing fast on a real deadlock).
CPU_FLAGS = (
    "--xla_force_host_platform_device_count=8"
    " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
    " --xla_cpu_collective_call_terminate_timeout_seconds=180"
)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)

# Parity tests compare layouts at 1e-5: keep matmuls in true float32 on CPU.
jax.config.update("jax_default_matmul_precision", "highest")
# Many queued multi-device CPU executions can deadlock XLA's CPU collectives (seen here: 150 undispatched
# train steps hung in a rendezvous). In-process tests run each computation synchronously; the training loop
# itself never has more than two steps in flight.
jax.config.update("jax_cpu_enable_async_dispatch", False)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shakespeare_store(tmp_path_factory):
    """The shipped corpus prepared into a token store (vocab 512), once per test session (~4 s)."""
    from jaxllm.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "shakespeare"
    prepare([str(ROOT / "data" / "shakespeare.jsonl.gz")], str(out), vocab_size=512, log=lambda *a, **k: None)
    return out

"""Running `scripts/train.py` as real processes in tests: the command line, the environment, metrics, ports."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The tiny model on short rows with one eval batch and no sample: seconds per step on 8 fake CPU devices.
TINY = ("--config.model.preset=tiny", "--config.model.vocab_size=512", "--config.train.seq_len=32",
        "--config.train.eval_batches=1", "--config.train.sample_tokens=0")


# Test runs compile the same tiny programs over and over, one process at a time: an XLA compilation cache shared
# by this session's subprocesses turns a run's ~10 s of compiling into ~1.5 s after the first. (JAX falls back
# to compiling, with a warning, if it ever reads a damaged entry.)
COMPILATION_CACHE = tempfile.mkdtemp(prefix="jaxllm-test-xla-cache-")
atexit.register(shutil.rmtree, COMPILATION_CACHE, ignore_errors=True)


def train_command(store, workdir, *args: str) -> list[str]:
    """`python scripts/train.py` on configs/pretrain.py with the tiny model; later `args` override earlier ones."""
    return [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / "pretrain.py"),
            "--workdir", str(workdir), f"--config.data.path={store}", *TINY, *args]


def train_env(devices: int = 8, **extra: str) -> dict[str, str]:
    """This environment on CPU with `devices` fake devices per process (keeping conftest's other XLA flags)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    flags = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=flags,
                JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1", **extra)


def metrics(workdir) -> list[dict]:
    return [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def losses(workdir) -> dict[int, float]:
    """Training loss by step from a run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in metrics(workdir) if "loss" in r}


def free_port_pair() -> int:
    """A port p with p and p + 1 both free (the coordinator and the start-up rendezvous)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")

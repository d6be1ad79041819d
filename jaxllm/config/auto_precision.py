"""`precision.compute=auto`: bfloat16 where the hardware computes it natively, float32 where it does not.

GPUs and TPUs compute bfloat16 natively. On CPUs, XLA runs bf16 matmuls natively only with AVX512-BF16 or AMX
(x86) or the BF16 extension (Arm); without them it converts to float32 and back around every op, and the job
runs ~1.7x slower than in float32 (measured on an AVX2-only machine). Opt-in: configs/pretrain.py and the tests
keep float32, so figures and tolerances never depend on the machine.
"""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo names of native bf16 arithmetic: x86 "flags", Arm "Features".
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU feature flags the kernel reports (empty where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def auto_compute(platform: str, flags: set[str]) -> tuple[str, str]:
    """(compute dtype, the reason in words) for a backend `platform` ("cpu", "gpu", "tpu"...) and CPU `flags`."""
    if platform != "cpu":
        return "bfloat16", f"{platform} computes bfloat16 natively"
    native = sorted(set(NATIVE_BF16_FLAGS) & flags)
    if native:
        return "bfloat16", f"this CPU computes bfloat16 natively ({', '.join(native)})"
    return "float32", f"this CPU has no native bfloat16 ({' / '.join(NATIVE_BF16_FLAGS)}), where float32 is faster"


def resolve_compute() -> tuple[str, str]:
    """`auto_compute` for this process's default JAX backend and CPU."""
    import jax  # start-up speed: configs load and are checked before JAX does

    return auto_compute(jax.default_backend(), cpu_flags())

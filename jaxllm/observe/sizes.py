"""Byte counts as people read them, one spelling for every diagnostic (memory lines, communication tables, the
out-of-memory summary and the diagnosis report)."""

BYTE_UNITS = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
GB = 10**9  # the decimal gigabyte of `train.memory_budget_gb`


def format_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit it reaches, with two decimals ("9.79 MiB"); "512 B" below 1 KiB."""
    for unit, scale in BYTE_UNITS.items():
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"

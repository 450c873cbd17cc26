"""Engine defaults and choices as plain values, and how byte sizes are shown: what the CLI's
parsers and help need, importable without torch or transformers (`batchgen --help` stays fast).
config.py, kv_plan.py and the CLI take them from here."""

from __future__ import annotations

# CPU pools default to at most this much memory (vLLM's CPU default is 4 GiB too).
DEFAULT_CPU_KV_BYTES = 4 << 30
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")


def format_bytes(n: float) -> str:
    """Binary units, three significant decimals where they matter: 0.781 MiB, 1.56 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.1f} {unit}"
    return f"{n:.0f} bytes"

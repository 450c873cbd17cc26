"""Keep large host allocations on the heap (glibc malloc) for CPU inference.

A CPU forward allocates and frees activations of many MB per op. By default glibc serves
blocks that large with fresh mmap()s and unmaps them on free, so every step page-faults (and
zeroes) its activations again; on the throughput benchmark that is ~1M page faults and ~6% of
the wall time. Raising the mmap and trim thresholds lets freed blocks be reused instead. The
setting is process-wide and applied once, when an `LLM` on the CPU is built;
BATCHGEN_MALLOC_TUNING=0 leaves malloc alone. Freed memory then stays with the process (up to
the trim threshold) rather than going back to the OS at once.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

ENV_SWITCH = "BATCHGEN_MALLOC_TUNING"  # "0" disables the tuning
# glibc mallopt() parameters (malloc.h) and the values batchgen sets
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit: blocks below it come from the heap
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of free heap top instead of returning it
TOP_PAD = 64 << 20  # grow the heap in 64 MiB steps


def tune_host_allocator() -> bool:
    """Apply the thresholds once per process; True if glibc accepted them."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    return _apply()


@lru_cache(maxsize=1)
def _apply() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(p, v) == 1 for p, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                              (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                                              (M_TOP_PAD, TOP_PAD)))

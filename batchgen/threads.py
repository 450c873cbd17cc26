"""Whether torch's CPU threads fit the machine: one warning when they cannot all run at once.

Intra-op threads that outnumber the cores this process may use, or that share the cores with
other busy processes, wait on each other at every op: on a loaded 2-core host one thread ran
8x faster than two. batchgen never changes the count itself (a request's bits depend on it,
see "Batch invariance" in docs/ARCHITECTURE.md); it says so once and names the settings
(`OMP_NUM_THREADS`, `torch.set_num_threads`)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("batchgen")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def host_load() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def thread_advice(threads: int, cores: int, load: float | None) -> str | None:
    """What to say when `threads` intra-op threads cannot all run on `cores` cores under
    `load` (this process counts for one of it), or None when they can."""
    fix = ("set OMP_NUM_THREADS=N before starting Python, or call torch.set_num_threads(N); "
           "outputs depend on the thread count, so keep it fixed for reproducible runs")
    if threads > cores:
        return (f"torch uses {threads} CPU threads but this process may run on {cores} "
                f"core{'s' if cores > 1 else ''}: they wait on each other ({fix}, N <= {cores})")
    others = max((load or 0.0) - 1.0, 0.0)
    if threads > 1 and threads + others > cores + 0.5:
        return (f"the host is busy (load average {load:.1f} on {cores} cores) and torch uses "
                f"{threads} threads, which then wait on each other: fewer may run faster "
                f"({fix}, e.g. N=1)")
    return None


def warn_if_oversubscribed() -> str | None:
    """Log the advice once for this machine's figures (returns it, None when none)."""
    import torch

    advice = thread_advice(torch.get_num_threads(), available_cores(), host_load())
    if advice is not None:
        logger.warning(advice)
    return advice

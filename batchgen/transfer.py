"""Host-device transfers of a step, so that its one synchronisation is the sampler's copy
back to the host: small host arrays go to the GPU from pinned memory, asynchronously (from
pageable memory the copy would wait for the queued forward)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device` (the array itself on the CPU)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@contextlib.contextmanager
def designated_sync() -> Iterator[None]:
    """Around the step's one synchronisation: silent under torch.cuda's sync debug mode,
    which a test sets to catch every other one."""
    mode = torch.cuda.get_sync_debug_mode()
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)

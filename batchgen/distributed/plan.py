"""Which device a tensor-parallel rank runs on (the checks made before any weights load are
factory.check_tp)."""

from __future__ import annotations

import torch


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th visible GPU on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device

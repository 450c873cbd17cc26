"""The contract every paged-attention backend meets: built once from the layers' specs and the
pool, plan once per step, run once per layer."""

from __future__ import annotations

from typing import Protocol

import torch

from batchgen.attention.metadata import StepMetadata


class AttentionBackend(Protocol):
    """Paged attention over one KVCache, driven by one StepMetadata per step. Constructed as
    `Backend(specs, cache)`; `specs[layer]` gives each layer's heads, scale, window, softcap
    and sinks."""

    name: str

    def plan(self, meta: StepMetadata) -> None:
        """Prepare everything shared by the step's layers (index tensors, masks, kernel plans)."""

    def run(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the layer's cached K/V (this step's already written);
        returns [T, Hq, Dv]."""

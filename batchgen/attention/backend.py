"""The contract every paged-attention backend meets: plan once per step, run once per layer."""

from __future__ import annotations

from typing import Protocol

import torch

from batchgen.attention.metadata import StepMetadata
from batchgen.kv.cache import KVCache


class AttentionBackend(Protocol):
    """Paged attention over a KVCache, driven by one StepMetadata per step."""

    name: str

    def plan(self, meta: StepMetadata) -> None:
        """Prepare everything shared by the step's layers (index tensors, masks, kernel plans)."""

    def run(self, layer: int, q: torch.Tensor, cache: KVCache, scale: float,
            window: int | None, softcap: float | None, sinks: torch.Tensor | None
            ) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the layer's cached K/V (this step's already written);
        returns [T, Hq, Dv]. `window` counts the current token (HF semantics)."""

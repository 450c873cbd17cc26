"""The contract every paged-attention backend meets: built once from the layers' specs and the
pool, plan once per step, run once per layer."""

from __future__ import annotations

from typing import Protocol

import torch

from batchgen.attention.metadata import StepMetadata


class BackendUnavailable(RuntimeError):
    """A backend's library or kernel cannot be loaded here, or it cannot serve the model's
    layers (the message says why)."""


class KernelBuildFailed(BackendUnavailable):
    """The backend's kernels could not be built or loaded on this machine (a missing
    compiler, a failed JIT build): worth a warning, since the fallback is slower."""


class AttentionBackend(Protocol):
    """Paged attention over one KVCache, driven by one StepMetadata per step. Built from the
    layers' specs (`specs[layer]`: heads, head dims, scale, window, softcap, sinks, dtype),
    the pool and the most tokens a step has; raises BackendUnavailable for specs it cannot
    serve."""

    name: str

    def plan(self, meta: StepMetadata) -> None:
        """Prepare everything shared by the step's layers (index tensors, masks, kernel plans)."""

    def run(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the layer's cached K/V (this step's already written);
        returns [T, Hq, Dv]."""

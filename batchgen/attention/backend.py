"""The contract every paged-attention backend meets: built once from the layers' specs and the
pool, plan once per step, run once per layer. What a backend needs beyond that it declares
(`supports_graphs` here; KV layout, memory beyond the pool and graphs in its registry entry), so
the LLM and the runner never name a backend."""

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
    supports_graphs: bool  # True only for a GraphBackend: decode steps can be CUDA graphs

    def plan(self, meta: StepMetadata) -> None:
        """Prepare everything shared by the step's layers (index tensors, masks, kernel plans)."""

    def run(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the layer's cached K/V (this step's already written);
        returns [T, Hq, Dv]."""


class GraphBackend(AttentionBackend, Protocol):
    """A backend whose decode steps can be captured as CUDA graphs: it plans outside the
    graph, before every replay, on wrappers fixed per captured batch size."""

    def reserve_graph_buffers(self, max_batch: int, max_pages: int) -> None:
        """Allocate the index buffers every captured size's plans write (once, before capture)."""

    def graph_plan(self, meta: StepMetadata, batch_size: int) -> None:
        """Plan a decode step padded to `batch_size` rows, outside the graph."""

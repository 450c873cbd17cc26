"""CUDA-graph decode: a decode-only step replays a graph captured for the next batch size up.

Sizes 1, 2, 4, 8, then every 8 up to max_num_seqs, captured largest first into one memory pool.
Every graph reads the runner's step buffers (input ids, positions, slot mapping, logits rows) at
fixed addresses; rows past the step's sequences are one-token dummies in the scratch block. The
attention backend plans that size's decode wrappers outside the graph before every replay
(`graph_plan`); a stale plan would replay yesterday's page tables. Mixed and prefill steps stay
eager. Only a GraphBackend (`supports_graphs`: FlashInfer) can be captured.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

import torch

from batchgen.attention.backend import GraphBackend
from batchgen.attention.interface import StepContext
from batchgen.attention.metadata import SeqChunk, StepRows
from batchgen.kv.cache import KVCache
from batchgen.model.inputs import StepInputs

# GPU memory kept for the graphs' private pool when the KV pool is sized from free memory. An
# allowance, not a measurement: the pool holds the largest captured decode step's intermediates
# (max_num_seqs rows: hidden states, MLP activations, logits [rows, vocab] in the model dtype,
# 63 MiB for 256 rows of a 128k vocabulary; smaller sizes reuse it); it also covers the
# backend's graph index buffers (4 bytes a page: 2 MiB for 256 rows of 32k tokens).
GRAPH_POOL_BYTES = 256 << 20


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to max_num_seqs (and it)."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class GraphCapturer(Protocol):
    """Captures `fn` once; returns (replay, the output tensor every replay rewrites)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        ...


class CudaGraphCapturer:
    """torch.cuda graphs sharing one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


class DecodeGraphs:
    """One captured decode step per batch size, over the runner's step buffers and the
    backend's graph wrappers. The model, pool and backend are the runner's."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, backend: GraphBackend,
                 inputs: StepInputs, sizes: list[int], max_pages: int,
                 capturer: GraphCapturer) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.inputs = inputs
        self.sizes = sorted(sizes)
        self.capturer = capturer
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        backend.reserve_graph_buffers(self.sizes[-1], max_pages + self.sizes[-1])

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds `num_seqs` rows (None: run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size, largest first (smaller graphs reuse its memory)."""
        scratch = self.cache.scratch_block
        for size in reversed(self.sizes):
            dummy = StepRows.from_chunks([SeqChunk([0], [scratch], 0, 1)] * size)
            step = self._prepare(dummy, size)
            step()  # eager warm-up: kernel builds, allocator settles
            self.graphs[size] = self.capturer.capture(step)

    @torch.inference_mode()
    def replay(self, rows: StepRows) -> torch.Tensor:
        """Run a decode step (one token per row) through its size's graph; float32 logits
        [R, vocab] in row order."""
        size = self.size_for(rows.num_rows)
        assert size is not None and len(rows.token_ids) == rows.num_rows
        batch = self.inputs.prepare(rows, pad_to=size)
        self.backend.graph_plan(batch.meta, size)
        replay, logits = self.graphs[size]
        replay()
        return logits[:batch.num_logits].float()

    def _prepare(self, rows: StepRows, size: int) -> Callable[[], torch.Tensor]:
        """Fill the buffers and plan for a padded decode batch; returns the forward to capture
        (it reads only the buffers and the planned wrappers)."""
        batch = self.inputs.prepare(rows, pad_to=size)
        self.backend.graph_plan(batch.meta, size)
        ctx = StepContext(self.cache, self.backend, batch.slot_mapping)

        def forward() -> torch.Tensor:
            out = self.model(input_ids=batch.input_ids[None], position_ids=batch.positions[None],
                             use_cache=False, logits_to_keep=batch.logits_indices,
                             batchgen_step=ctx)
            return out.logits[0]

        return forward

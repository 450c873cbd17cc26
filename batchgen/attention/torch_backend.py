"""The pure-PyTorch backend ("torch"): any device, the reference for every other backend.

Decode rows whose block tables start with the same blocks (forked samples, beams, cached
prefixes) decode as a two-level cascade (cascade.py); every other row goes through SDPA over
gathered blocks (sdpa.py).
"""

from __future__ import annotations

import torch

from batchgen.attention.cascade import Cascade, plan_cascades, run_cascade
from batchgen.attention.metadata import StepMetadata
from batchgen.attention.sdpa import TiledBackend
from batchgen.attention.spec import AttentionSpec
from batchgen.kv.cache import KVCache


class TorchBackend(TiledBackend):
    """SDPA tiles plus the decode cascade."""

    name = "torch"

    def __init__(self, specs: list[AttentionSpec], cache: KVCache) -> None:
        super().__init__(specs, cache)
        self.cascade: Cascade | None = None

    def plan(self, meta: StepMetadata) -> None:
        qo, kv_lens, pages = meta.as_lists()
        self.cascade, covered = plan_cascades(qo, kv_lens, pages, meta.block_size,
                                              self.cache.device)
        rest = (i for i in range(len(kv_lens)) if i not in covered)
        self.tiles.plan(qo, kv_lens, pages, rest, meta.block_size, meta.spans)

    def run_rest(self, layer: int, q: torch.Tensor,
                 kv_blocks: tuple[torch.Tensor, torch.Tensor],
                 spec: AttentionSpec, out: torch.Tensor, scales: tuple[float, float]) -> None:
        if self.cascade is not None:
            run_cascade(self.cascade, q, kv_blocks, spec, out, scales)

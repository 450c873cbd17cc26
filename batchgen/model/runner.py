"""One packed forward of the HF model over a ragged batch: [1, T] tokens, explicit positions,
no HF cache, logits only at the rows the sampler needs."""

from __future__ import annotations

import torch

from batchgen.attention.backend import AttentionBackend
from batchgen.attention.interface import StepContext
from batchgen.attention.metadata import StepMetadata
from batchgen.kv.cache import KVCache


class ModelRunner:
    """Owns nothing but references: the model (loader's), the pool and backend (engine's)."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, backend: AttentionBackend,
                 device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = device

    @torch.inference_mode()
    def execute(self, input_ids: list[int], meta: StepMetadata) -> torch.Tensor:
        """Run one step; returns float32 logits [meta.num_logits, vocab]."""
        dev = self.device
        if len(input_ids) < meta.num_tokens:  # padding rows (token 0) that the metadata added
            input_ids = input_ids + [0] * (meta.num_tokens - len(input_ids))
        self.backend.plan(meta)
        ctx = StepContext(self.cache, self.backend, meta.slot_mapping.to(dev, torch.long))
        out = self.model(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev)[None],
            position_ids=meta.positions.to(dev, torch.long)[None],
            use_cache=False,
            logits_to_keep=meta.logits_indices.to(dev, torch.long),
            batchgen_step=ctx,
        )
        return out.logits[0, :meta.num_logits].float()

"""The model runner: owns the step's inputs (persistent buffers) and runs one packed forward of
the HF model over a ragged batch: [1, T] tokens, explicit positions, no HF cache, logits only at
the rows the sampler needs."""

from __future__ import annotations

import torch

from batchgen.attention.backend import AttentionBackend
from batchgen.attention.interface import StepContext
from batchgen.attention.metadata import SeqChunk
from batchgen.kv.cache import KVCache
from batchgen.model.inputs import StepInputs


class ModelRunner:
    """The model is the loader's, the pool and the backend are the LLM's; the step buffers
    (`inputs`) are the runner's own."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, backend: AttentionBackend,
                 inputs: StepInputs) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.inputs = inputs

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The step's copy-on-write block copies, before its forward writes anything."""
        self.cache.copy_blocks(copies)

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Run one step; returns float32 logits [R, vocab], row i for the i-th chunk that wants
        logits."""
        batch = self.inputs.prepare(chunks)
        self.backend.plan(batch.meta)
        out = self.model(
            input_ids=batch.input_ids[None],
            position_ids=batch.positions[None],
            use_cache=False,
            logits_to_keep=batch.logits_indices,
            batchgen_step=StepContext(self.cache, self.backend, batch.slot_mapping),
        )
        return out.logits[0, :batch.num_logits].float()

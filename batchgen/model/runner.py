"""The model runner: owns the step's inputs (persistent buffers) and runs one packed forward of
the HF model over a ragged batch: [1, T] tokens, explicit positions, no HF cache, logits only at
the rows the sampler needs. Decode-only steps replay a captured CUDA graph when graphs are on."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, cast

import torch

from batchgen.attention.backend import AttentionBackend, GraphBackend
from batchgen.attention.interface import StepContext
from batchgen.attention.metadata import StepRows
from batchgen.kv.cache import KVCache
from batchgen.kv.swap import HostPool
from batchgen.model.cuda_graphs import DecodeGraphs, GraphCapturer
from batchgen.model.inputs import StepInputs
from batchgen.model.mixer_step import MixerStep
from batchgen.model.shared import paged_forward
from batchgen.multimodal.step import VisionStep
from batchgen.state.cache import StateCache


class ModelRunner:
    """The model is the loader's (or the caller's: `shared`), the pools and the backend are
    the LLM's; the step buffers (`inputs`) and the captured graphs are the runner's own. A
    model with state mixers brings its state pool's seam (`state`): its steps run
    sequence-separated (MixerStep); a vision-language model its image seam (`vision`): its
    steps' inputs carry image features and, for M-RoPE, 3-D positions."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, backend: AttentionBackend,
                 inputs: StepInputs, host: HostPool | None = None, shared: bool = False,
                 state: StateCache | None = None, vision: VisionStep | None = None) -> None:
        self.model = model
        self.shared = shared  # batchgen's attention is selected only inside its forwards
        self.cache = cache
        self.host = host  # the swap pool (swap_space > 0)
        self.backend = backend
        self.inputs = inputs
        self.graphs: DecodeGraphs | None = None
        self.lora: Any = None  # batchgen/lora's LoRALayers: the step's tokens by adapter
        self.mixers = (MixerStep(model, cache, backend, inputs, state)
                       if state is not None else None)
        self.vision = vision

    def use_graphs(self, sizes: list[int], max_pages: int, capturer: GraphCapturer) -> None:
        """Capture decode steps of these batch sizes; later decode steps replay them."""
        if self.mixers is not None:
            raise ValueError("CUDA graphs are not supported for models with state mixers "
                             "(enforce_eager=True)")
        if not self.backend.supports_graphs:
            raise ValueError(f"CUDA graphs need a backend that plans outside the graph "
                             f"(supports_graphs), not {self.backend.name!r}")
        graphs = DecodeGraphs(self.model, self.cache, cast(GraphBackend, self.backend),
                              self.inputs, sizes, max_pages, capturer)
        graphs.capture()
        self.graphs = graphs

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The step's copy-on-write block copies, before its forward writes anything."""
        self.cache.copy_blocks(copies)

    def swap_blocks(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]
                    ) -> None:
        """The step's swaps, before its copy-on-write copies: (host, device) blocks in, then
        (device, host) blocks out, one indexed copy each (a block swapped in may leave again
        in the same step; one swapped out may be rewritten by this step's copies)."""
        if swap_in or swap_out:
            assert self.host is not None, "swaps need the host pool (swap_space > 0)"
            self.host.swap_in(swap_in)
            self.host.swap_out(swap_out)

    @torch.inference_mode()
    def execute(self, rows: StepRows) -> torch.Tensor:
        """Run one step; returns float32 logits [R, vocab]: each row's last `num_logits`
        positions, row by row."""
        with paged_forward(self.model) if self.shared else nullcontext():
            if self.mixers is not None:
                return self.mixers.execute(rows)
            return self._packed(rows)

    def _packed(self, rows: StepRows) -> torch.Tensor:
        """One packed forward of every row (or a graph replay)."""
        graphs = self.graphs
        if (graphs is not None and graphs.size_for(rows.num_rows) is not None
                and len(rows.token_ids) == rows.num_rows):
            return graphs.replay(rows)
        batch = self.inputs.prepare(rows)
        if self.lora is not None:
            self.lora.begin_step(rows, batch)
        if self.vision is not None:  # bidirectional images widen their queries' masks
            batch.meta.spans = self.vision.spans(rows, batch)
        self.backend.plan(batch.meta)
        ctx = StepContext(self.cache, self.backend, batch.slot_mapping)
        if self.vision is not None:
            logits = self.vision.run(rows, batch, self.inputs.host_positions(
                len(batch.input_ids)), logits_to_keep=batch.logits_indices, batchgen_step=ctx)
            return logits[0, :batch.num_logits].float()
        out = self.model(
            input_ids=batch.input_ids[None],
            position_ids=batch.positions[None],
            use_cache=False,
            logits_to_keep=batch.logits_indices,
            batchgen_step=ctx,
        )
        return out.logits[0, :batch.num_logits].float()

"""The one seam between batchgen and its LoRA adapters.

`LoRASeam.take(engine_args, tp)` takes vLLM's `enable_lora`, `max_loras`, `max_lora_rank`,
`max_cpu_loras` out of `LLM(...)`'s engine arguments (checked before any weights load);
`attach(llm)` hooks the model's linear layers (`LoRALayers`) and the runner; `tag(groups,
lora_request)` resolves each prompt's adapter (read and checked before the call runs) onto its
SequenceGroup (`lora`: its slot, 0 = the base model; `lora_key`: in its prefix-cache hashes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from batchgen.checks import check_flag, check_int
from batchgen.lora.adapter import Adapter, load_adapter
from batchgen.lora.layers import LoRALayers
from batchgen.lora.request import LoRARequest


class LoRASeam:
    """The LLM's adapters: none (disabled) or those loaded so far, one slot each."""

    ARGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")  # vLLM's, honoured

    def __init__(self, enabled: bool, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None) -> None:
        self.enabled, self.max_loras, self.max_lora_rank = enabled, max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.layers: LoRALayers | None = None
        self.slots: dict[int, int] = {}  # lora_int_id -> slot (1..)
        self.adapters: dict[int, Adapter] = {}  # slot -> adapter

    @classmethod
    def take(cls, engine_args: dict[str, Any], tensor_parallel_size: int) -> LoRASeam:
        """vLLM's LoRA engine arguments, taken out of `engine_args` and checked."""
        enabled = engine_args.pop("enable_lora", False)
        max_loras = engine_args.pop("max_loras", 1)
        rank = engine_args.pop("max_lora_rank", 16)
        cpu = engine_args.pop("max_cpu_loras", None)
        check_flag(enabled, "enable_lora")
        check_int(max_loras, "max_loras", minimum=1)
        check_int(rank, "max_lora_rank", minimum=1)
        check_int(cpu, "max_cpu_loras", minimum=1, allow_none=True)
        if enabled and tensor_parallel_size > 1:
            raise ValueError("enable_lora=True needs tensor_parallel_size=1 (LoRA under tensor "
                             f"parallelism is not served), got {tensor_parallel_size}")
        return cls(bool(enabled), max_loras, rank, cpu)

    def attach(self, llm: Any) -> LoRASeam:
        """Hook the model's linear layers and the runner (enable_lora=True only)."""
        if not self.enabled:
            return self
        runner = llm.engine.runner
        if getattr(runner, "mixers", None) is not None or getattr(runner, "vision", None):
            raise ValueError("enable_lora=True is served for text-only attention models")
        self.layers = LoRALayers(llm.model)
        runner.graphs, runner.lora = None, self.layers  # eager: the hooks run every step
        self._device, self._dtype = llm.device, llm.dtype
        return self

    # ---- per call ----------------------------------------------------------------------------
    def resolve(self, req: Any) -> int:
        """The slot of `req` (None: 0, the base model), its folder loaded once."""
        if req is None:
            return 0
        if not self.enabled:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per "
                             f"prompt) or None, got {type(req).__name__}")
        check_int(req.lora_int_id, "lora_request.lora_int_id", minimum=1)
        slot = self.slots.get(req.lora_int_id)
        if slot is None:
            assert self.layers is not None
            adapter = load_adapter(req, self.layers.linears, self.max_lora_rank,
                                   self._device, self._dtype)
            slot = len(self.slots) + 1
            self.slots[req.lora_int_id], self.adapters[slot] = slot, adapter
            self.layers.add(slot, adapter)
        return slot

    def per_prompt(self, lora_request: Any, count: int | None) -> list[int] | int:
        """One slot for all prompts, or a slot per prompt from a list."""
        if isinstance(lora_request, (list, tuple)):
            if count is not None and len(lora_request) != count:
                raise ValueError(f"lora_request must be one LoRARequest or a list of one per "
                                 f"prompt ({count}), got a list of {len(lora_request)}")
            return [self.resolve(r) for r in lora_request]
        return self.resolve(lora_request)

    def tag(self, groups: list, lora_request: Any) -> list:
        """Each group's adapter slot and prefix-cache key, before the call runs."""
        slots = self.per_prompt(lora_request, len(groups))
        for g in groups:
            self._set(g, slots if isinstance(slots, int) else slots[g.index])
        return groups

    def tag_stream(self, groups: Iterable, lora_request: Any) -> Iterator:
        """`tag` for a stream's lazily built groups (a list: one per prompt, by index)."""
        slots = self.per_prompt(lora_request, None)
        for g in groups:
            self._set(g, slots if isinstance(slots, int) else slots[g.index])
            yield g

    def _set(self, group: Any, slot: int) -> None:
        group.lora = slot
        if slot:
            req = self.adapters[slot].request
            group.lora_key = f"lora:{req.lora_int_id}:{req.lora_path}".encode()

    def row_slots(self, seqs: Iterable[Any]) -> np.ndarray | None:
        """Each row's adapter slot (None when every row runs the base model)."""
        slots = np.fromiter((s.group.lora for s in seqs), np.int64)
        return slots if slots.any() else None

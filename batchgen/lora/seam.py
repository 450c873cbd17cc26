"""The one seam between batchgen and its LoRA adapters.

`LoRASeam.take(engine_args)` takes vLLM's `enable_lora`, `max_loras`, `max_lora_rank`,
`max_cpu_loras` out of `LLM(...)`'s engine arguments (checked before any weights load);
`attach(llm)` hooks the model's linear layers (`LoRALayers`) and the runner; `tag(groups,
lora_request)` resolves each prompt's adapter (read and checked before the call runs) onto its
SequenceGroup (`lora`: its slot, 0 = the base model; `lora_key`: in its prefix-cache hashes).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

from batchgen.checks import check_flag, check_int
from batchgen.lora.adapter import Adapter, load_adapter, refuse
from batchgen.lora.layers import LoRALayers, SlotLoad
from batchgen.lora.request import LoRARequest
from batchgen.lora.tokenizers import AdapterTokenizers

_PEFT_NAME = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")


class LoRASeam:
    """The LLM's adapters: none (disabled) or those loaded so far, one slot each."""

    ARGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")  # vLLM's, honoured

    def __init__(self, enabled: bool, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None) -> None:
        self.enabled, self.max_loras, self.max_lora_rank = enabled, max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.layers: LoRALayers | None = None
        self.host: OrderedDict[int, Adapter] = OrderedDict()  # lora_int_id -> host copy (LRU)
        self.requests: dict[int, LoRARequest] = {}  # lora_int_id -> its latest request
        self.held: dict[int, int] = {}  # device slot (1..max_loras) -> lora_int_id
        self.slot_of: dict[int, int] = {}  # lora_int_id -> device slot
        self.pinned: set[int] = set()  # adapters given weights by load_weights: kept in host
        self.last_use: dict[int, int] = {}  # lora_int_id -> admission tick (the slots' LRU)
        self.versions: dict[int, str] = {}  # lora_int_id -> its bytes' fingerprint (datasets)
        self._tick = 0
        self.tokenizers = AdapterTokenizers()  # adapters' own tokenizers, by folder

    @classmethod
    def take(cls, engine_args: dict[str, Any]) -> LoRASeam:
        """vLLM's LoRA engine arguments, taken out of `engine_args` and checked."""
        enabled = engine_args.pop("enable_lora", False)
        max_loras = engine_args.pop("max_loras", 1)
        rank = engine_args.pop("max_lora_rank", 16)
        cpu = engine_args.pop("max_cpu_loras", None)
        check_flag(enabled, "enable_lora")
        check_int(max_loras, "max_loras", minimum=1)
        check_int(rank, "max_lora_rank", minimum=1)
        check_int(cpu, "max_cpu_loras", minimum=1, allow_none=True)
        return cls(bool(enabled), max_loras, rank, cpu)

    def attach(self, llm: Any) -> LoRASeam:
        """Hook the model's linear layers and the runner (enable_lora=True only)."""
        if not self.enabled:
            return self
        runner = llm.engine.runner
        # under tensor parallelism: rank 0's own runner, and the channel to the workers
        local, self.remote = getattr(runner, "local", runner), getattr(runner, "on_workers", None)
        if local.mixers is not None or local.vision is not None:
            raise ValueError("enable_lora=True is served for text-only attention models")
        self.layers = LoRALayers(llm.model)
        local.graphs, local.lora = None, self.layers  # eager: the hooks run every step
        self.scheduler = llm.engine.scheduler
        self.scheduler.lora_gate = self.admits
        self._device, self._dtype = llm.device, llm.dtype
        self._eos = list(llm.requests.eos_token_ids)
        return self

    # ---- per call ----------------------------------------------------------------------------
    def resolve(self, req: Any) -> int:
        """The `lora_int_id` of `req` (None: 0, the base model), its folder read and checked
        when it is not in host memory."""
        if req is None:
            return 0
        if not self.enabled:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per "
                             f"prompt) or None, got {type(req).__name__}")
        check_int(req.lora_int_id, "lora_request.lora_int_id", minimum=1)
        self._host_copy(req)
        return req.lora_int_id

    def _host_copy(self, req: LoRARequest) -> Adapter:
        """The adapter in host memory (an LRU of `max_cpu_loras`, else `max_loras`, entries;
        one dropped from it is read again from its folder when needed)."""
        aid = req.lora_int_id
        adapter = self.host.get(aid)
        if adapter is None or adapter.request != req:
            assert self.layers is not None
            adapter = load_adapter(req, self.layers.linears, self.max_lora_rank)
            self.layers.check(adapter, lambda why: refuse(req, why))  # a layout TP can't cut
            self.host[aid] = adapter
            cap = self.max_cpu_loras or self.max_loras
            spare = [k for k in self.host if k not in self.pinned]
            for old in spare[:max(len(self.host) - cap, 0)]:
                del self.host[old]
        self.host.move_to_end(aid)
        self.requests[aid] = req
        return adapter

    def refresh(self, req: LoRARequest, version: str) -> bool:
        """Serve `req` as its folder is now (`version`: a fingerprint of its bytes): an
        adapter loaded under another version is dropped (host copy and device slot) and read
        again. True when one was dropped (its K/V in the prefix cache is stale)."""
        aid, stale = req.lora_int_id, False
        if self.versions.get(aid) not in (None, version):
            stale = self.host.pop(aid, None) is not None or aid in self.slot_of
            self.held.pop(self.slot_of.pop(aid, -1), None)
            self.pinned.discard(aid)
        self.versions[aid] = version
        self.resolve(req)
        return stale

    def load_weights(self, req: Any, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """verl's LoRA sync: new values for a loaded adapter's A and B, by PEFT names
        (`base_model.model.` and an adapter name before `.weight` optional), copied in place
        into its host copy (kept from then on: never dropped for a re-read) and its device
        slot if it has one. Every name and shape is checked before anything is copied."""
        if req is None:
            raise ValueError("load_weights: lora_request must name an adapter, got None")
        aid = self.resolve(req)
        adapter = self._host_copy(self.requests[aid])
        pending = []
        for key, tensor in weights:
            m = _PEFT_NAME.fullmatch(key)
            w = adapter.weights.get(m.group(1)) if m else None
            if w is None:
                raise ValueError(f"load_weights: {key!r} names no LoRA A or B weight of adapter "
                                 f"{req.lora_name!r} (lora_int_id={aid})")
            old = w[0] if m.group(2) == "A" else w[1]
            if tuple(tensor.shape) != tuple(old.shape):
                raise ValueError(f"load_weights: {key!r} has shape {tuple(tensor.shape)}, "
                                 f"adapter {req.lora_name!r} has {tuple(old.shape)}")
            pending.append((key, old, tensor))
        for _, old, tensor in pending:
            old.copy_(tensor.detach().to(old.device, old.dtype))
        self.pinned.add(aid)
        if (slot := self.slot_of.get(aid)) is not None:
            self._put(slot, adapter)
        return {key for key, _, _ in pending}

    def _put(self, slot: int, adapter: Adapter) -> None:
        """Load `adapter` into device slot `slot` here and, under tensor parallelism, on every
        worker with the next step."""
        assert self.layers is not None
        self.layers.put(slot, adapter, self._device, self._dtype)
        if self.remote is not None:
            self.remote(SlotLoad(slot, adapter, self._dtype))

    def per_prompt(self, lora_request: Any, count: int | None) -> list[int] | int:
        """One adapter id for all prompts, or one per prompt from a list."""
        if isinstance(lora_request, (list, tuple)):
            if count is not None and len(lora_request) != count:
                raise ValueError(f"lora_request must be one LoRARequest or a list of one per "
                                 f"prompt ({count}), got a list of {len(lora_request)}")
            return [self.resolve(r) for r in lora_request]
        return self.resolve(lora_request)

    def build(self, requests: Any, prompts: Any, params: Any, kind: Any, lora_request: Any
              ) -> list:
        """A batch call's groups (`RequestBuilder.build`), each tagged with its adapter; text
        prompts under an adapter that ships a tokenizer are tokenized with it first."""
        prompts = self.tokenizers.encode(prompts, lora_request) if self.enabled else prompts
        return self.tag(requests.build(prompts, params, kind), lora_request)

    def build_stream(self, requests: Any, prompts: Any, params: Any, kind: Any, chunk: int,
                     lora_request: Any) -> Iterator:
        """`build` for a stream call (`RequestBuilder.stream`, lazily)."""
        prompts = self.tokenizers.encode(prompts, lora_request) if self.enabled else prompts
        return self.tag_stream(requests.stream(prompts, params, kind, chunk), lora_request)

    def chat_tokenizers(self, lora_request: Any, base: Any) -> Any:
        """For `chat`: None when every conversation renders with `base`, else the tokenizer
        of conversation i (its adapter's own, else `base`), one request or a list by index."""
        if not self.enabled or lora_request is None:
            return None
        each = isinstance(lora_request, (list, tuple))
        for r in lora_request if each else [lora_request]:
            self.resolve(r)  # a bad request or folder: a ValueError naming it, before any work
        if each:
            return lambda i: self.tokenizers.of(
                lora_request[i] if i < len(lora_request) else None, base)
        tok = self.tokenizers.of(lora_request, base)
        return None if tok is base else (lambda i: tok)

    def tokenizer(self, lora_request: Any, base: Any) -> Any:
        """vLLM's `get_tokenizer(lora_request)`: the adapter's own tokenizer when its folder
        ships one, else `base`."""
        if lora_request is not None:
            self.resolve(lora_request)  # a bad request or folder: a ValueError naming it
        return self.tokenizers.of(lora_request, base)

    def tag(self, groups: list, lora_request: Any) -> list:
        """Each group's adapter and prefix-cache key, before the call runs."""
        ids = self.per_prompt(lora_request, len(groups))
        for g in groups:
            self._set(g, ids if isinstance(ids, int) else ids[g.index])
        return groups

    def tag_stream(self, groups: Iterable, lora_request: Any) -> Iterator:
        """`tag` for a stream's lazily built groups (a list: one per prompt, by index, read
        as each group is built: a dataset job appends a row's adapter as it yields its prompt)."""
        each = isinstance(lora_request, (list, tuple))
        one = None if each else self.resolve(lora_request)
        for g in groups:
            self._set(g, self.resolve(lora_request[g.index]) if each else one)
            yield g

    def _set(self, group: Any, aid: int) -> None:
        """The group's adapter, prefix-cache key and, when the adapter ships a tokenizer, its
        text side (its sequences' stop checkers made again under that tokenizer)."""
        group.lora_id, group.lora = aid, 0
        if not aid:
            return
        req = self.requests[aid]
        group.lora_key = f"lora:{aid}:{req.lora_path}".encode()
        side = self.tokenizers.side(req, self._eos)
        group.text_side = side
        if side is not None and group.params.stop_strings:
            for seq in group.seqs:
                seq.stop = side.stops(group.params, group.prompt_token_ids, group.max_tokens)

    # ---- the scheduler's gate: max_loras device slots --------------------------------------
    def admits(self, group: Any, running: list) -> bool:
        """Whether `group` may run beside `running` (at most `max_loras` distinct adapters);
        if so its adapter is in a device slot (`group.lora`), loaded into one no running group
        uses (an empty one, else the least recently used) when it was not."""
        aid = getattr(group, "lora_id", 0)
        if not aid:
            return True
        slot = self.slot_of.get(aid)
        if slot is None:
            used = {g.lora_id for g in running if getattr(g, "lora_id", 0)}
            if len(used) >= self.max_loras:
                return False
            free = [s for s in range(1, self.max_loras + 1) if self.held.get(s) not in used]
            empty = [s for s in free if s not in self.held]
            slot = empty[0] if empty else min(free, key=lambda s: self.last_use[self.held[s]])
            self.slot_of.pop(self.held.get(slot), None)
            self._put(slot, self._host_copy(self.requests[aid]))
            self.held[slot], self.slot_of[aid] = aid, slot
            self.scheduler.num_lora_loads += 1
        self._tick += 1
        self.last_use[aid], group.lora = self._tick, slot
        return True

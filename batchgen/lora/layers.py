"""The model's linear layers with per-token LoRA deltas: one sort of the step's tokens by
adapter slot (`begin_step`), reused by every hooked layer, which adds
`(x[seg] @ A.T @ B.T) * scale` to its output rows of each segment (slot 0, the base model,
costs nothing: its tokens are in no segment). Under tensor parallelism each layer's A and B
are cut along its base weight's plan (`lora/tp.py`); a worker rank gets each slot load as a
`SlotLoad` with the next step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from batchgen.lora.adapter import Adapter
from batchgen.lora.tp import Split, layer_splits


class LoRALayers:
    """Forward hooks on the linear layers adapters target; the step's segments."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                        and not n.endswith("lm_head")}
        self.splits: dict[str, Split] = layer_splits(model, self.linears)
        self.weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self.segments: list[tuple[int, torch.Tensor]] = []
        self._hooks: dict[str, Any] = {}

    def check(self, adapter: Adapter, refuse: Any) -> None:
        """Refuse (`refuse(why)`: a ValueError naming the adapter) an adapter on a layer whose
        tensor-parallel layout its A and B cannot follow."""
        for name in adapter.weights:
            split = self.splits.get(name)
            if split is not None and split.refusal:
                raise refuse(f"{name}: {split.refusal}")

    def put(self, slot: int, adapter: Adapter, device: torch.device, dtype: torch.dtype
            ) -> None:
        """Serve `adapter` in device slot `slot` (what held it before goes): its weights
        copied to the model's device and dtype (this rank's cut of them under tensor
        parallelism), its layers hooked (once each)."""
        for table in self.weights.values():
            table.pop(slot, None)
        for name, (a, b, scale) in adapter.weights.items():
            a, b = a.to(device, dtype), b.to(device, dtype)
            split = self.splits.get(name)
            if split is not None:
                a, b = split.cut(a, b)
            self.weights.setdefault(name, {})[slot] = (a, b, scale)
            if name not in self._hooks:
                self._hooks[name] = self.linears[name].register_forward_hook(self._hook(name))

    def begin_step(self, rows: Any, batch: Any) -> None:
        """Sort the step's packed tokens by adapter slot once: (slot, token indices) per
        adapter present (rows in the batch's packed order; padding runs the base model)."""
        per_row = rows.adapters
        if per_row is None:
            self.segments = []
            return
        order = batch.order
        tok = np.repeat(per_row[order], rows.num_new[order])
        tok = np.concatenate((tok, np.zeros(len(batch.input_ids) - len(tok), np.int64)))
        sort = np.argsort(tok, kind="stable")
        cuts = np.flatnonzero(np.diff(tok[sort])) + 1
        device = batch.input_ids.device
        self.segments = [(int(tok[seg[0]]), torch.as_tensor(seg, device=device))
                         for seg in np.split(sort, cuts) if len(seg) and tok[seg[0]]]

    def _hook(self, name: str) -> Any:
        table = self.weights[name]
        split = self.splits.get(name)
        group = split.reduce_group if split is not None else None

        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if not self.segments:
                return out
            # this rank's widths (a tensor-parallel layer's input or output is its shard)
            x, y = args[0].reshape(-1, args[0].shape[-1]), out.view(-1, out.shape[-1])
            present = [(idx, w) for slot, idx in self.segments if (w := table.get(slot))]
            if group is not None:
                _add_reduced(x, y, present, group)
                return out
            for idx, (a, b, scale) in present:
                y.index_add_(0, idx, F.linear(F.linear(x.index_select(0, idx), a), b) * scale)
            return out

        return hook


def _add_reduced(x: torch.Tensor, y: torch.Tensor, present: list, group: Any) -> None:
    """A row-parallel layer's deltas: each segment's rank-r product of this rank's input
    columns, summed over the group in one all-reduce, then through the whole B."""
    if not present:
        return
    parts = [F.linear(x.index_select(0, idx), a) for idx, (a, _, _) in present]
    flat = torch.cat([p.reshape(-1) for p in parts])
    dist.all_reduce(flat, group=group)
    at = 0
    for (idx, (_, b, scale)), p in zip(present, parts):
        u = flat[at:at + p.numel()].view_as(p)
        at += p.numel()
        y.index_add_(0, idx, F.linear(u, b) * scale)


@dataclass
class SlotLoad:
    """A device slot's load, sent to every tensor-parallel worker with the next step (its
    host tensors pickled with it) and run there on the worker's ModelRunner."""

    slot: int
    adapter: Adapter
    dtype: torch.dtype  # the model's (rank 0's LLM.dtype)

    def __call__(self, runner: Any) -> None:
        if runner.lora is None:  # the worker's first adapter: its layers hooked, eager steps
            runner.lora, runner.graphs = LoRALayers(runner.model), None
        param = next(runner.model.parameters())
        device = (param.to_local() if hasattr(param, "to_local") else param).device
        runner.lora.put(self.slot, self.adapter, device, self.dtype)

"""The model's linear layers with per-token LoRA deltas: one sort of the step's tokens by
adapter slot (`begin_step`), reused by every hooked layer, which adds
`(x[seg] @ A.T @ B.T) * scale` to its output rows of each segment (slot 0, the base model,
costs nothing: its tokens are in no segment)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from batchgen.lora.adapter import Adapter


class LoRALayers:
    """Forward hooks on the linear layers adapters target; the step's segments."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                        and not n.endswith("lm_head")}
        self.weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self.segments: list[tuple[int, torch.Tensor]] = []
        self._hooks: dict[str, Any] = {}

    def put(self, slot: int, adapter: Adapter, device: torch.device, dtype: torch.dtype
            ) -> None:
        """Serve `adapter` in device slot `slot` (what held it before goes): its weights
        copied to the model's device and dtype, its layers hooked (once each)."""
        for table in self.weights.values():
            table.pop(slot, None)
        for name, (a, b, scale) in adapter.weights.items():
            self.weights.setdefault(name, {})[slot] = (a.to(device, dtype), b.to(device, dtype),
                                                       scale)
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

        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if not self.segments:
                return out
            x, y = args[0].reshape(-1, module.in_features), out.view(-1, module.out_features)
            for slot, idx in self.segments:
                w = table.get(slot)
                if w is not None:
                    a, b, scale = w
                    y.index_add_(0, idx, F.linear(F.linear(x.index_select(0, idx), a), b) * scale)
            return out

        return hook

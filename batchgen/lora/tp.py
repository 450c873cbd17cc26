"""LoRA under tensor parallelism: each targeted layer's A and B cut along its base weight's
plan (transformers' `model.tp_plan`, the weight's DTensor placements). A column-parallel layer
(`colwise`: weight Shard(0), each rank computes its slice of the output) keeps A whole and
takes its rows of B; a row-parallel one (`rowwise`: weight Shard(1), each rank holds a slice
of the input and the output is all-reduced) takes its columns of A, and its hook all-reduces
the rank-r product over the group once per step before the whole B. Any other layout is
refused for adapters that target it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

SERVED = ("colwise", "rowwise")


@dataclass(frozen=True)
class Split:
    """How one layer's A and B are cut on this rank (`refusal`: why they cannot be)."""

    style: str
    placements: tuple = ()
    mesh: Any = None
    refusal: str = ""

    @property
    def reduce_group(self) -> Any:
        """The process group a row-parallel layer's rank-r product is summed over."""
        if self.style != "rowwise" or self.refusal:
            return None
        return self.mesh.get_group() if self.mesh.ndim == 1 else self.mesh.get_group("tp")

    def cut(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A [r, in] and B [out, r]: B's output rows (colwise), A's input
        columns (rowwise), each cut locally by the weight's own placements."""
        from torch.distributed.tensor import distribute_tensor

        if self.style == "colwise":
            b = distribute_tensor(b, self.mesh, self.placements, src_data_rank=None).to_local()
        else:
            a = distribute_tensor(a, self.mesh, self.placements, src_data_rank=None).to_local()
        return a.contiguous(), b.contiguous()


def layer_splits(model: torch.nn.Module, linears: dict[str, torch.nn.Linear]
                 ) -> dict[str, Split]:
    """Each tensor-parallel linear layer's split (none for a model on one device, or a layer
    whose weight is not sharded: its adapter runs as on one device)."""
    plan = getattr(model, "tp_plan", None) or {}
    rules = [(re.compile(re.escape(k).replace(r"\*", r"\d+")), v) for k, v in plan.items()]
    out: dict[str, Split] = {}
    for name, mod in linears.items():
        weight = mod.weight
        if not hasattr(weight, "placements"):
            continue  # a plain tensor: replicated, the adapter runs whole
        style = next((v for k, v in rules if k.fullmatch(name)), "")
        placements, mesh = tuple(weight.placements), weight.device_mesh
        want = {"colwise": 0, "rowwise": 1}.get(style)
        shards = [getattr(p, "dim", None) for p in placements if p.is_shard()]
        if not shards:
            continue  # replicated on every rank: the adapter runs whole
        if want is None or mesh.ndim != 1 or shards not in ([want], [want - 2]):
            out[name] = Split(style, refusal=(
                f"its tensor-parallel layout ({style or 'unknown'}, placements "
                f"{placements}) is not one LoRA is split along (served: {', '.join(SERVED)} "
                "on a one-dimensional mesh); run LoRA with tensor_parallel_size=1, or merge "
                "the adapter into the weights (PEFT's merge_and_unload)"))
            continue
        out[name] = Split(style, placements, mesh)
    return out

"""StatePool: every sequence's mixer state, one preallocated tensor per state entry,
[slots + 1, *shape] (the last slot is scratch, for padding rows). Written only by the forward
(through the cache seam) and by `copy` (forks, beams, snapshots); slots are the KV manager's."""

from __future__ import annotations

import torch

from batchgen.state.layout import StateEntry, StateLayout


class StatePool:
    """Owns the state tensors; grows (doubling) when a slot beyond its capacity appears."""

    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.num_slots = num_slots
        self.tensors: dict[StateEntry, torch.Tensor] = {
            e: torch.zeros((num_slots + 1, *e.shape), dtype=e.dtype, device=device)
            for e in layout.entries}

    @property
    def scratch(self) -> int:
        return self.num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def clear_scratch(self) -> None:
        """Zero the scratch slot, so padding rows start every forward from the same state (an
        MoE layer's rounding depends on where even padding rows are routed)."""
        for t in self.tensors.values():
            t[self.num_slots].zero_()

    def release(self) -> None:
        """Free every state tensor (sleep mode): the slots' contents are gone."""
        self.tensors = {e: torch.empty((0, *e.shape), dtype=e.dtype, device=self.device)
                        for e in self.tensors}

    def restore(self) -> None:
        """The pool's tensors again, zeroed, as many slots as before (wake_up)."""
        self.tensors = {e: torch.zeros((self.num_slots + 1, *e.shape), dtype=e.dtype,
                                       device=self.device) for e in self.tensors}

    def ensure(self, max_slot: int) -> None:
        """Room for slot `max_slot` (doubling; the scratch slot moves to the end)."""
        if max_slot < self.num_slots:
            return
        n = self.num_slots
        while n <= max_slot:
            n *= 2
        for e, old in self.tensors.items():
            new = torch.zeros((n + 1, *e.shape), dtype=e.dtype, device=self.device)
            new[:self.num_slots] = old[:self.num_slots]
            self.tensors[e] = new
        self.num_slots = n

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst slots take src slots' state, every entry, as one gather each (sources are read
        before any destination is written)."""
        if len(src):
            for t in self.tensors.values():
                t[dst] = t[src]

    def to_host(self, slots: torch.Tensor) -> dict[StateEntry, torch.Tensor]:
        """These slots' state, copied to host memory (a swap out)."""
        return {e: t[slots].cpu() for e, t in self.tensors.items()}

    def from_host(self, saved: dict[StateEntry, torch.Tensor], slots: torch.Tensor) -> None:
        """Put state saved by `to_host` back into these slots (a swap in)."""
        for e, t in self.tensors.items():
            t[slots] = saved[e].to(self.device)

"""Rank 0's model runner under tensor parallelism: each step's block swaps, copies and rows go
to the workers in one broadcast, then through rank 0's own shard; the logits (full vocabulary on every
rank) are rank 0's to sample. Same interface as ModelRunner (the Engine's Runner)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from batchgen.attention.metadata import StepRows
from batchgen.distributed.group import TPGroup
from batchgen.model.runner import ModelRunner


class TPRunner:
    """Wraps rank 0's ModelRunner (its shard, pool and buffers); the group is the LLM's."""

    def __init__(self, local: ModelRunner, group: TPGroup) -> None:
        self.local = local
        self.group = group
        self.backend = local.backend
        # operations the workers make, in order, before the next step's forward:
        # ("swap_in" | "swap_out" | "copy", pairs), or ("call", a picklable op on the runner)
        self.pending: list[tuple[str, Any]] = []

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.local.copy_blocks(copies)
        if copies:
            self.pending.append(("copy", copies))

    def swap_blocks(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]
                    ) -> None:
        """Every rank swaps the same block ids of its own host pool (its local KV heads)."""
        self.local.swap_blocks(swap_in, swap_out)
        self.pending += [(kind, pairs) for kind, pairs in (("swap_in", swap_in),
                                                             ("swap_out", swap_out)) if pairs]

    def on_workers(self, op: Callable[[Any], None]) -> None:
        """Run `op(runner)` on every worker's ModelRunner before the next step's forward
        (pickled with the step: a LoRA slot load, say)."""
        self.pending.append(("call", op))

    def execute(self, rows: StepRows) -> torch.Tensor:
        """One step on every rank. A Ctrl-C during it is held until every rank has finished the
        step's forward, so the ranks' collectives never part."""
        with _interrupts_held():
            self.group.send(("step", self.pending, wire_rows(rows)))
            self.pending = []
            try:
                return self.local.execute(rows)
            except RuntimeError as e:  # a collective inside the forward: a rank is gone
                raise self.group.failure(e) from e


def wire_rows(rows: StepRows) -> StepRows:
    """The step's rows with only their own block-table rows (not the whole batch's matrix),
    and each row's LoRA slot."""
    return StepRows(np.arange(rows.num_rows, dtype=np.int64), rows.starts, rows.num_new,
                    rows.num_logits, rows.token_ids, rows.block_tables[rows.slots],
                    adapters=rows.adapters)


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT during the block is raised as KeyboardInterrupt when it ends (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt

"""One engine step of a model with state mixers (SSM, linear attention, short convolutions):
no mixer may see two sequences as one, so the step runs as several forwards over the same
step buffers: the rows continuing a sequence one token at a time as one batch [rows, 1]
(their states gathered from the pool), and every other row (a prompt chunk, a first token)
alone as [1, n], carrying its state across chunks. Attention layers read and write the paged
KV pool as in a packed step; the logits come back in the step's row order."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from batchgen.attention.backend import AttentionBackend
from batchgen.attention.interface import StepContext
from batchgen.attention.metadata import StepRows
from batchgen.kv.cache import KVCache
from batchgen.model.inputs import StepInputs
from batchgen.state.cache import StateCache
from batchgen.state.slots import StateOps


class MixerStep:
    """Runs a step's rows through the model in sequence-separated forwards."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, backend: AttentionBackend,
                 inputs: StepInputs, state: StateCache) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.inputs = inputs
        self.state = state
        self.saved: dict[int, dict] = {}  # swapped-out sequences' state, host memory, by key

    def execute(self, rows: StepRows) -> torch.Tensor:
        """float32 logits [R, vocab] in the step's row order (as ModelRunner.execute)."""
        assert rows.state_slots is not None, "a model with state mixers needs state slots"
        pool, ops = self.state.pool, rows.state_ops
        pool.ensure(int(rows.state_slots.max(initial=0)))
        if ops is not None and not ops.empty:
            self._move(ops)
        rows, solo, after = _split_at_snaps(rows, ops)
        if not pool.layout.continues_chunks:
            rows, solo, after = _token_rows(rows, solo, after)
        continuing = (rows.num_new == 1) & (rows.starts > 0) & ~solo
        groups = [np.flatnonzero(continuing)] if continuing.any() else []
        groups += [np.array([i]) for i in np.flatnonzero(~continuing).tolist()]
        ends = np.cumsum(rows.num_logits)
        out: torch.Tensor | None = None
        batched_first = bool(continuing.any())
        for i, idx in enumerate(groups):
            logits = self._forward(_subset(rows, idx), batched=batched_first and i == 0)
            self._snapshot(rows, idx, after)
            if out is None:
                out = logits.new_empty(int(ends[-1]) if len(ends) else 0, logits.shape[-1])
            nl = rows.num_logits[idx]
            at = np.repeat(ends[idx] - nl, nl) + (np.arange(int(nl.sum()))
                                                  - np.repeat(np.cumsum(nl) - nl, nl))
            out[torch.from_numpy(at).to(out.device)] = logits
        assert out is not None
        return out

    def _snapshot(self, rows: StepRows, idx: np.ndarray, after: np.ndarray) -> None:
        """Rows of the forward just run that end on a snapshot: their state to its slot."""
        keep = idx[after[idx] >= 0]
        if len(keep):
            assert rows.state_slots is not None
            pool = self.state.pool
            pool.ensure(int(after[keep].max()))
            pool.copy(*(torch.from_numpy(x).to(pool.device)
                        for x in (rows.state_slots[keep], after[keep])))

    def _move(self, ops: StateOps) -> None:
        """Swapped-out states to host memory, forks' copies, swapped-in states back."""
        pool = self.state.pool
        pool.ensure(int(max(ops.copies.max(initial=0), ops.restores[1].max(initial=0))))
        if ops.saves.shape[1]:
            slots, keys = ops.saves
            saved = pool.to_host(torch.from_numpy(slots).to(pool.device))
            for j, key in enumerate(keys.tolist()):
                self.saved[key] = {e: t[j:j + 1] for e, t in saved.items()}
        if ops.copies.shape[1]:
            src, dst = (torch.from_numpy(x).to(pool.device) for x in ops.copies)
            pool.copy(src, dst)
        for key, slot in ops.restores.T.tolist():
            pool.from_host(self.saved.pop(key), torch.tensor([slot], device=pool.device))

    def _forward(self, rows: StepRows, batched: bool) -> torch.Tensor:
        """One forward: `batched` rows of one token each as [rows, 1] (padded on the CPU with
        dummy rows on the scratch block and scratch state slot), else one sequence's chunk
        as [1, n], unpadded."""
        assert rows.state_slots is not None
        batch = self.inputs.prepare(rows, pad=batched)
        self.backend.plan(batch.meta)
        t = len(batch.input_ids)
        pool = self.state.pool
        slots = np.full(t if batched else 1, pool.scratch, np.int64)
        slots[:rows.num_rows] = rows.state_slots
        if t > rows.num_rows:
            pool.clear_scratch()
        cache = self.state.bind(torch.from_numpy(slots).to(pool.device),
                                fresh=not batched and int(rows.starts[0]) == 0)
        step = StepContext(self.cache, self.backend, batch.slot_mapping)
        try:
            if batched:
                logits = self.model(input_ids=batch.input_ids[:, None],
                                    position_ids=batch.positions[:, None], cache=cache,
                                    use_cache=True, logits_to_keep=1,
                                    batchgen_step=step).logits[:, -1]
                return logits[batch.logits_indices[:batch.num_logits]].float()
            logits = self.model(input_ids=batch.input_ids[None],
                                position_ids=batch.positions[None], cache=cache,
                                use_cache=True, logits_to_keep=batch.logits_indices,
                                batchgen_step=step).logits[0]
            return logits[:batch.num_logits].float()
        finally:
            self.state.release()


def _subset(rows: StepRows, idx: np.ndarray) -> StepRows:
    """The rows `idx` of a step (their tokens, tables and state slots)."""
    first = np.concatenate(([0], np.cumsum(rows.num_new)))
    tokens = np.concatenate([rows.token_ids[first[i]:first[i + 1]] for i in idx.tolist()])
    assert rows.state_slots is not None
    return replace(rows, slots=rows.slots[idx], starts=rows.starts[idx],
                   num_new=rows.num_new[idx], num_logits=rows.num_logits[idx],
                   token_ids=tokens, state_slots=rows.state_slots[idx], state_ops=None)


def _split_at_snaps(rows: StepRows, ops: StateOps | None
                    ) -> tuple[StepRows, np.ndarray, np.ndarray]:
    """Rows cut where a snapshot is taken (a block end inside a prompt chunk): the pieces of
    a cut row run one forward each, in order (`solo`), and `after` names the slot a piece's
    final state is copied to (-1: none). Each piece keeps the logits of its positions among
    the row's last `num_logits`."""
    n = rows.num_rows
    if ops is None or not ops.snaps.shape[1]:
        return rows, np.zeros(n, np.bool_), np.full(n, -1, np.int64)
    cuts: dict[int, list[tuple[int, int]]] = {}
    for row, offset, slot in ops.snaps.T.tolist():
        cuts.setdefault(row, []).append((offset, slot))
    first = np.concatenate(([0], np.cumsum(rows.num_new)))
    pieces: list[tuple[int, int, int, int]] = []  # (row, from, to, slot)
    for i in range(n):
        a, length = 0, int(rows.num_new[i])
        for offset, slot in sorted(cuts.get(i, [])):
            pieces.append((i, a, offset, slot))
            a = offset
        if a < length:
            pieces.append((i, a, length, -1))
    row, lo, hi, slot = (np.array(x, np.int64) for x in zip(*pieces))
    tail = rows.num_new[row] - rows.num_logits[row]  # the first position keeping logits
    tokens = np.concatenate([rows.token_ids[first[r] + a:first[r] + b]
                             for r, a, b in zip(row.tolist(), lo.tolist(), hi.tolist())])
    assert rows.state_slots is not None
    cut = np.isin(row, list(cuts))
    return replace(rows, slots=rows.slots[row], starts=rows.starts[row] + lo,
                   num_new=hi - lo, num_logits=np.clip(hi - np.maximum(lo, tail), 0, None),
                   token_ids=tokens, state_slots=rows.state_slots[row]), cut, slot


def _token_rows(rows: StepRows, solo: np.ndarray, after: np.ndarray
                ) -> tuple[StepRows, np.ndarray, np.ndarray]:
    """For mixers that restart a multi-token forward from zero: every chunk that continues a
    sequence becomes one row per token (each continues from the state the previous token
    left; they run one forward each, in order: `solo` says which; a snapshot after a chunk
    moves to its last token). Logits rows are unchanged."""
    split = (rows.starts > 0) & (rows.num_new > 1)
    if not split.any():
        return rows, solo, after
    n = np.where(split, rows.num_new, 1)
    row = np.repeat(np.arange(rows.num_rows), n)
    j = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    num_new = np.where(split[row], 1, rows.num_new[row])
    last = rows.num_new[row] - rows.num_logits[row]  # the first position keeping logits
    num_logits = np.where(split[row], (j >= last).astype(np.int64), rows.num_logits[row])
    assert rows.state_slots is not None
    last_token = ~split[row] | (j == rows.num_new[row] - 1)
    return (replace(rows, slots=rows.slots[row], starts=rows.starts[row] + j, num_new=num_new,
                    num_logits=num_logits, state_slots=rows.state_slots[row]),
            split[row] | solo[row], np.where(last_token, after[row], -1))

"""HF beam selection for many requests in one pass (the arithmetic of ``engine/beam.py``).

A :class:`BeamBank` holds the tensor state of every request that shares a beam width and a
number of stop ids (so the same ``K`` candidates) on one device, one row per request: running
scores, the finished buffer (scores, sums, finish codes, done flags, and where each slot's
hypothesis came from) and HF's early-stop flag. :func:`select` runs one step for ``G`` of its
rows: one ``topk`` over ``[G, W * V]``, the stopping criteria, the next running beams, the
finished-buffer merge and the stopping test, each a few tensor ops over all rows, in HF's
float32 order (``transformers`` 5.24 ``_beam_search`` with ``batch_size = G``; every op is
row-wise, so a row's bits do not depend on the others). The step's candidates go to the host
once, as a :class:`StepRecord`; hypotheses' tokens are read back from those records only when
a hypothesis is admitted or returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.beam_logprobs import StepTop

__all__ = ["LENGTH", "NEG", "STOP", "UNSET", "BeamBank", "SelectResult",
           "StepRecord", "select"]

NEG = -1.0e9  # HF's "impossible" score
UNSET, STOP, LENGTH = 0, 1, 2  # finish codes of a finished-buffer slot


@dataclass(frozen=True)
class StepRecord:
    """One step's candidates on the host, row ``g`` per request: token ``ids``, ``parents``
    (the live beam each extends), their ``logprobs`` and ``ranks`` in the parent's row,
    ``nxt`` (the candidate each next running beam is; its parent and token in
    ``next_parents`` and ``next_ids``), and each row's top-k alternatives (``tops``, only for
    requests that asked)."""

    ids: np.ndarray
    parents: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    nxt: np.ndarray
    next_parents: np.ndarray
    next_ids: np.ndarray
    tops: dict[int, StepTop]


@dataclass(frozen=True)
class SelectResult:
    """A step's outcome on the host: the record, each row's done flag, and the (row, slot)
    pairs of hypotheses admitted to the finished buffer now."""

    record: StepRecord
    done: np.ndarray
    admitted: list[tuple[int, int]]


class BeamBank:
    """The tensor state of requests sharing (beam width, stop-id count, device), a row each."""

    def __init__(self, width: int, num_stop_ids: int, device: torch.device) -> None:
        self.width = width
        self.num_stop_ids = num_stop_ids
        self.num_candidates = max(2, 1 + num_stop_ids) * width  # HF beams_to_keep
        self.device = device
        self._free: list[int] = []
        self._size = 0
        k = self.num_candidates
        self.top_mask = torch.cat((torch.ones(width, dtype=torch.bool),
                                   torch.zeros(k - width, dtype=torch.bool))).to(device)
        self.cand = torch.arange(k, device=device)[None, :]
        self._alloc(4)

    def _alloc(self, cap: int) -> None:
        """(Re)make the state tensors with ``cap`` rows, keeping the rows in use."""
        w, dev = self.width, self.device
        old = None if self._size == 0 else self.state()
        self.running = torch.full((cap, w), NEG, dtype=torch.float, device=dev)
        # finished buffer: scores, raw sums | finish code, done, step, candidate (0: none)
        self.fin_f = torch.full((cap, 2, w), NEG, dtype=torch.float, device=dev)
        self.fin_i = torch.zeros((cap, 4, w), dtype=torch.long, device=dev)
        self.unsatisfied = torch.ones((cap, 1), dtype=torch.bool, device=dev)
        self.stops = torch.full((cap, max(self.num_stop_ids, 1)), -1, dtype=torch.long,
                                device=dev)
        if old is not None:
            for dst, src in zip(self.state(), old):
                dst[:len(src)] = src
        # per row on the host: generated length, max_tokens, early_stopping is True, "never"
        # with a positive length penalty; the length penalty
        ints = np.zeros((cap, 4), np.int64)
        penalty = np.ones(cap, np.float64)
        if old is not None:
            ints[:self._size], penalty[:self._size] = self.ints, self.penalty
        self.ints, self.penalty = ints, penalty
        self._free += list(range(cap - 1, self._size - 1, -1))
        self._size = cap

    def state(self) -> tuple[torch.Tensor, ...]:
        """Every per-row tensor, in one order."""
        return self.running, self.fin_f, self.fin_i, self.unsatisfied, self.stops

    def add(self, stop_ids: list[int], max_tokens: int, length_penalty: float,
            early_stopping: bool | str) -> int:
        """A row for a new request: HF's initial scores (beam 0 at 0, the rest impossible),
        an empty buffer, its stop ids and stopping settings."""
        if not self._free:
            self._alloc(2 * self._size)
        row = self._free.pop()
        self.ints[row] = (0, max_tokens, early_stopping is True,
                          early_stopping == "never" and length_penalty > 0.0)
        self.penalty[row] = length_penalty
        self.running[row] = NEG
        self.running[row, 0] = 0.0
        self.fin_f[row] = NEG
        self.fin_i[row] = 0
        self.unsatisfied[row] = True
        self.stops[row] = -1
        if stop_ids:
            self.stops[row, :len(stop_ids)] = torch.tensor(stop_ids, dtype=torch.long)
        return row

    def release(self, row: int) -> None:
        """The request is done: its row is free again."""
        self._free.append(row)

    def buffer(self, row: int) -> tuple[list, ...]:
        """A row's finished buffer on the host: scores, sums, codes, done, step, candidate."""
        f, i = self.fin_f[row].tolist(), self.fin_i[row].tolist()
        return f[0], f[1], i[0], [bool(x) for x in i[1]], i[2], i[3]


def select(bank: BeamBank, rows: np.ndarray, singles: np.ndarray, logprobs: torch.Tensor,
           stop_fns: dict[int, Callable[[int, int], bool]] | None = None,
           tops: dict[int, StepTop] | None = None) -> SelectResult:
    """One HF beam step for the ``G`` requests in bank ``rows``: ``logprobs`` ``[G, W, V]``
    float32 (processed; ``singles``: a first step's one row, repeated). ``stop_fns[g](parent,
    token)``: does that candidate of request ``g`` end on a stop string (HF's
    StopStringCriteria on all K candidates)?"""
    w, k = bank.width, bank.num_candidates
    at = _bank_rows(rows, bank.device)
    gen, max_t, early_h, never = bank.ints[rows].T
    new_len = gen + 1
    best_len = np.where(never.astype(bool), max_t, new_len)
    host = np.stack((new_len, max_t, early_h), 1)
    ints = torch.from_numpy(host).to(bank.device)
    new_len_t, early = ints[:, :1], ints[:, 2].bool()
    divisors = torch.from_numpy(_powers(np.stack((new_len, best_len), 1),
                                        bank.penalty[rows])).to(bank.device)
    bank.ints[rows, 0] = new_len
    top_lp, top_idx, ids, parents = _candidates(bank, at, singles, logprobs)
    stop_tok = _stop_tokens(bank, at, ids, parents, stop_fns)
    hits = (new_len_t >= ints[:, 1:2]).expand(ids.shape)
    if stop_tok is not None:
        hits = stop_tok | hits
    # next running beams (_get_running_beams_for_next_iteration)
    running_lp = top_lp + hits.to(torch.float32) * NEG
    next_idx = torch.topk(running_lp, k=w)[1]
    running = torch.take_along_dim(running_lp, next_idx, dim=1)
    bank.running[at] = running
    admitted, fin_scores, fin_done = _update_finished(bank, at, early, divisors[:, :1],
                                                      top_lp, hits, stop_tok, new_len_t)
    done = _done(bank, at, early, divisors[:, 1:], running, hits, fin_scores, fin_done)
    exact = bool(singles.any())  # a first step's copies: every rank by its parent's row
    lp_tok, ranks = (_token_logprobs(logprobs, parents, ids) if exact
                     else _fast_ranks(logprobs, top_lp, top_idx, parents))
    host = torch.cat((ids, parents, ranks, next_idx, torch.gather(parents, 1, next_idx),
                      torch.gather(ids, 1, next_idx), admitted.long(), done[:, None].long(),
                      (top_lp[:, :-1] == top_lp[:, -1:]).any(1, keepdim=True).long()),
                     dim=1).cpu().numpy()  # what the host reads: two copies (one sync)
    cuts = np.cumsum([k, k, k, w, w, w, w, 1])
    ids_h, par_h, ranks_h, nxt_h, np_h, ni_h, adm_h, done_h, tied = np.split(host, cuts, 1)
    if not exact and tied.any():  # a tie with the K-th candidate: those rows' ranks in full
        _exact_ranks(ranks_h, np.flatnonzero(tied[:, 0]), logprobs, parents, ids)
    record = StepRecord(ids_h, par_h, lp_tok.cpu().numpy(), ranks_h, nxt_h, np_h, ni_h,
                        tops or {})
    adm = np.nonzero(adm_h)
    return SelectResult(record, done_h[:, 0].astype(bool),
                        list(zip(*(a.tolist() for a in adm))))


def _bank_rows(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """The requests' bank rows as an index: a slice (views, no gather) when they are
    consecutive and ascending, the usual case; else an index tensor."""
    first = int(rows[0])
    if int(rows[-1]) - first == len(rows) - 1 and (len(rows) < 3 or
                                                   (np.diff(rows) == 1).all()):
        return slice(first, first + len(rows))
    return torch.from_numpy(rows).to(device)


def _stop_tokens(bank: BeamBank, at: slice | torch.Tensor, ids: torch.Tensor,
                 parents: torch.Tensor,
                 stop_fns: dict[int, Callable[[int, int], bool]] | None
                 ) -> torch.Tensor | None:
    """Which candidates end on a stop id or a stop string (None: no request has either)."""
    stop_tok = None
    if bank.num_stop_ids:
        stop_tok = (ids[:, :, None] == bank.stops[at][:, None, :]).any(-1)
    if stop_fns:
        extra = _host_stops(stop_fns, ids, parents)
        stop_tok = extra if stop_tok is None else stop_tok | extra
    return stop_tok


def _host_stops(stop_fns: dict[int, Callable[[int, int], bool]], ids: torch.Tensor,
                parents: torch.Tensor) -> torch.Tensor:
    """The stop-string verdict of the rows that have one, on their K candidates."""
    extra = torch.zeros(ids.shape, dtype=torch.bool)
    for g, fn in stop_fns.items():
        extra[g] = torch.tensor([bool(fn(p, t)) for p, t in zip(parents[g].tolist(),
                                                                 ids[g].tolist())])
    return extra.to(ids.device)


def _powers(lengths: np.ndarray, penalty: np.ndarray) -> np.ndarray:
    """HF's ``length ** length_penalty`` in float64 (Python's pow, row by row, unless every
    penalty is 1), rounded to float32 as torch rounds a Python scalar operand."""
    if (penalty == 1.0).all():
        return lengths.astype(np.float32)
    return np.array([[float(n) ** lp for n in row] for row, lp in
                     zip(lengths.tolist(), penalty.tolist())], np.float64).astype(np.float32)


def _candidates(bank: BeamBank, at: slice | torch.Tensor, singles: np.ndarray,
                logprobs: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF _get_top_k_continuations for every row: accumulate, flatten, top K (scores, flat
    indices, tokens, parents)."""
    g, _, vocab = logprobs.shape
    flat = (logprobs + bank.running[at][:, :, None]).reshape(g, -1)
    top_lp, top_idx = torch.topk(flat, k=bank.num_candidates)
    ids = top_idx % vocab
    parents = top_idx // vocab
    if singles.any():  # a single row: parent 0
        parents = parents * torch.from_numpy(1 - singles).to(parents.device)[:, None]
    return top_lp, top_idx, ids, parents


def _token_logprobs(logprobs: torch.Tensor, parents: torch.Tensor, ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each candidate's own log-prob in its parent's row and its rank there (1 = best): the
    parents' rows gathered by one index_select over the ``[G * W, V]`` rows."""
    g, w, vocab = logprobs.shape
    at = parents + torch.arange(g, device=parents.device)[:, None] * w
    rows = logprobs.reshape(g * w, vocab).index_select(0, at.reshape(-1))
    lp = rows.gather(1, ids.reshape(-1, 1))
    ranks = torch.count_nonzero(rows > lp, dim=-1) + 1
    return lp.reshape(ids.shape), ranks.reshape(ids.shape)


def _fast_ranks(logprobs: torch.Tensor, top_lp: torch.Tensor, top_idx: torch.Tensor,
                parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each candidate's log-prob and rank in its parent's row, without comparing whole rows:
    a token above a candidate in its parent's row scores at least as high after the parent's
    running score is added, so it is among the K unless it ties the K-th; the ranks count the
    candidates above, and the K-th candidate's row is compared in full (a row where another
    candidate ties the K-th is redone by ``_exact_ranks``)."""
    g, w, vocab = logprobs.shape
    lp = logprobs.reshape(g, w * vocab).gather(1, top_idx)
    above = (lp[:, None, :] > lp[:, :, None]) & (parents[:, None, :] == parents[:, :, None])
    ranks = above.sum(-1) + 1
    at = parents[:, -1] + torch.arange(g, device=parents.device) * w
    last = logprobs.reshape(g * w, vocab).index_select(0, at)
    ranks[:, -1] = torch.count_nonzero(last > lp[:, -1:], dim=-1) + 1
    return lp, ranks


def _exact_ranks(ranks: np.ndarray, rows: np.ndarray, logprobs: torch.Tensor,
                 parents: torch.Tensor, ids: torch.Tensor) -> None:
    """The ranks of ``rows`` (host) by comparing their parents' rows in full."""
    at = torch.from_numpy(rows).to(parents.device)
    ranks[rows] = _token_logprobs(logprobs[at], parents[at], ids[at])[1].cpu().numpy()


def _update_finished(bank: BeamBank, g_rows: slice | torch.Tensor, early: torch.Tensor,
                     divisor: torch.Tensor, top_lp: torch.Tensor, hits: torch.Tensor,
                     stop_tok: torch.Tensor | None, new_len: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF _update_finished_beams for every row: which kept slots were admitted now, and the
    buffer's scores and done flags after the merge."""
    w = bank.width
    did_finish = hits & bank.top_mask[None, :]
    scores = top_lp / divisor
    fin_f, fin_i = bank.fin_f[g_rows], bank.fin_i[g_rows]
    full = torch.all(fin_i[:, 1].bool(), dim=-1, keepdim=True) & early[:, None]
    scores += full.to(torch.float32) * NEG
    scores += (~bank.unsatisfied[g_rows]).to(torch.float32) * NEG
    scores += (~did_finish) * NEG
    why = LENGTH if stop_tok is None else torch.where(stop_tok, STOP, LENGTH)
    reason = torch.where(did_finish, why, UNSET)
    new_i = torch.stack((reason, did_finish.long(), new_len.expand_as(reason),
                         bank.cand.expand_as(reason)), 1)
    merged_f = torch.cat((fin_f, torch.stack((scores, top_lp), 1)), dim=2)
    merged_i = torch.cat((fin_i, new_i), dim=2)
    keep = torch.topk(merged_f[:, 0].contiguous(), k=w)[1]
    kept_f = torch.take_along_dim(merged_f, keep[:, None, :], dim=2)
    kept_i = torch.take_along_dim(merged_i, keep[:, None, :], dim=2)
    bank.fin_f[g_rows], bank.fin_i[g_rows] = kept_f, kept_i
    return (keep >= w) & (kept_i[:, 0] != UNSET), kept_f[:, 0], kept_i[:, 1].bool()


def _done(bank: BeamBank, g_rows: slice | torch.Tensor, early: torch.Tensor, divisor: torch.Tensor,
          running: torch.Tensor, hits: torch.Tensor, fin_scores: torch.Tensor,
          fin_done: torch.Tensor) -> torch.Tensor:
    """HF _check_early_stop_heuristic + _beam_search_has_unfinished_sequences, every row."""
    best_running = running[:, :1] / divisor
    worst_finished = torch.where(fin_done, torch.min(fin_scores, dim=1, keepdim=True)[0], NEG)
    unsatisfied = bank.unsatisfied[g_rows] & torch.any(best_running > worst_finished, dim=-1,
                                                       keepdim=True)
    bank.unsatisfied[g_rows] = unsatisfied
    exists_open_beam = ~(torch.all(fin_done, dim=-1) & early)
    valid_continuations = ~torch.all(hits, dim=-1)
    return ~(unsatisfied[:, 0] & exists_open_beam & valid_continuations)

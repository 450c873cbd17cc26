"""HF beam selection for many requests in one pass (the arithmetic of ``engine/beam.py``).

A :class:`BeamBank` holds the state of every request that shares a beam width and a number
of stop ids (so the same ``K`` candidates) on one device, one row per request, in host arrays
(``[rows, W]``, read every step): running scores, the finished buffer (scores, sums, finish
codes, done flags, and where each slot's hypothesis came from) and HF's early-stop flag.
:func:`select` runs one step for ``G`` of its rows: on the device, the accumulate, one
``topk`` over ``[G, W * V]`` and the candidates' own log-probs and ranks (read by the host
once); on the host, the stopping criteria, the next running beams, the finished-buffer merge
and the stopping test, each a few array ops over all rows, in HF's float32 order
(``transformers`` 5.24 ``_beam_search`` with ``batch_size = G``; every op is row-wise, so a
row's bits do not depend on the others; the two small ``topk`` run on the device, so ties
break as HF's). The step's candidates stay on the host as a :class:`StepRecord`;
hypotheses' tokens are read back from those records only when a hypothesis is admitted or
returned.
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
NEG32 = np.float32(NEG)  # the same in host arithmetic (float32, as HF's ops)
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
    """The state of requests sharing (beam width, stop-id count, device), a row each. The
    state is small (``[rows, W]``) and read by the host every step, so it lives in host
    arrays; only the accumulate, the K-candidate ``topk`` and the ranks' row reads touch
    the step's log-probs on the device (``topk`` runs on the device, so ties break as HF's)."""

    def __init__(self, width: int, num_stop_ids: int, device: torch.device) -> None:
        self.width = width
        self.num_stop_ids = num_stop_ids
        self.num_candidates = max(2, 1 + num_stop_ids) * width  # HF beams_to_keep
        self.device = device
        self._free: list[int] = []
        self._size = 0
        k = self.num_candidates
        self.top_mask = np.arange(k) < width
        self.cand = np.arange(k)[None, :]
        self._row_starts: dict[int, torch.Tensor] = {}
        self._alloc(4)

    def _alloc(self, cap: int) -> None:
        """(Re)make the state arrays with ``cap`` rows, keeping the rows in use."""
        w, old = self.width, None if self._size == 0 else self.state()
        self.running = np.full((cap, w), NEG, np.float32)
        # finished buffer: scores, raw sums | finish code, done, step, candidate (0: none)
        self.fin_f = np.full((cap, 2, w), NEG, np.float32)
        self.fin_i = np.zeros((cap, 4, w), np.int64)
        self.unsatisfied = np.ones((cap, 1), bool)
        self.stops = np.full((cap, max(self.num_stop_ids, 1)), -1, np.int64)
        # per row: generated length, max_tokens, early_stopping is True, "never" with a
        # positive length penalty; the length penalty
        self.ints = np.zeros((cap, 4), np.int64)
        self.penalty = np.ones(cap, np.float64)
        if old is not None:
            for dst, src in zip(self.state(), old):
                dst[:len(src)] = src
        self._free += list(range(cap - 1, self._size - 1, -1))
        self._size = cap

    def state(self) -> tuple[np.ndarray, ...]:
        """Every per-row array, in one order."""
        return (self.running, self.fin_f, self.fin_i, self.unsatisfied, self.stops, self.ints,
                self.penalty)

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
        self.stops[row, :len(stop_ids)] = stop_ids
        return row

    def release(self, row: int) -> None:
        """The request is done: its row is free again."""
        self._free.append(row)

    def buffer(self, row: int) -> tuple[list, ...]:
        """A row's finished buffer: scores, sums, codes, done, step, candidate."""
        f, i = self.fin_f[row].tolist(), self.fin_i[row].tolist()
        return f[0], f[1], i[0], [bool(x) for x in i[1]], i[2], i[3]

    def row_starts(self, g: int) -> torch.Tensor:
        """``arange(g) * width`` on the bank's device: each of ``g`` requests' first row in a
        step's ``[g * W, V]`` log-probs (made once per ``g``, not every step)."""
        starts = self._row_starts.get(g)
        if starts is None:
            starts = self._row_starts[g] = torch.arange(g, device=self.device) * self.width
        return starts

    def topk(self, *asks: tuple[np.ndarray, int]) -> list[np.ndarray]:
        """For each ``(values, k)``: the indices of each row's ``k`` largest ``values``
        (``[G, n]`` float32), by ``torch.topk`` on the bank's device (its order among ties is
        HF's); all of them queued before the first read (one wait for the device)."""
        idx = [torch.topk(torch.from_numpy(np.ascontiguousarray(v)).to(self.device), k=k)[1]
               for v, k in asks]
        return [i.cpu().numpy() for i in idx]


def select(bank: BeamBank, rows: np.ndarray, singles: np.ndarray, logprobs: torch.Tensor,
           stop_fns: dict[int, Callable[[int, int], bool]] | None = None,
           tops: dict[int, StepTop] | None = None) -> SelectResult:
    """One HF beam step for the ``G`` requests in bank ``rows``: ``logprobs`` ``[G, W, V]``
    float32 (processed; ``singles``: a first step's one row, repeated). ``stop_fns[g](parent,
    token)``: does that candidate of request ``g`` end on a stop string (HF's
    StopStringCriteria on all K candidates)? On the device: the candidates and their own
    log-probs; the rest on the host, in float32 as HF's ops."""
    w = bank.width
    at = _bank_rows(rows)
    gen, max_t, early_h, never = bank.ints[at].T
    new_len = gen + 1
    best_len = np.where(never.astype(bool), max_t, new_len)
    divisors = _powers(np.stack((new_len, best_len), 1), bank.penalty[at])
    bank.ints[at, 0] = new_len
    early = early_h.astype(bool)
    top_lp, ids, parents, lp_tok, ranks = _candidates(bank, at, singles, logprobs)
    stop_tok = _stop_tokens(bank, at, ids, parents, stop_fns)
    hits = np.broadcast_to((new_len >= max_t)[:, None], ids.shape)
    if stop_tok is not None:
        hits = stop_tok | hits
    # next running beams (_get_running_beams_for_next_iteration)
    running_lp = top_lp + hits.astype(np.float32) * NEG32
    merged_f, merged_i = _merge_finished(bank, at, early, divisors[:, :1], top_lp, hits,
                                         stop_tok, new_len)
    next_idx, keep = bank.topk((running_lp, w), (merged_f[:, 0], w))
    running = np.take_along_axis(running_lp, next_idx, 1)
    bank.running[at] = running
    admitted, fin_scores, fin_done = _keep_finished(bank, at, merged_f, merged_i, keep)
    done = _done(bank, at, early, divisors[:, 1:], running, hits, fin_scores, fin_done)
    record = StepRecord(ids, parents, lp_tok, ranks, next_idx,
                        np.take_along_axis(parents, next_idx, 1),
                        np.take_along_axis(ids, next_idx, 1), tops or {})
    adm = np.nonzero(admitted)
    return SelectResult(record, done, list(zip(*(a.tolist() for a in adm))))


def _bank_rows(rows: np.ndarray) -> slice | np.ndarray:
    """The requests' bank rows as an index: a slice (views, no copy) when they are
    consecutive and ascending, the usual case; else the rows."""
    first = int(rows[0])
    if int(rows[-1]) - first == len(rows) - 1 and (len(rows) < 3 or
                                                   (np.diff(rows) == 1).all()):
        return slice(first, first + len(rows))
    return rows


def _stop_tokens(bank: BeamBank, at: slice | np.ndarray, ids: np.ndarray,
                 parents: np.ndarray, stop_fns: dict[int, Callable[[int, int], bool]] | None
                 ) -> np.ndarray | None:
    """Which candidates end on a stop id or a stop string (None: no request has either)."""
    stop_tok = None
    if bank.num_stop_ids:
        stop_tok = (ids[:, :, None] == bank.stops[at][:, None, :]).any(-1)
    if stop_fns:
        extra = np.zeros(ids.shape, bool)
        for g, fn in stop_fns.items():
            extra[g] = [bool(fn(p, t)) for p, t in zip(parents[g].tolist(), ids[g].tolist())]
        stop_tok = extra if stop_tok is None else stop_tok | extra
    return stop_tok


def _powers(lengths: np.ndarray, penalty: np.ndarray) -> np.ndarray:
    """HF's ``length ** length_penalty`` in float64 (Python's pow, row by row, unless every
    penalty is 1), rounded to float32 as torch rounds a Python scalar operand."""
    if (penalty == 1.0).all():
        return lengths.astype(np.float32)
    return np.array([[float(n) ** lp for n in row] for row, lp in
                     zip(lengths.tolist(), penalty.tolist())], np.float64).astype(np.float32)


def _candidates(bank: BeamBank, at: slice | np.ndarray, singles: np.ndarray,
                logprobs: torch.Tensor
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """HF _get_top_k_continuations for every row (accumulate, flatten, top K) on the
    device, and each candidate's own log-prob and rank in its parent's row; on the host:
    scores, tokens, parents, log-probs, ranks."""
    g, w, vocab = logprobs.shape
    dev = logprobs.device
    running = torch.from_numpy(bank.running[at]).to(dev)
    flat = (logprobs + running[:, :, None]).reshape(g, -1)
    top_lp_t, top_idx_t = torch.topk(flat, k=bank.num_candidates)
    if singles.any():  # a single row: parent 0; every rank by its parent's row
        top_lp, top_idx = top_lp_t.cpu().numpy(), top_idx_t.cpu().numpy()
        ids, parents = top_idx % vocab, top_idx // vocab * (1 - singles)[:, None]
        lp, ranks = _token_logprobs(logprobs, torch.from_numpy(parents).to(dev),
                                    torch.from_numpy(ids).to(dev))
        return top_lp, ids, parents, lp.cpu().numpy(), ranks.cpu().numpy()
    lp_t, last_rank_t = _fast_ranks(logprobs, top_idx_t, bank.row_starts(g))
    # every device op is queued before the first read: one wait for the device a step
    top_lp, top_idx, lp, last_rank = (t.cpu().numpy() for t in (top_lp_t, top_idx_t, lp_t,
                                                                 last_rank_t))
    ids, parents = top_idx % vocab, top_idx // vocab
    above = (lp[:, None, :] > lp[:, :, None]) & (parents[:, None, :] == parents[:, :, None])
    ranks = above.sum(-1) + 1
    ranks[:, -1] = last_rank
    tied = np.flatnonzero((top_lp[:, :-1] == top_lp[:, -1:]).any(1))
    if len(tied):  # a tie with the K-th candidate: those rows' ranks in full
        at_t = torch.from_numpy(tied).to(dev)
        ranks[tied] = _token_logprobs(logprobs[at_t], torch.from_numpy(parents[tied]).to(dev),
                                      torch.from_numpy(ids[tied]).to(dev))[1].cpu().numpy()
    return top_lp, ids, parents, lp, ranks


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


def _fast_ranks(logprobs: torch.Tensor, top_idx: torch.Tensor, row_starts: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: each candidate's own log-prob, and the K-th candidate's rank in its
    parent's row, compared in full. The other ranks need no whole row: a token above a
    candidate in its parent's row scores at least as high once the parent's running score is
    added, so it is among the K unless it ties the K-th; they count the candidates above
    (the caller, on the host; a row where another candidate ties the K-th is redone in full).
    ``row_starts``: ``arange(G) * W`` on the device, each request's first row."""
    g, w, vocab = logprobs.shape
    lp = logprobs.reshape(g, w * vocab).gather(1, top_idx)
    at = top_idx[:, -1] // vocab + row_starts
    last = logprobs.reshape(g * w, vocab).index_select(0, at)
    return lp, torch.count_nonzero(last > lp[:, -1:], dim=-1) + 1


def _merge_finished(bank: BeamBank, at: slice | np.ndarray, early: np.ndarray,
                    divisor: np.ndarray, top_lp: np.ndarray, hits: np.ndarray,
                    stop_tok: np.ndarray | None, new_len: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """HF _update_finished_beams for every row, up to its top-k: the finished buffer and the
    step's candidates side by side (floats: scores, sums; ints: codes, done, step,
    candidate), a candidate's score -1e9 unless it may enter (float32, as HF's ops)."""
    did_finish = hits & bank.top_mask[None, :]
    scores = top_lp / divisor
    fin_f, fin_i = bank.fin_f[at], bank.fin_i[at]
    full = fin_i[:, 1].astype(bool).all(-1, keepdims=True) & early[:, None]
    scores += full.astype(np.float32) * NEG32
    scores += (~bank.unsatisfied[at]).astype(np.float32) * NEG32
    scores += (~did_finish).astype(np.float32) * NEG32
    why = LENGTH if stop_tok is None else np.where(stop_tok, STOP, LENGTH)
    g, w = len(top_lp), bank.width
    merged_f = np.empty((g, 2, w + top_lp.shape[1]), np.float32)
    merged_f[:, :, :w] = fin_f
    merged_f[:, 0, w:] = scores
    merged_f[:, 1, w:] = top_lp
    merged_i = np.empty((g, 4, merged_f.shape[2]), np.int64)
    merged_i[:, :, :w] = fin_i
    merged_i[:, 0, w:] = np.where(did_finish, why, UNSET)
    merged_i[:, 1, w:] = did_finish
    merged_i[:, 2, w:] = new_len[:, None]
    merged_i[:, 3, w:] = bank.cand
    return merged_f, merged_i


def _keep_finished(bank: BeamBank, at: slice | np.ndarray, merged_f: np.ndarray,
                   merged_i: np.ndarray, keep: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rest of HF _update_finished_beams: the buffer keeps the merge's top ``W`` (``keep``);
    returns which kept slots were admitted now, and the buffer's scores and done flags."""
    w = bank.width
    kept_f = np.take_along_axis(merged_f, keep[:, None, :], 2)
    kept_i = np.take_along_axis(merged_i, keep[:, None, :], 2)
    bank.fin_f[at], bank.fin_i[at] = kept_f, kept_i
    return (keep >= w) & (kept_i[:, 0] != UNSET), kept_f[:, 0], kept_i[:, 1].astype(bool)


def _done(bank: BeamBank, at: slice | np.ndarray, early: np.ndarray, divisor: np.ndarray,
          running: np.ndarray, hits: np.ndarray, fin_scores: np.ndarray,
          fin_done: np.ndarray) -> np.ndarray:
    """HF _check_early_stop_heuristic + _beam_search_has_unfinished_sequences, every row."""
    best_running = running[:, :1] / divisor
    worst_finished = np.where(fin_done, fin_scores.min(1, keepdims=True), NEG32)
    unsatisfied = bank.unsatisfied[at] & (best_running > worst_finished).any(-1, keepdims=True)
    bank.unsatisfied[at] = unsatisfied
    exists_open_beam = ~(fin_done.all(-1) & early)
    valid_continuations = ~hits.all(-1)
    return ~(unsatisfied[:, 0] & exists_open_beam & valid_continuations)

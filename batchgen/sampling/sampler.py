"""Vectorised token sampling with HF-exact logits processing and vLLM-style logprobs.

One call handles a whole step: ``logits [R, V]`` and the rows' parameter columns
(:class:`SamplingColumns`, views of the persistent batch). Processing follows HF ``generate``
order exactly:

    grammar mask -> logit controls -> repetition penalty -> presence/frequency penalties -> min_tokens ban
    -> temperature -> top-k -> top-p -> min-p -> softmax -> sample

Every stage works on the whole batch with per-row parameter columns; a stage is skipped
entirely when no row needs it, and rows that do not use a stage get neutral values
(temperature 1, penalty 1, ...) that leave their logits bit-for-bit unchanged, so a row's
result never depends on its neighbours. Only the logit controls (allowed ids, bias, bad words,
user processors) run per row, and only on the rows that set them. Rows under a structured-output
constraint first get every token their grammar forbids set to -inf (one batched bitmask fill and
one masked write for those rows, sampling/grammar.py), as vLLM does before its other stages.

Sampling is by inverse CDF: one uniform ``u`` per row, and the token whose interval of the
cumulative distribution holds ``u * total`` (masked tokens have empty intervals, so they are
never picked). ``u`` is a counter-based draw: splitmix64 of the sequence's seed and the number
of tokens it has generated, so a sequence's draws depend on nothing else (not its batch, not a
preemption) and need no generator object. Greedy rows (temperature 0) take the argmax of the
penalised logits.

Penalties: repetition (HF) over every distinct prompt + generated id; presence/frequency
(vLLM/OpenAI) over generated ids only, from per-sequence tables the batch keeps. While a row
has generated fewer than ``min_tokens``, its stop ids and EOS are set to -inf (EOS not when
``ignore_eos``: it is no stop token then, as in vLLM; nor when its grammar allows only a stop
token: the grammar is complete and must end).

Returned logprobs follow the sampler's `logprobs_mode` (sampling/logprobs_mode.py): by default
*raw*, ``log_softmax`` of the unprocessed logits in fp32 (vLLM's default); processed ones are
those of the distribution the token was drawn from. The chosen token is always present in the
top-logprobs. Everything the host needs
comes back in one device-to-host copy (the step's one synchronisation on a GPU).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchgen.sampling import cpu_ops
from batchgen.sampling.cpu_ops import SamplingOps
from batchgen.sampling.logprobs_mode import (
    RAW_LOGPROBS,
    check_logprobs_mode,
    is_processed,
    reported,
)
from batchgen.sampling.named_logprobs import named_scores
from batchgen.transfer import designated_sync, to_device

if TYPE_CHECKING:
    from batchgen.sampling.grammar import GrammarRows

_NEG_INF = float("-inf")

# Columns of SamplingColumns.params, in this order.
# top_p_cut is HF's top-p threshold, 1 - top_p (computed in float64, then stored as float32
# like HF's comparison does), or -1 when top-p is off.
PARAM_NAMES = ("temperature", "top_k", "top_p_cut", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty")
TEMPERATURE, TOP_K, TOP_P_CUT, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(len(PARAM_NAMES))
NUM_PARAMS = len(PARAM_NAMES)
NO_LOGPROBS = -2  # a row that asked for no top logprobs (-1 means the whole vocabulary)
# each column's value when its stage is off (top-k: 0; -1 and >= vocab are off too)
_NEUTRAL = np.array([1.0, 0.0, -1.0, 0.0, 1.0, 0.0, 0.0], np.float32)


def _active(p: np.ndarray) -> np.ndarray:
    """Per column of these rows' params: does any row use that stage? (One vector op.)"""
    return (p != _NEUTRAL).any(axis=0)

RankedLogprobs = dict[int, tuple[float, int]]  # token -> (raw logprob, rank; 1 = the most likely)


@dataclass
class ControlRow:
    """A row with logit controls (per-row Python): its row, params and token history."""

    row: int
    params: object  # SamplingParams: allowed_token_ids, logit_bias, logits_processors
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    bad_word_ids: list[list[int]] | None = None


@dataclass
class SamplingColumns:
    """One step's sample rows as the sampler reads them (the persistent batch's columns)."""

    params: np.ndarray  # [R, NUM_PARAMS] float32, PARAM_NAMES order
    greedy: np.ndarray  # [R] bool
    seeds: np.ndarray  # [R] uint64: the sequence's mixed seed
    num_generated: np.ndarray  # [R] int64: tokens generated before this draw
    min_tokens: np.ndarray  # [R] int64
    stop_ids: np.ndarray  # [R, K] int64, -1 pads: banned below min_tokens
    ignore_eos: np.ndarray  # [R] bool: EOS is no stop token (not banned)
    eos_ids: np.ndarray  # [E] int64
    logprobs: np.ndarray  # [R] int64 top logprobs asked (NO_LOGPROBS, -1 = all, or
    # NAMED_LOGPROBS: the ids in `named`)
    seen: torch.Tensor | None = None  # [R, V] bool: prompt or generated ids (penalised rows)
    offsets: torch.Tensor | None = None  # [R, V] f32: freq * count + presence * (count > 0)
    controls: list[ControlRow] | None = None
    any_logprobs: bool = True  # False: no row asked for top logprobs (the step skips them)
    grammar: GrammarRows | None = None  # rows under a structured-output constraint
    named: np.ndarray | None = None  # [R, W] int64 ids whose logprobs rows report, -1 pads
    forced: np.ndarray | None = None  # [R] int64 token a row emits (trace replay), -1: drawn


@dataclass
class TopLogprobs:
    """Top logprobs of the rows that asked for them, on the host: row `rows[j]` chose
    `token[j]` (logprob, rank) and its `k[j]` best alternatives are `top_ids[j, :k[j]]`."""

    rows: np.ndarray
    k: np.ndarray
    token: np.ndarray
    logprob: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    # rows naming their ids (vLLM's logprob_token_ids): [A, W] ids (-1 pads), logprobs, ranks
    named_ids: np.ndarray | None = None
    named_logprobs: np.ndarray | None = None
    named_ranks: np.ndarray | None = None

    def entry(self, j: int) -> RankedLogprobs:
        """Row j's chosen token, then its top k or the ids it names, as {token: (logprob,
        rank)} (vLLM's shape: the chosen token first, with its true rank even outside the
        top k)."""
        d = {int(self.token[j]): (float(self.logprob[j]), int(self.rank[j]))}
        if self.named_ids is not None and self.named_ids[j, 0] >= 0:
            ids, lps = self.named_ids[j].tolist(), self.named_logprobs[j].tolist()
            for t, lp, r in zip(ids, lps, self.named_ranks[j].tolist()):
                if t >= 0:
                    d.setdefault(t, (lp, int(r)))
            return d
        ids, lps = self.top_ids[j].tolist(), self.top_logprobs[j].tolist()
        for r in range(int(self.k[j])):
            d.setdefault(ids[r], (lps[r], r + 1))
        return d


@dataclass
class SamplerOutput:
    """Chosen tokens and their raw logprobs for one step, on the host, one per row; the top
    logprobs of the rows that asked."""

    token_ids: np.ndarray  # [R] int64
    logprobs: np.ndarray  # [R] float64
    top: TopLogprobs | None


# ----------------------------------------------------------------------------- randomness
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (numpy wraps array arithmetic silently)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def mix_seeds(seeds: np.ndarray) -> np.ndarray:
    """A sequence's key from its seed (uint64), made once when it enters the batch."""
    return _splitmix(seeds.astype(np.uint64))


def uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """U[0, 1) per row from (key, counter): the `counter`-th draw of each sequence, float64."""
    z = keys + (counters.astype(np.uint64) + np.uint64(1)) * _GOLDEN
    return (_splitmix(z) >> np.uint64(11)).astype(np.float64) * 2.0**-53


# ----------------------------------------------------------------------------- stages
def apply_controls(scores: torch.Tensor, controls: list[ControlRow]) -> torch.Tensor:
    """vLLM's per-request logit controls, before penalties: allowed_token_ids (everything
    else -inf), logit_bias (added), bad_words (the last token of a word whose other tokens end
    the output is banned) and logits_processors (called on the row's output ids and logits)."""
    scores = scores.clone()
    for c in controls:
        _control_row(scores, c)
    return scores


def _control_row(scores: torch.Tensor, c: ControlRow) -> None:
    """One row's controls, in place."""
    i, p, vocab = c.row, c.params, scores.shape[1]
    out = c.token_ids[c.num_prompt_tokens:]
    if p.allowed_token_ids:
        keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long,
                            device=scores.device)
        masked = torch.full_like(scores[i], _NEG_INF)
        masked[keep] = scores[i, keep]
        scores[i] = masked
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        scores[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], device=scores.device)
    if c.bad_word_ids:
        banned = [w[-1] for w in c.bad_word_ids
                  if len(w) == 1 or (len(out) >= len(w) - 1
                                     and out[len(out) - len(w) + 1:] == w[:-1])]
        scores[i, [t for t in banned if t < vocab]] = _NEG_INF
    for fn in p.logits_processors or ():
        args = (out, scores[i]) if _arity(fn) == 2 else (c.token_ids[:c.num_prompt_tokens], out,
                                                         scores[i])
        scores[i] = fn(*args)


def _arity(fn: Callable) -> int:
    """Positional parameters of a logits processor: 2 (output ids, logits) or 3 (+ prompt)."""
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return 2


def apply_penalties(scores: torch.Tensor, cols: SamplingColumns, params: torch.Tensor,
                    ops: SamplingOps | None = None) -> torch.Tensor:
    """Repetition (HF: every distinct prompt + generated id), then presence/frequency
    (vLLM/OpenAI: generated ids only), on fp32 logits. Rows without them are unchanged.
    `ops`: the CPU's C loops for the masked stage (same bits)."""
    if cols.seen is None:
        return scores
    active = _active(cols.params)
    rep, offsets = active[REPETITION], active[PRESENCE] or active[FREQUENCY]
    if ops is not None and (rep or offsets):
        return ops.penalize(scores, cols.seen if rep else None,
                            params[:, REPETITION] if rep else None,
                            cols.offsets if offsets else None)
    if rep:
        pen = params[:, REPETITION:REPETITION + 1]
        scores = torch.where(cols.seen, torch.where(scores < 0, scores * pen, scores / pen),
                             scores)
    if offsets:
        scores = scores - cols.offsets
    return scores


def apply_min_tokens(scores: torch.Tensor, cols: SamplingColumns) -> torch.Tensor:
    """Rows below min_tokens: their stop ids and EOS (unless ignore_eos) become -inf, except
    rows whose grammar allows nothing but a stop token."""
    below = cols.num_generated < cols.min_tokens
    if cols.grammar is not None and cols.grammar.must_end is not None and below.any():
        below[cols.grammar.rows[cols.grammar.must_end]] = False  # the grammar must end here
    if not below.any():
        return scores
    rows = np.flatnonzero(below)
    eos = np.broadcast_to(cols.eos_ids, (len(rows), len(cols.eos_ids)))
    eos = np.where(cols.ignore_eos[rows, None], -1, eos)
    ids = np.concatenate([cols.stop_ids[rows], eos], axis=1)
    keep = (ids >= 0) & (ids < scores.shape[1])
    r = np.broadcast_to(rows[:, None], ids.shape)[keep]
    dev = scores.device
    return scores.index_put((to_device(r, dev), to_device(ids[keep], dev)),
                            torch.tensor(_NEG_INF, device=dev))


def apply_warpers(scores: torch.Tensor, p: np.ndarray, params: torch.Tensor,
                  ops: SamplingOps | None = None) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p (HF warpers, HF order) for sampled rows; `p` the
    rows' host params, `params` the same on the logits' device; `ops`: the CPU's C loops
    for the -inf masks (same bits)."""
    active = _active(p)
    if active[TEMPERATURE]:
        scores = scores / params[:, TEMPERATURE:TEMPERATURE + 1]
    k = p[:, TOP_K]
    if active[TOP_K] and np.any((k > 0) & (k < scores.shape[1])):
        scores = _top_k(scores, k, ops)
    if active[TOP_P_CUT]:
        cut = params[:, TOP_P_CUT:TOP_P_CUT + 1]
        scores = (_top_p_by_value(scores, cut, ops) if scores.device.type == "cpu"
                  else _top_p_sorted(scores, cut))
    if active[MIN_P]:
        # HF MinPLogitsWarper; the top token is never below min_p * max, so one always stays.
        probs = scores.softmax(dim=-1)
        limit = params[:, MIN_P:MIN_P + 1] * probs.amax(dim=-1, keepdim=True)
        scores = _mask_below(scores, probs, limit, False, ops)
    return scores


def _mask_below(scores: torch.Tensor, ref: torch.Tensor, limit: torch.Tensor, inclusive: bool,
                ops: SamplingOps | None) -> torch.Tensor:
    """`scores` with -inf where ref < limit (<= when inclusive); limit [R, 1]."""
    if ops is not None:
        return ops.mask_below(scores, ref, limit, inclusive)
    return scores.masked_fill(ref <= limit if inclusive else ref < limit, _NEG_INF)


def _top_k(scores: torch.Tensor, k: np.ndarray, ops: SamplingOps | None = None
           ) -> torch.Tensor:
    """HF TopKLogitsWarper per row: values below the row's k-th largest become -inf (ties
    with it stay); k of 0, -1 or >= vocab keeps the row."""
    vocab = scores.shape[1]
    ks = np.where((k > 0) & (k < vocab), k, vocab).astype(np.int64)
    top = torch.topk(scores, int(ks.max()), dim=-1).values
    kth = top.gather(1, to_device(ks - 1, scores.device)[:, None])
    return _mask_below(scores, scores, kth, False, ops)


def _top_p_sorted(scores: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """HF TopPLogitsWarper: ascending sort, softmax, cumsum; tokens whose cumulative mass is
    <= cut (1 - top_p; -1 keeps the row) are removed, never the most likely one."""
    sorted_vals, sorted_idx = torch.sort(scores, dim=-1, descending=False)
    cum = sorted_vals.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= cut
    remove[:, -1] = False  # min_tokens_to_keep = 1
    mask = torch.zeros_like(remove).scatter_(1, sorted_idx, remove)
    return scores.masked_fill(mask, _NEG_INF)


def _top_p_by_value(scores: torch.Tensor, cut: torch.Tensor, ops: SamplingOps | None = None
                    ) -> torch.Tensor:
    """`_top_p_sorted`'s result on the CPU from a sort of the values alone (numpy's, several
    times faster than torch's with indices). The sorted values, hence their softmax and
    cumsum, are the same bits; the removed tokens are a prefix of the ascending order: every
    token up to the last removed value v, unless the next value in order equals v too. Only
    then, when the cut splits tied tokens, does the order among them matter: those rows take
    torch's sort, as HF does."""
    vocab = scores.shape[1]
    sorted_vals = torch.from_numpy(np.sort(scores.numpy(), axis=-1))
    probs = sorted_vals.softmax(dim=-1)
    if ops is not None:  # sums the cumulative mass itself, only as far as the cut
        out, partial = ops.top_p_cut(probs, sorted_vals, cut, scores)
    else:
        cum = probs.cumsum(dim=-1)
        # tokens removed: those whose cumsum <= cut, a prefix (the cumsum never decreases),
        # never the last (min_tokens_to_keep = 1)
        j = torch.searchsorted(cum, cut.contiguous(), right=True).clamp(max=vocab - 1)
        last = sorted_vals.gather(1, (j - 1).clamp(min=0))
        v = torch.where(j > 0, last, torch.full_like(last, _NEG_INF))
        out = scores.masked_fill(scores <= v, _NEG_INF)
        partial = ((sorted_vals.gather(1, j) == v) & v.isfinite())[:, 0]
    rows = partial.nonzero()[:, 0]  # a split run of ties
    if len(rows):
        out[rows] = _top_p_sorted(scores[rows], cut[rows])
    return out


# ----------------------------------------------------------------------------- sampler
class Sampler:
    """Samples one token per row from the rows' columns; holds no state of its own.
    `use_cpu_ops`: on the CPU, run the masked stages as C loops when they build;
    `logprobs_mode`: what the logprobs report (vLLM's four modes)."""

    def __init__(self, use_cpu_ops: bool = True, logprobs_mode: str = RAW_LOGPROBS) -> None:
        self.use_cpu_ops = use_cpu_ops
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)

    def __call__(self, logits: torch.Tensor, cols: SamplingColumns) -> SamplerOutput:
        """Pick one token per row and report raw logprobs (and top logprobs where asked)."""
        n = len(cols.greedy)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [rows={n}, V], got {tuple(logits.shape)}")
        raw = logits.float()
        dev = raw.device
        params = to_device(cols.params, dev)
        ops = cpu_ops.load() if dev.type == "cpu" and self.use_cpu_ops else None
        # the grammar masks its rows in place (every later stage makes new tensors) and puts
        # their values back once the tokens are chosen: raw logprobs stay the model's
        saved = cols.grammar.apply(raw) if cols.grammar is not None else None
        scores = apply_controls(raw, cols.controls) if cols.controls else raw
        scores = apply_penalties(scores, cols, params, ops)
        scores = apply_min_tokens(scores, cols)
        keep = is_processed(self.logprobs_mode)
        chosen, processed = self._choose(scores, cols, params, ops, keep)
        if cols.forced is not None:  # trace replay: the trace's token, scored as drawn
            forced = to_device(cols.forced, dev)
            chosen = torch.where(forced >= 0, forced, chosen)
        if saved is not None:
            if processed is raw:  # the grammar's mask is part of the processed logits
                processed = processed.clone()
            cols.grammar.restore(raw, saved)
        values, norm = reported(self.logprobs_mode, raw, processed)
        chosen_lp = values.gather(1, chosen[:, None])[:, 0] - norm
        top = (_top_logprobs(values, norm, chosen, cols.logprobs, cols.named)
               if cols.any_logprobs else None)
        host = _to_host([chosen, chosen_lp, *top[3]] if top else [chosen, chosen_lp])
        return SamplerOutput(host[0], host[1], _top_of(top, host[2:]) if top else None)

    @staticmethod
    def _choose(scores: torch.Tensor, cols: SamplingColumns, params: torch.Tensor,
                ops: SamplingOps | None, keep: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy rows: argmax of the penalised logits; the others: warp and draw. With
        `keep`, also the logits each row chose from (greedy rows: penalised; the others:
        warped), else None."""
        greedy = cols.greedy
        if greedy.all():
            return _argmax(scores), scores if keep else None
        dev = scores.device
        sampled = np.flatnonzero(~greedy) if greedy.any() else None
        sub, p, sub_params = scores, cols.params, params
        if sampled is not None:
            s_idx = to_device(sampled, dev)
            sub, p, sub_params = scores[s_idx], p[sampled], params[s_idx]
        keys = cols.seeds if sampled is None else cols.seeds[sampled]
        counters = cols.num_generated if sampled is None else cols.num_generated[sampled]
        u = ops.uniforms(keys, counters) if ops is not None else uniforms(keys, counters)
        warped = apply_warpers(sub, p, sub_params, ops)
        probs, u = warped.softmax(dim=-1), to_device(u, dev)
        picked = ops.inverse_cdf(probs, u) if ops is not None else _inverse_cdf(probs, u)
        if sampled is None:
            return picked, warped if keep else None
        chosen = _argmax(scores)
        chosen[s_idx] = picked
        if not keep:
            return chosen, None
        processed = scores.clone()
        processed[s_idx] = warped
        return chosen, processed


def _argmax(scores: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (numpy's is several times faster on the CPU; same index)."""
    if scores.device.type == "cpu":
        return torch.from_numpy(scores.numpy().argmax(axis=-1))
    return scores.argmax(dim=-1)


def _top_logprobs(raw: torch.Tensor, lse: torch.Tensor, chosen: torch.Tensor, ks: np.ndarray,
                  named: np.ndarray | None = None) -> tuple | None:
    """For the rows that asked (ks != NO_LOGPROBS; -1 = the whole vocabulary; NAMED_LOGPROBS:
    the ids `named` gives the row): (rows, k, their named ids or None) on the host, then as
    device tensors the chosen token, its raw logprob and rank, the top k ids and logprobs,
    and the named ids' logprobs and ranks."""
    asked = np.flatnonzero(ks != NO_LOGPROBS)
    if not asked.size:
        return None
    vocab = raw.shape[1]
    k = np.minimum(np.where(ks[asked] == -1, vocab, np.maximum(ks[asked], 0)), vocab)
    rows = to_device(asked, raw.device)
    lp = raw[rows] - lse[rows, None]
    tok = chosen[rows]
    tok_lp = lp.gather(1, tok[:, None])[:, 0]
    ranks = (lp > tok_lp[:, None]).sum(dim=-1) + 1
    kmax = int(k.max())
    top_lp, top_ids = torch.topk(lp, kmax, dim=-1) if kmax else (lp[:, :0], tok[:, None][:, :0])
    tensors = [tok, tok_lp, ranks, top_ids, top_lp]
    ids = None if named is None else named[asked]
    if ids is not None:
        tensors += named_scores(lp, ids)
    return asked, k, ids, tensors


def _top_of(top: tuple, host: list[np.ndarray]) -> TopLogprobs:
    """The TopLogprobs of `_top_logprobs`'s result, its tensors now `host` arrays."""
    asked, k, ids, _ = top
    named = (ids, *host[5:7]) if ids is not None else ()
    return TopLogprobs(asked, k, *host[:5], *named)


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The tensors on the host as numpy (int64 / float64), in one copy: the one
    synchronisation of a step on a GPU."""
    if tensors[0].device.type == "cpu":
        return [t.numpy().astype(np.float64 if t.is_floating_point() else np.int64, copy=False)
                for t in tensors]
    with designated_sync():
        flat = torch.cat([t.reshape(-1).double() for t in tensors]).cpu().numpy()
    host, at = [], 0
    for t in tensors:
        part = flat[at:at + t.numel()].reshape(t.shape)
        host.append(part if t.is_floating_point() else part.astype(np.int64))
        at += t.numel()
    return host


def ranked_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int | None]
                    ) -> list[RankedLogprobs | None]:
    """Per row with k not None: the chosen token and the top k, each with (logprob, rank); rank
    1 is the most likely, a chosen token outside the top k gets its true rank (vLLM's form);
    k = -1 means every token. Rows with k None get None (prompt logprobs use it)."""
    arr = np.array([NO_LOGPROBS if k is None else k for k in ks], np.int64)
    zero = torch.zeros(logprobs.shape[0], device=logprobs.device)
    top = _top_logprobs(logprobs.float(), zero, chosen, arr)
    out: list[RankedLogprobs | None] = [None] * len(ks)
    if top is not None:
        res = _top_of(top, _to_host(top[3]))
        for j, i in enumerate(res.rows.tolist()):
            out[i] = res.entry(j)
    return out


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row whose CDF interval holds u * total; zero-probability tokens have empty
    intervals and are never chosen."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    below = torch.nextafter(total, torch.zeros_like(total))  # u rounded to 1.0 stays inside
    target = torch.minimum(u.to(cdf.dtype) * total, below)[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp_(max=probs.shape[-1] - 1)

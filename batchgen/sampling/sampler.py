"""Vectorised token sampling with HF-exact logits processing and vLLM-style logprobs.

One call handles a whole step: ``logits [N, V]`` plus one :class:`SamplingRow` per row.
Processing follows HF ``generate`` order exactly:

    repetition penalty -> presence/frequency penalties -> min_tokens ban
    -> temperature -> top-k -> top-p -> min-p -> softmax -> sample

Every stage works on the whole batch with per-row parameter columns; a stage is skipped
entirely when no row needs it, and rows that do not use a stage get neutral values
(temperature 1, penalty 1, ...) that leave their logits bit-for-bit unchanged, so a row's
result never depends on its neighbours.

Sampling is by inverse CDF: one uniform ``u`` per row, and the token whose interval of the
cumulative distribution holds ``u * total`` (masked tokens have empty intervals, so they are
never picked). That is exact and costs one random number per row instead of one per token.
Seeded rows draw ``u`` from their own generator, unseeded rows from the sampler's one
generator in a single call. Greedy rows (temperature 0) take the argmax of the penalised
logits and consume no randomness.

Penalties: repetition (HF) over every distinct prompt + generated id; presence/frequency
(vLLM/OpenAI) over generated ids only. While a row has generated fewer than ``min_tokens``,
its stop ids and EOS are set to -inf (EOS not when ``ignore_eos``: it is no stop token then,
as in vLLM). Ids >= V in a history are ignored.

Returned logprobs are *raw*: ``log_softmax`` of the unprocessed logits in fp32 (vLLM's
default), with the chosen token always present in the top-logprobs dict.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from batchgen.params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One row of the step's logits, as the engine describes it to the sampler."""

    params: SamplingParams
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int  # generated ids are token_ids[num_prompt_tokens:]
    generator: torch.Generator | None = None  # per-sequence generator for seeded requests
    eos_token_id: int | list[int] | None = None  # banned (with stop ids) while < min_tokens
    bad_word_ids: list[list[int]] | None = None  # params.bad_words, tokenized

    @property
    def num_generated(self) -> int:
        """How many tokens this sequence has generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens


RankedLogprobs = dict[int, tuple[float, int]]  # token -> (raw logprob, rank; 1 = the most likely)


@dataclass
class SamplerOutput:
    """Chosen tokens and their raw logprobs for one step, one entry per row; with `logprobs`
    asked, the chosen token and the top-k with their ranks."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[RankedLogprobs | None]


# ----------------------------------------------------------------------------- helpers


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A float32 [n, 1] column on the logits' device (one small host-to-device copy)."""
    return torch.tensor(values, dtype=torch.float32).to(like.device, non_blocking=True)[:, None]


def _pairs(id_lists: list[list[int]], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row id lists into (row index, token id) tensors, dropping ids >= vocab."""
    lengths = [len(ids) for ids in id_lists]
    flat = [t for ids in id_lists for t in ids]
    ids = torch.tensor(flat, dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), torch.tensor(lengths, dtype=torch.long))
    keep = (ids >= 0) & (ids < vocab)
    return rows[keep].to(device), ids[keep].to(device)


def _top_k_active(k: int, vocab: int) -> bool:
    """Whether top-k with this k removes anything (0 and -1 disable it, as in vLLM)."""
    return 0 < k < vocab


def _banned_ids(row: SamplingRow) -> list[int]:
    """Ids banned for this row by min_tokens: stop ids, plus EOS unless ignore_eos (vLLM)."""
    p = row.params
    if row.num_generated >= p.min_tokens:
        return []
    banned = list(p.stop_ids)
    eos = row.eos_token_id
    if eos is not None and not p.ignore_eos:
        banned.extend([eos] if isinstance(eos, int) else eos)
    return banned


# ----------------------------------------------------------------------------- stages


def _needs_controls(rows: list[SamplingRow]) -> bool:
    return any(r.params.logit_bias or r.params.allowed_token_ids or r.bad_word_ids
               or r.params.logits_processors for r in rows)


def apply_controls(scores: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM's per-request logit controls, before penalties: allowed_token_ids (everything
    else -inf), logit_bias (added), bad_words (the last token of a word whose other tokens end
    the output is banned) and logits_processors (called on the row's output ids and logits)."""
    scores = scores.clone()
    vocab = scores.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.allowed_token_ids:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long,
                                device=scores.device)
            masked = torch.full_like(scores[i], _NEG_INF)
            masked[keep] = scores[i, keep]
            scores[i] = masked
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            scores[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], device=scores.device)
        if r.bad_word_ids:
            out = r.token_ids[r.num_prompt_tokens:]
            banned = [w[-1] for w in r.bad_word_ids
                      if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:]
                                         == w[:-1])]
            scores[i, [t for t in banned if t < vocab]] = _NEG_INF
        for fn in p.logits_processors or ():
            out = r.token_ids[r.num_prompt_tokens:]
            prompt = r.token_ids[:r.num_prompt_tokens]
            args = (out, scores[i]) if _arity(fn) == 2 else (prompt, out, scores[i])
            scores[i] = fn(*args)
    return scores


def _arity(fn: object) -> int:
    """Positional parameters of a logits processor: 2 (output ids, logits) or 3 (+ prompt)."""
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return 2


def apply_penalties(scores: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, presence/frequency penalties and the min_tokens ban, on fp32 logits."""
    n, vocab = scores.shape
    dev = scores.device
    rep = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in rep):
        # HF RepetitionPenaltyLogitsProcessor: every distinct prompt + generated id.
        r_idx, t_idx = _pairs([r.token_ids if p != 1.0 else [] for r, p in zip(rows, rep)], vocab, dev)
        seen = torch.zeros((n, vocab), dtype=torch.bool, device=dev)
        seen[r_idx, t_idx] = True
        pen = _column(rep, scores)
        scores = torch.where(seen, torch.where(scores < 0, scores * pen, scores / pen), scores)
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    if any(f != 0.0 or p != 0.0 for f, p in zip(freq, pres)):
        # vLLM/OpenAI: generated ids only; subtract freq * count + presence * (count > 0).
        gen = [r.token_ids[r.num_prompt_tokens:] if (f != 0.0 or p != 0.0) else []
               for r, f, p in zip(rows, freq, pres)]
        r_idx, t_idx = _pairs(gen, vocab, dev)
        counts = torch.zeros((n, vocab), dtype=torch.float32, device=dev)
        counts.index_put_((r_idx, t_idx), torch.ones_like(t_idx, dtype=torch.float32), accumulate=True)
        scores = scores - (_column(freq, scores) * counts + _column(pres, scores) * (counts > 0))
    banned = [_banned_ids(r) for r in rows]
    if any(banned):
        r_idx, t_idx = _pairs(banned, vocab, dev)
        scores = scores.index_put((r_idx, t_idx), torch.tensor(_NEG_INF, device=dev))
    return scores


def apply_warpers(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p (HF warpers, HF order) for sampled rows."""
    vocab = scores.shape[1]
    temps = [float(p.temperature) for p in params]
    if any(t != 1.0 for t in temps):
        scores = scores / _column(temps, scores)
    ks = [p.top_k if _top_k_active(p.top_k, vocab) else vocab for p in params]
    need_k = any(k < vocab for k in ks)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_p:
        # One ascending sort serves both: masking values below the k-th keeps the order.
        sorted_vals, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        if need_k:
            pos = torch.tensor([vocab - k for k in ks], dtype=torch.long).to(scores.device)
            kth = sorted_vals.gather(1, pos[:, None])
            scores = scores.masked_fill(scores < kth, _NEG_INF)
            sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, _NEG_INF)
        cum = sorted_vals.softmax(dim=-1).cumsum(dim=-1)
        # Rows without top-p get threshold -1 so nothing is removed (HF skips the warper).
        thresh = _column([1.0 - p.top_p if p.top_p < 1.0 else -1.0 for p in params], scores)
        remove = cum <= thresh
        remove[:, -1] = False  # min_tokens_to_keep = 1
        mask = torch.zeros_like(remove).scatter_(1, sorted_idx, remove)
        scores = scores.masked_fill(mask, _NEG_INF)
    elif need_k:
        top = torch.topk(scores, max(ks), dim=-1).values
        pos = torch.tensor([k - 1 for k in ks], dtype=torch.long).to(scores.device)
        kth = top.gather(1, pos[:, None])
        scores = scores.masked_fill(scores < kth, _NEG_INF)
    min_ps = [float(p.min_p) for p in params]
    if any(m > 0.0 for m in min_ps):
        # HF MinPLogitsWarper; the top token is never below min_p * max, so one always stays.
        probs = scores.softmax(dim=-1)
        top_p = probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < _column(min_ps, scores) * top_p, _NEG_INF)
    return scores


def _split(rows: list[SamplingRow]) -> tuple[list[int], list[int]]:
    """Indices of greedy rows and of sampled rows."""
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    return greedy, sampled


def _needs_penalties(rows: list[SamplingRow]) -> bool:
    """Whether any row has a penalty or an active min_tokens ban."""
    return any(
        r.params.repetition_penalty != 1.0
        or r.params.presence_penalty != 0.0
        or r.params.frequency_penalty != 0.0
        or r.num_generated < r.params.min_tokens
        for r in rows
    )


# ----------------------------------------------------------------------------- sampler


class Sampler:
    """Samples one token per row; owns the generator shared by all unseeded rows."""

    def __init__(self, seed: int | None = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The sampler's generator on ``device`` (created and seeded on first use)."""
        device = torch.device(device)
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()  # nondeterministic, as vLLM with seed=None
            else:
                g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per row: seeded rows from their own generator, others shared."""
        u = torch.empty(len(rows), dtype=torch.float64)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            shared = torch.rand(len(unseeded), dtype=torch.float64,
                                generator=self.generator(torch.device("cpu")))
            u[unseeded] = shared
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=r.generator).item()
        return u.to(device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Pick one token per row and report raw logprobs (and top-k logprobs if asked)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        raw = logits.float()
        n, vocab = raw.shape
        dev = raw.device
        scores = apply_controls(raw, rows) if _needs_controls(rows) else raw
        scores = apply_penalties(scores, rows) if _needs_penalties(rows) else scores
        greedy, sampled = _split(rows)
        if not sampled:
            return self._output(raw, scores.argmax(dim=-1), rows)
        sub_rows = [rows[i] for i in sampled]
        sub = scores
        if greedy:
            s_idx = torch.tensor(sampled, dtype=torch.long, device=dev)
            sub = scores[s_idx]
        warped = apply_warpers(sub, [r.params for r in sub_rows])
        picked = _inverse_cdf(warped.softmax(dim=-1), self._uniforms(sub_rows, dev))
        if not greedy:
            return self._output(raw, picked, rows)
        chosen = torch.empty(n, dtype=torch.long, device=dev)
        g_idx = torch.tensor(greedy, dtype=torch.long, device=dev)
        chosen[g_idx] = scores[g_idx].argmax(dim=-1)
        chosen[s_idx] = picked
        return self._output(raw, chosen, rows)

    @staticmethod
    def _output(raw: torch.Tensor, chosen: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Gather raw logprobs of the chosen tokens and the requested top-k; one host sync."""
        lse = torch.logsumexp(raw, dim=-1)
        chosen_lp = raw.gather(1, chosen[:, None])[:, 0] - lse
        ks = [r.params.logprobs for r in rows]
        tops = ranked_logprobs(raw - lse[:, None], chosen, ks)
        return SamplerOutput(token_ids=chosen.tolist(), logprobs=chosen_lp.tolist(),
                             top_logprobs=tops)


def ranked_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int | None]
                    ) -> list[RankedLogprobs | None]:
    """Per row with k not None: the chosen token and the top k, each with (logprob, rank); rank
    1 is the most likely, a chosen token outside the top k gets its true rank (vLLM's form);
    k = -1 means every token.
    Rows with k None get None. Used for sampled tokens and prompt logprobs alike."""
    vocab = logprobs.shape[1]
    ks = [vocab if k == -1 else k for k in ks]  # -1: the whole vocabulary (vLLM)
    asked = [i for i, k in enumerate(ks) if k is not None]
    out: list[RankedLogprobs | None] = [None] * len(ks)
    if not asked:
        return out
    rows = torch.tensor(asked, dtype=torch.long, device=logprobs.device)
    lp = logprobs[rows]
    tok = chosen[rows]
    tok_lp = lp.gather(1, tok[:, None])
    ranks = ((lp > tok_lp).sum(dim=-1) + 1).tolist()
    kmax = min(max(ks[i] for i in asked), vocab)
    top_lp, top_ids = (torch.topk(lp, kmax, dim=-1) if kmax > 0 else (lp[:, :0], tok[:, None][:, :0]))
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(asked):
        d = {int(tok[j]): (float(tok_lp[j, 0]), ranks[j])}
        for r in range(min(ks[i], vocab)):
            d.setdefault(top_ids[j][r], (top_lp[j][r], r + 1))
        out[i] = d
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

"""Beam search selection with exactly HuggingFace ``generate(num_beams=...)`` semantics.

Pure and engine-independent: one :class:`BeamSearchState` drives the beams of ONE prompt,
one decoding step at a time. Each step the engine hands over the float32 log-probs of the
next token of every live beam and gets back a :class:`BeamStep`: which live beam (parent)
continues with which token in each next running slot, which hypotheses were finalised, and
whether the group is done. The engine owns the KV cache (fork a parent's block table for each
extra child, free parents that have no child); this module never touches it.

The arithmetic mirrors ``transformers`` 5.24 ``GenerationMixin._beam_search``
(``generation/utils.py``) tensor op by tensor op, in float32 and on the device of the given
log-probs, so that sequences, ``sequences_scores`` and the stopping step agree with HF:

- State per group (HF ``batch_size = 1``): ``running_beam_scores`` ``[1, W]`` starting at
  ``[0, -1e9, ...]``; finished buffer ``beam_scores`` ``[1, W]`` starting at ``-1e9``;
  ``is_sent_finished`` ``[1, W]``; ``is_early_stop_heuristic_unsatisfied`` ``[1, 1]``.
- HF runs the first step on ``W`` identical copies of the prompt. The engine may pass a single
  row on the first step; it is expanded to ``W`` rows (copies 1.. carry ``-1e9``) so that even
  the ``K > V`` corner and ``-1e9`` ties behave as in HF. After the first step there are always
  ``W`` live beams (some may carry a ``~-1e9`` score when too few candidates were unfinished,
  exactly like HF, which keeps computing them).
- ``K = max(2, 1 + n_stop_ids) * W`` candidates: ``torch.topk`` over the flattened
  ``[W * V]`` accumulated scores (``_get_top_k_continuations``).
- A candidate hits a stopping criterion when its token is an EOS / stop token id, when the
  ``is_stop`` callback says so (stop strings: HF's ``StopStringCriteria`` is also evaluated on
  all K candidates), or when it reaches ``max_tokens`` (``MaxLengthCriteria``).
- Next running beams: ``topk(topk_scores + hit * -1e9, W)`` (``_get_running_beams_for_next_
  iteration``), i.e. the best W unfinished candidates, in that order.
- Finalisation (``_update_finished_beams``): only hits ranked ``< W`` among the K are admitted,
  scored ``sum_logprobs / gen_len ** length_penalty`` with ``gen_len`` the generated length
  including the new (EOS) token (HF ``cur_len + 1 - decoder_prompt_len``); the buffer keeps
  the best W of ``cat(buffer, candidates)`` with ``-1e9`` penalties for non-admitted ones.
- Stop (``_check_early_stop_heuristic`` + ``_beam_search_has_unfinished_sequences``): done when
  no improvement is possible (best running ``/ L ** lp`` is not above the worst finished score,
  with ``L = max_tokens`` if ``early_stopping == "never" and lp > 0`` else the current generated
  length; an unfilled buffer slot counts as ``-1e9``), or when ``early_stopping is True`` and all
  W buffer slots are finished, or when every one of the K candidates hit a stopping criterion
  (e.g. ``max_tokens``).
- :meth:`BeamSearchState.finalize` returns the first ``num_return_sequences`` buffer slots (best
  first), like HF ``sequences[:, :num_return_sequences]``. HF 5.24 has no "pad with running
  beams" fallback any more: at ``max_tokens`` every candidate is a hit, so the top W running
  continuations are finalised by the normal rule.

Note: HF ``generate(num_beams=1)`` runs *greedy* search, not ``_beam_search``. This module with
``beam_width=1`` reproduces ``_beam_search`` with one beam (it can differ from greedy unless
``early_stopping=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from batchgen.engine.beam_controls import BeamControls
from batchgen.engine.beam_logprobs import TokenLogprob, step_top

__all__ = ["BeamHypothesis", "BeamSearchState", "BeamSelector", "BeamStep", "StopFn",
           "candidate_logprobs"]

#: ``is_stop(parent_idx, token) -> bool``: does appending ``token`` to live beam
#: ``parent_idx`` end the hypothesis (e.g. completes a stop string)? Called only on the top-K
#: candidates of a step (at most ``K`` calls), never on the whole vocabulary.
StopFn = Callable[[int, int], bool]

_NEG = -1.0e9  # HF's "impossible" score
IMPOSSIBLE = _NEG  # (public: under a grammar, results drop hypotheses that carry it)

#: finish codes stored per finished-buffer slot
_UNSET, _STOP, _LENGTH = 0, 1, 2
_REASONS = {_STOP: "stop", _LENGTH: "length"}


@dataclass
class BeamHypothesis:
    """One hypothesis of the finished buffer."""

    token_ids: list[int]  # generated tokens only, including the final EOS / stop token
    sum_logprobs: float  # accumulated log-probs (HF's raw running score)
    score: float  # HF sequences_scores: sum_logprobs / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS / stop id / stop string) or "length"
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # (logprob, rank, top-k)


class BeamSelector(Protocol):
    """What the engine needs of one request's beam selection: HF beam search
    (BeamSearchState, here) or HF 4.x group beam search (engine/group_beam.py)."""

    gen_len: int  # generated tokens so far
    done: bool  # HF would stop: call finalize()

    @property
    def num_live_beams(self) -> int: ...

    def step(self, logprobs: torch.Tensor, is_stop: StopFn | None = None) -> BeamStep:
        """One token for the live beams (``logprobs``: their rows, in beam order)."""
        ...

    def running_scores(self) -> list[float]: ...

    def finished_slots(self) -> list[tuple[int, tuple[float, float, int, str]]]: ...

    def finalize(self) -> list[BeamHypothesis]: ...


@dataclass
class BeamStep:
    """What the engine must do after one step.

    ``parents[j]`` / ``tokens[j]``: next running slot ``j`` is live beam ``parents[j]`` (index
    into the beams passed to :meth:`BeamSearchState.step`) extended by ``tokens[j]``. A parent
    may appear several times (fork its KV) or not at all (free it). Empty when ``done``.
    ``finished``: hypotheses admitted to the finished buffer at this step (a later step may
    still push them out of the best W). ``done``: HF would stop; call ``finalize()``.
    """

    parents: list[int]
    tokens: list[int]
    done: bool
    finished: list[BeamHypothesis] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens[j]


class BeamSearchState:
    """HF beam search selection for one prompt; see the module docstring.

    ``eos_token_ids`` and ``stop_token_ids`` are merged into one set of stop ids (pass
    ``eos_token_ids=[]`` for ``ignore_eos``); their count sets ``K`` like HF's
    ``len(eos_token_id)``, so ``stop_token_ids=[s]`` behaves like HF with
    ``eos_token_id=[eos, s]``. ``vocab_size`` (optional) is checked against the log-probs width.
    ``top_logprobs`` (k) makes every token also keep its parent row's top-k alternatives (one
    ``topk`` per step). The arguments are those of a validated ``BeamSearchParams``.
    """

    def __init__(
        self,
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        eos_token_ids: Sequence[int] = (),
        num_return_sequences: int | None = None,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] = (),
        controls: BeamControls | None = None,
        top_logprobs: int = 0,
    ) -> None:
        self.beam_width = beam_width
        self.controls = controls  # HF's logits processors, run on each step's log-probs
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_return_sequences = num_return_sequences or beam_width
        self.vocab_size = vocab_size
        self.top_logprobs = top_logprobs
        self.stop_ids = list(dict.fromkeys(int(t) for t in (*eos_token_ids, *stop_token_ids)))
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * beam_width  # HF beams_to_keep
        self.gen_len = 0  # generated tokens so far (HF cur_len - decoder_prompt_len)
        self.done = False
        self._device: torch.device | None = None
        # Running beams (HF running_sequences / running_beam_scores).
        self._running: list[list[int]] = [[]]
        self._running_lps: list[list[TokenLogprob]] = [[]]  # each token's logprob, rank, top-k
        self._running_scores: torch.Tensor | None = None
        # Finished buffer (HF sequences / beam_scores / is_sent_finished), W slots.
        self._fin_tokens: list[list[int]] = [[] for _ in range(beam_width)]
        self._fin_lps: list[list[TokenLogprob]] = [[] for _ in range(beam_width)]
        self._fin_scores: torch.Tensor | None = None
        self._fin_sums: torch.Tensor | None = None  # raw sums, gathered alongside
        self._fin_reason: torch.Tensor | None = None
        self._fin_done: torch.Tensor | None = None
        self._unsatisfied: torch.Tensor | None = None

    def _init_tensors(self, device: torch.device) -> None:
        w = self.beam_width
        self._device = device
        self._running_scores = torch.zeros((1, w), dtype=torch.float, device=device)
        self._running_scores[:, 1:] = _NEG
        self._fin_scores = torch.full((1, w), _NEG, dtype=torch.float, device=device)
        self._fin_sums = torch.full((1, w), _NEG, dtype=torch.float, device=device)
        self._fin_reason = torch.zeros((1, w), dtype=torch.int8, device=device)
        self._fin_done = torch.zeros((1, w), dtype=torch.bool, device=device)
        self._unsatisfied = torch.ones((1, 1), dtype=torch.bool, device=device)
        self._stop_id_tensor = torch.tensor(self.stop_ids, dtype=torch.long, device=device)
        k = self.num_candidates
        self._top_mask = torch.cat(
            (torch.ones(w, dtype=torch.bool), torch.zeros(k - w, dtype=torch.bool))
        ).to(device)

    @property
    def num_live_beams(self) -> int:
        """Rows :meth:`step` expects (1 before the first step, then ``beam_width``; 0 once done)."""
        return len(self._running)

    # --------------------------------------------------------------------- step
    def step(self, logprobs: torch.Tensor, is_stop: StopFn | None = None) -> BeamStep:
        """Advance one token.

        ``logprobs``: ``[num_live_beams, V]`` float32 ``log_softmax`` of the live beams'
        next-token logits, rows in beam order; ``controls`` (HF's processors) run on them here,
        and the hypotheses' scores and per-token logprobs are the processed values. On the first step a
        single row (the prompt) is expected; ``W`` identical rows are also accepted.
        ``is_stop``: optional :data:`StopFn` for stop strings, treated like EOS.
        """
        logprobs, first_single = self._check_rows(logprobs)
        if self.controls is not None:
            logprobs = self.controls.process(logprobs)
        # b-c. accumulate, flatten to [1, W * V], top-K continuations
        vocab = logprobs.shape[1]
        flat = (logprobs.to(torch.float32)[None] + self._running_scores[:, :, None]).reshape(1, -1)
        topk_log_probs, topk_indices = torch.topk(flat, k=self.num_candidates)
        topk_ids = topk_indices % vocab
        ids_l = topk_ids[0].tolist()
        parents_l = ([0] * len(ids_l) if first_single
                     else (topk_indices // vocab)[0].tolist())
        cand_lps = candidate_logprobs(logprobs, parents_l, topk_ids[0], self.top_logprobs)
        new_len = self.gen_len + 1  # generated length including the new token
        # d. stopping criteria on all K candidates (EOS / stop ids, stop strings, max length)
        is_stop_tok = torch.isin(topk_ids, self._stop_id_tensor)
        if is_stop is not None:
            extra = [bool(is_stop(p, t)) for p, t in zip(parents_l, ids_l)]
            is_stop_tok = is_stop_tok | torch.tensor([extra], dtype=torch.bool, device=self._device)
        hits = is_stop_tok | (new_len >= self.max_tokens)
        # e. next running beams (_get_running_beams_for_next_iteration)
        topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * _NEG
        next_idx = torch.topk(topk_running_log_probs, k=self.beam_width)[1]
        self._running_scores = torch.take_along_dim(topk_running_log_probs, next_idx, dim=1)
        # f. finished buffer (_update_finished_beams)
        finished = self._update_finished(topk_log_probs, hits, is_stop_tok, new_len, parents_l,
                                         ids_l, cand_lps)
        # g. stopping condition of the group
        self.gen_len = new_len
        self.done = self._group_done(hits)
        old_running, old_lps = self._running, self._running_lps
        if self.done:
            self._running, self._running_lps = [], []
            return BeamStep([], [], True, finished)
        next_l = next_idx[0].tolist()
        parents = [parents_l[c] for c in next_l]
        tokens = [ids_l[c] for c in next_l]
        lps = [cand_lps[c] for c in next_l]
        if self.controls is not None:
            self.controls.advance(parents, tokens)
        self._running = [[*old_running[p], t] for p, t in zip(parents, tokens)]
        self._running_lps = [[*old_lps[p], lp] for p, lp in zip(parents, lps)]
        return BeamStep(parents, tokens, False, finished, lps)

    def _check_rows(self, logprobs: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The step's [W, V] rows (a single first-step row expanded) and whether it was one."""
        if self.done:
            raise RuntimeError("beam search group is already done")
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must be 2-D [beams, V], got shape {tuple(logprobs.shape)}")
        w = self.beam_width
        n_live, vocab = logprobs.shape
        if self.vocab_size is not None and vocab != self.vocab_size:
            raise ValueError(f"logprobs has {vocab} columns, expected vocab_size={self.vocab_size}")
        if self._running_scores is None:
            self._init_tensors(logprobs.device)
            if n_live == 1:
                return logprobs.expand(w, vocab), True
            if n_live != w:
                raise ValueError(f"first step expects 1 or {w} rows, got {n_live}")
        elif n_live != w:
            raise ValueError(f"expected {w} live beams, got {n_live}")
        return logprobs, False

    def _update_finished(self, topk_log_probs: torch.Tensor, hits: torch.Tensor,
                         is_stop_tok: torch.Tensor, new_len: int, parents_l: list[int],
                         ids_l: list[int], cand_lps: list[TokenLogprob]
                         ) -> list[BeamHypothesis]:
        """Merge this step's admitted hits into the W-slot finished buffer (HF
        _update_finished_beams); returns the hypotheses admitted now."""
        w = self.beam_width
        did_finish = hits & self._top_mask[None, :]
        scores = topk_log_probs / (new_len**self.length_penalty)
        full = torch.all(self._fin_done, dim=-1, keepdim=True) & (self.early_stopping is True)
        scores += full.to(torch.float32) * _NEG
        scores += (~self._unsatisfied).to(torch.float32) * _NEG
        scores += (~did_finish) * _NEG
        reason = torch.where(is_stop_tok, _STOP, _LENGTH).to(torch.int8)
        reason = torch.where(did_finish, reason, torch.zeros_like(reason))
        merged = [torch.cat(pair, dim=1) for pair in (
            (self._fin_scores, scores), (self._fin_sums, topk_log_probs),
            (self._fin_reason, reason), (self._fin_done, did_finish))]
        keep = torch.topk(merged[0], k=w)[1]
        self._fin_scores, self._fin_sums, self._fin_reason, self._fin_done = (
            torch.take_along_dim(m, keep, dim=1) for m in merged)
        new_fin: list[list[int]] = []
        new_lps: list[list[TokenLogprob]] = []
        finished: list[BeamHypothesis] = []
        scores_l, sums_l = self._fin_scores[0].tolist(), self._fin_sums[0].tolist()
        reasons_l = self._fin_reason[0].tolist()
        for slot, i in enumerate(keep[0].tolist()):
            if i < w:
                new_fin.append(self._fin_tokens[i])
                new_lps.append(self._fin_lps[i])
                continue
            c = i - w
            toks = [*self._running[parents_l[c]], ids_l[c]]
            lps = [*self._running_lps[parents_l[c]], cand_lps[c]]
            new_fin.append(toks)
            new_lps.append(lps)
            if reasons_l[slot] != _UNSET:
                finished.append(BeamHypothesis(list(toks), sums_l[slot], scores_l[slot],
                                               _REASONS[reasons_l[slot]], list(lps)))
        self._fin_tokens, self._fin_lps = new_fin, new_lps
        return finished

    def _group_done(self, hits: torch.Tensor) -> bool:
        """HF _check_early_stop_heuristic + _beam_search_has_unfinished_sequences."""
        lp = self.length_penalty
        best_len = (self.max_tokens if self.early_stopping == "never" and lp > 0.0
                    else self.gen_len)
        best_running = self._running_scores[:, :1] / (best_len**lp)
        worst_finished = torch.where(
            self._fin_done, torch.min(self._fin_scores, dim=1, keepdim=True)[0], _NEG)
        self._unsatisfied = self._unsatisfied & torch.any(
            best_running > worst_finished, dim=-1, keepdim=True)
        improvement_possible = bool(torch.any(self._unsatisfied))
        exists_open_beam = not (bool(torch.all(self._fin_done)) and self.early_stopping is True)
        valid_continuations = not bool(torch.all(hits))
        return not (improvement_possible and exists_open_beam and valid_continuations)

    # ------------------------------------------------------------ trace views
    def running_scores(self) -> list[float]:
        """The live beams' cumulative log-probs (HF running_beam_scores), best first."""
        return [] if self._running_scores is None else self._running_scores[0].tolist()

    def finished_slots(self) -> list[tuple[int, tuple[float, float, int, str]]]:
        """The finished buffer's filled slots: (slot, (score, sum of log-probs, number of
        tokens, finish reason)), best first."""
        if self._fin_done is None:
            return []
        done, reasons = self._fin_done[0].tolist(), self._fin_reason[0].tolist()
        scores, sums = self._fin_scores[0].tolist(), self._fin_sums[0].tolist()
        return [(j, (scores[j], sums[j], len(self._fin_tokens[j]), _REASONS[reasons[j]]))
                for j in range(self.beam_width) if done[j] and reasons[j] != _UNSET]

    # ----------------------------------------------------------------- finalize
    def finalize(self) -> list[BeamHypothesis]:
        """Best ``num_return_sequences`` hypotheses, best first (HF ``sequences[:n]``).

        Normally called once :attr:`done`; calling it earlier returns the current buffer. A slot
        that never received a finished hypothesis (only possible in HF's degenerate ``-1e9``
        cases) comes back with its HF content: its tokens so far, a ``~-1e9`` score and
        ``finish_reason="length"``.
        """
        if self._fin_scores is None:
            raise RuntimeError("finalize() before the first step")
        n = self.num_return_sequences
        scores = self._fin_scores[0, :n].tolist()
        sums = self._fin_sums[0, :n].tolist()
        reasons = self._fin_reason[0, :n].tolist()
        return [
            BeamHypothesis(list(self._fin_tokens[i]), sums[i], scores[i],
                           _REASONS.get(reasons[i], "length"), list(self._fin_lps[i]))
            for i in range(n)
        ]


def candidate_logprobs(logprobs: torch.Tensor, parents: list[int], tokens: torch.Tensor,
                        k: int = 0) -> list[TokenLogprob]:
    """Each candidate token's own log-prob in its parent's row and its rank there (1 = the
    most likely), for the hypotheses' per-token logprobs; with ``k``, a reference to the
    parent row's top-k alternatives (one topk over the rows up to the last parent)."""
    rows = logprobs[torch.tensor(parents, device=logprobs.device)].to(torch.float32)
    lp = rows.gather(1, tokens[:, None])
    ranks = (rows > lp).sum(dim=-1) + 1
    top = step_top(logprobs[:max(parents) + 1], k) if k else None
    return [TokenLogprob(v, r, top, p)
            for v, r, p in zip(lp[:, 0].tolist(), ranks.tolist(), parents)]

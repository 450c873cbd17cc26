"""Beam search selection with exactly HuggingFace ``generate(num_beams=...)`` semantics.

Engine-independent: one :class:`BeamSearchState` drives the beams of ONE prompt, one
decoding step at a time (:func:`step_many` steps many prompts in one pass: their tensors are
rows of a shared :class:`~batchgen.engine.beam_batch.BeamBank`, and every op below is
row-wise, so a prompt's result does not depend on the others). Each step the engine hands over the float32 log-probs of the
next token of every live beam and gets back a :class:`BeamStep`: which live beam (parent)
continues with which token in each next running slot, which hypotheses were finalised, and
whether the group is done. The engine owns the KV cache (fork a parent's block table for each
extra child, free parents that have no child); this module never touches it.

The arithmetic mirrors ``transformers`` 5.24 ``GenerationMixin._beam_search``
(``generation/utils.py``) tensor op by tensor op, in float32 and on the device of the given
log-probs, so that sequences, ``sequences_scores`` and the stopping step agree with HF:

- State per group (a bank row; HF ``batch_size = 1``): ``running_beam_scores`` ``[W]``
  starting at ``[0, -1e9, ...]``; finished buffer ``beam_scores`` ``[W]`` starting at
  ``-1e9``; ``is_sent_finished`` ``[W]``; ``is_early_stop_heuristic_unsatisfied`` ``[1]``.
  The tokens are not carried along: each step's candidates are kept on the host (a record)
  and a hypothesis's tokens are read back through its parents when it is admitted or
  returned.
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

import numpy as np
import torch

from batchgen.engine.beam_batch import (
    LENGTH,
    STOP,
    UNSET,
    BeamBank,
    SelectResult,
    StepRecord,
    select,
)
from batchgen.engine.beam_controls import BeamControls
from batchgen.engine.beam_logprobs import StepTop, TokenLogprob, step_top

__all__ = ["BeamHypothesis", "BeamSearchState", "BeamSelector", "BeamStep", "StopFn",
           "candidate_logprobs", "step_many"]

#: ``is_stop(parent_idx, token) -> bool``: does appending ``token`` to live beam
#: ``parent_idx`` end the hypothesis (e.g. completes a stop string)? Called only on the top-K
#: candidates of a step (at most ``K`` calls), never on the whole vocabulary.
StopFn = Callable[[int, int], bool]

IMPOSSIBLE = -1.0e9  # HF's "impossible" score (public: results under a grammar drop it)

_UNSET = UNSET
_REASONS = {STOP: "stop", LENGTH: "length"}


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

    Its tensors are a row of a :class:`~batchgen.engine.beam_batch.BeamBank`: its own, or the
    engine's (:meth:`join`), which steps many requests in one pass (:func:`step_many`); its
    tokens are read back from the steps' records when a hypothesis is admitted or returned.
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
        self.extra = controls is not None or top_logprobs > 0  # per-request work each step
        self.stop_ids = list(dict.fromkeys(int(t) for t in (*eos_token_ids, *stop_token_ids)))
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * beam_width  # HF beams_to_keep
        self.gen_len = 0  # generated tokens so far (HF cur_len - decoder_prompt_len)
        self.done = False
        self.bank: BeamBank | None = None
        self.row = -1
        self._live = 1
        self._history: list[tuple[StepRecord, int]] = []  # each step's record and our row
        self._final: tuple[list, ...] | None = None  # the finished buffer, once done

    def bank_key(self, device: torch.device) -> tuple[int, int, torch.device]:
        """Requests with the same key can share a bank (and a step's pass)."""
        return self.beam_width, len(self.stop_ids), device

    def join(self, bank: BeamBank) -> None:
        """Take a row of ``bank`` (before the first step)."""
        if self.bank is not None:
            raise RuntimeError("the beam state already has its bank")
        self.bank, self.row = bank, bank.add(self.stop_ids, self.max_tokens,
                                             self.length_penalty, self.early_stopping)

    @property
    def num_live_beams(self) -> int:
        """Rows :meth:`step` expects (1 before the first step, then ``beam_width``; 0 once done)."""
        return self._live

    # --------------------------------------------------------------------- step
    def step(self, logprobs: torch.Tensor, is_stop: StopFn | None = None) -> BeamStep:
        """Advance one token.

        ``logprobs``: ``[num_live_beams, V]`` float32 ``log_softmax`` of the live beams'
        next-token logits, rows in beam order; ``controls`` (HF's processors) run on them here,
        and the hypotheses' scores and per-token logprobs are the processed values. On the first step a
        single row (the prompt) is expected; ``W`` identical rows are also accepted.
        ``is_stop``: optional :data:`StopFn` for stop strings, treated like EOS.
        """
        single = self.check_rows(logprobs)
        if self.bank is None:
            self.join(BeamBank(self.beam_width, len(self.stop_ids), logprobs.device))
        rows = logprobs.expand(self.beam_width, -1) if single else logprobs
        result = step_many([self], rows.to(torch.float32)[None].contiguous(), [single],
                           {} if is_stop is None else {0: is_stop})
        step = self.step_of(result, 0, [slot for _, slot in result.admitted])
        if not step.done:
            step.token_logprobs = self.running_logprobs()
        return step

    def check_rows(self, logprobs: torch.Tensor) -> bool:
        """Checks the step's rows; True when one row stands for all beams (the first step)."""
        if self.done:
            raise RuntimeError("beam search group is already done")
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must be 2-D [beams, V], got shape {tuple(logprobs.shape)}")
        w = self.beam_width
        n_live, vocab = logprobs.shape
        if self.vocab_size is not None and vocab != self.vocab_size:
            raise ValueError(f"logprobs has {vocab} columns, expected vocab_size={self.vocab_size}")
        if self.gen_len == 0:
            if n_live not in (1, w):
                raise ValueError(f"first step expects 1 or {w} rows, got {n_live}")
            return n_live == 1
        if n_live != w:
            raise ValueError(f"expected {w} live beams, got {n_live}")
        return False

    def settle(self, result: SelectResult, g: int) -> None:
        """Row ``g`` of a step (taken by ``step_many``) after a first step, a last one or with
        HF's processors: a done request keeps its finished buffer and frees its bank row; the
        processors follow the beams chosen."""
        rec = result.record
        if result.done[g]:
            self.done, self._live = True, 0
            self._final = self.bank.buffer(self.row)
            self.bank.release(self.row)
        else:
            self._live = self.beam_width
            if self.controls is not None:
                self.controls.advance(rec.next_parents[g].tolist(), rec.next_ids[g].tolist())

    def step_of(self, result: SelectResult, g: int, admitted: list[int]) -> BeamStep:
        """Row ``g`` of an advanced step as a BeamStep (``admitted``: buffer slots filled
        now, built as hypotheses), without per-token logprobs."""
        finished = [self._slot_hypothesis(slot) for slot in admitted]
        if self.done:
            return BeamStep([], [], True, finished)
        rec = result.record
        return BeamStep(rec.next_parents[g].tolist(), rec.next_ids[g].tolist(), False, finished)

    def running_logprobs(self) -> list[TokenLogprob]:
        """The last token of each live beam: its logprob, rank (and top-k)."""
        rec, g = self._history[-1]
        return [self._token(rec, g, c) for c in rec.nxt[g].tolist()]

    @staticmethod
    def _token(rec: StepRecord, g: int, c: int) -> TokenLogprob:
        """Candidate ``c`` of row ``g`` of a step's record as a TokenLogprob."""
        return TokenLogprob(float(rec.logprobs[g, c]), int(rec.ranks[g, c]), rec.tops.get(g),
                            int(rec.parents[g, c]))

    def _tokens_of(self, step: int, cand: int) -> tuple[list[int], list[TokenLogprob]]:
        """The tokens and their logprobs of candidate ``cand`` of step ``step`` (1-based):
        walked back through the parents' records."""
        toks: list[int] = []
        lps: list[TokenLogprob] = []
        while step >= 1:
            rec, g = self._history[step - 1]
            toks.append(int(rec.ids[g, cand]))
            lps.append(self._token(rec, g, cand))
            parent = int(rec.parents[g, cand])
            step -= 1
            if step:
                prev, pg = self._history[step - 1]
                cand = int(prev.nxt[pg, parent])
        return toks[::-1], lps[::-1]

    def _buffer(self) -> tuple[list, ...]:
        """The finished buffer on the host (scores, sums, codes, done, step, candidate)."""
        if self._final is not None:
            return self._final
        if self.bank is None:
            raise RuntimeError("finalize() before the first step")
        return self.bank.buffer(self.row)

    def _slot_hypothesis(self, slot: int) -> BeamHypothesis:
        """The hypothesis in a finished-buffer slot (its HF content, even when never admitted)."""
        scores, sums, reasons, _, steps, cands = self._buffer()
        toks, lps = self._tokens_of(steps[slot], cands[slot])
        return BeamHypothesis(toks, sums[slot], scores[slot],
                              _REASONS.get(reasons[slot], "length"), lps)

    # ------------------------------------------------------------ trace views
    def running_scores(self) -> list[float]:
        """The live beams' cumulative log-probs (HF running_beam_scores), best first."""
        if self.bank is None or self.gen_len == 0 or self.done:
            return []
        return self.bank.running[self.row].tolist()

    def finished_slots(self) -> list[tuple[int, tuple[float, float, int, str]]]:
        """The finished buffer's filled slots: (slot, (score, sum of log-probs, number of
        tokens, finish reason)), best first."""
        if self.bank is None:
            return []
        scores, sums, reasons, done, steps, _ = self._buffer()
        return [(j, (scores[j], sums[j], steps[j], _REASONS[reasons[j]]))
                for j in range(self.beam_width) if done[j] and reasons[j] != _UNSET]

    # ----------------------------------------------------------------- finalize
    def finalize(self) -> list[BeamHypothesis]:
        """Best ``num_return_sequences`` hypotheses, best first (HF ``sequences[:n]``).

        Normally called once :attr:`done`; calling it earlier returns the current buffer. A slot
        that never received a finished hypothesis (only possible in HF's degenerate ``-1e9``
        cases) comes back with its HF content: its tokens so far, a ``~-1e9`` score and
        ``finish_reason="length"``.
        """
        return [self._slot_hypothesis(i) for i in range(self.num_return_sequences)]


def step_many(states: list[BeamSearchState], logprobs: torch.Tensor,
              singles: Sequence[bool] | np.ndarray, stop_fns: dict[int, StopFn],
              rows: np.ndarray | None = None) -> SelectResult:
    """One step of every state (all in one bank): ``logprobs`` ``[G, W, V]`` float32, a first
    step's single row repeated (written in place by the processors); ``stop_fns``: request
    ``g``'s stop strings, by ``g``; ``rows``: the states' bank rows (read from them when
    None). HF's processors run per request that has them, the selection for all at once;
    Python per request only to take its row (its hypotheses are built when asked:
    :meth:`BeamSearchState.step_of`, finalize)."""
    tops: dict[int, StepTop] = {}
    for g in [g for g, s in enumerate(states) if s.extra]:
        s = states[g]
        if s.controls is not None:
            logprobs[g] = s.controls.process(logprobs[g])
        if s.top_logprobs:
            tops[g] = step_top(logprobs[g], s.top_logprobs)
    if rows is None:
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
    result = select(states[0].bank, rows, np.asarray(singles, np.int64), logprobs, stop_fns,
                    tops)
    rec, done = result.record, result.done.tolist()
    for g, s in enumerate(states):  # each takes its row; Python beyond that only for some
        s._history.append((rec, g))
        s.gen_len += 1
        if done[g] or s.extra or s._live != s.beam_width:
            s.settle(result, g)
    return result


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

"""Diverse beam search: transformers 4.x ``_group_beam_search`` (Hamming diversity) for one prompt.

transformers 5 removed group beam search from the library; the semantics here are those of
transformers 4.55.4 (``generation/utils.py`` ``_group_beam_search``, ``beam_search.py``
``BeamSearchScorer`` / ``BeamHypotheses``, ``HammingDiversityLogitsProcessor``), checked against
fixtures written by ``tests/make_group_beam_fixtures.py``. ``W`` beams are split into ``G`` groups
of ``W / G``; each step, the groups run in order:

- each group's rows: ``log_softmax`` log-probs, minus ``diversity_penalty`` times how often each
  token was chosen at this step by the groups before it (a finished group counts its ``W / G``
  pad tokens, as HF's do), then the other processors (:class:`BeamControls`, HF's order);
- ``topk`` of the group's ``[W/G * V]`` accumulated scores, ``K = max(2, 1 + n_stop_ids) * W/G``
  candidates, best first; a stop-id candidate ranked ``< W/G`` becomes a hypothesis of the
  group's own ``W/G``-slot buffer (HF ``BeamHypotheses.add``: scored ``sum / gen_len ** lp``, the
  worst dropped when full); other candidates become the next running beams until ``W/G``;
- the group is done when its buffer is full and (``early_stopping``) True / the best candidate
  cannot beat the worst hypothesis (False: at the current length; "never": at ``max_tokens``
  when ``length_penalty > 0``).

The search ends when every group is done or at ``max_tokens`` (then each unfinished group's
running beams enter its buffer). :meth:`finalize` sorts all groups' hypotheses by score (stable,
as HF) and returns the best ``num_return_sequences``. A finished group's beams leave the engine
at once (HF keeps computing them on pad tokens; only those pad tokens matter, and they are
counted). Stop strings and grammars are not combined with groups (``BeamSearchParams`` refuses).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from batchgen.engine.beam import BeamHypothesis, BeamStep, StopFn, candidate_logprobs
from batchgen.engine.beam_controls import BeamControls

__all__ = ["GroupBeamSearchState"]

_NEG = -1.0e9


@dataclass
class _Group:
    """One beam group: running beams (generated tokens, per-token logprobs, float32 scores)
    and its HF ``BeamHypotheses`` buffer."""

    running: list[list[int]]
    running_lps: list[list[tuple[float, int]]]
    scores: torch.Tensor | None = None
    controls: BeamControls | None = None  # HF's processors over the group's rows
    hyps: list[tuple[float, BeamHypothesis]] = field(default_factory=list)
    worst: float = 1e9
    done: bool = False


class GroupBeamSearchState:
    """HF 4.x group beam search for one prompt; the engine-facing interface of
    :class:`~batchgen.engine.beam.BeamSearchState` (``step``, ``finalize``, ``gen_len``,
    ``done``, ``num_live_beams``). ``make_controls(rows)``: a group's processors, or None."""

    def __init__(self, beam_width: int, num_beam_groups: int, diversity_penalty: float,
                 max_tokens: int, length_penalty: float = 1.0,
                 early_stopping: bool | str = False, stop_ids: Sequence[int] = (),
                 num_return_sequences: int | None = None, pad_token_id: int = 0,
                 make_controls: Callable[[int], BeamControls | None] | None = None) -> None:
        self.beam_width = beam_width
        self.group_size = beam_width // num_beam_groups
        self.diversity_penalty = diversity_penalty
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.stop_ids = list(dict.fromkeys(int(t) for t in stop_ids))
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * self.group_size
        self.num_return_sequences = num_return_sequences or beam_width
        self.pad_token_id = pad_token_id
        self.gen_len = 0
        self.done = False
        self.groups = [
            _Group([[] for _ in range(self.group_size)], [[] for _ in range(self.group_size)],
                   controls=make_controls(self.group_size) if make_controls else None)
            for _ in range(num_beam_groups)]

    @property
    def num_live_beams(self) -> int:
        """Rows :meth:`step` expects: 1 before the first step, then the unfinished groups'."""
        if self.done:
            return 0
        if self.gen_len == 0:
            return 1
        return sum(self.group_size for g in self.groups if not g.done)

    def step(self, logprobs: torch.Tensor, is_stop: StopFn | None = None) -> BeamStep:
        """Advance every unfinished group one token; ``logprobs`` ``[num_live_beams, V]``
        float32 log_softmax rows (groups in order, beams in order; one row on the first step)."""
        if self.done:
            raise RuntimeError("beam search group is already done")
        if logprobs.dim() != 2 or logprobs.shape[0] != self.num_live_beams:
            raise ValueError(f"expected {self.num_live_beams} live beams, got shape "
                             f"{tuple(logprobs.shape)}")
        first = self.gen_len == 0
        new_len = self.gen_len + 1
        current: list[int] = []  # tokens the groups before chose at this step (HF current_tokens)
        parents: list[int] = []
        tokens: list[int] = []
        lps: list[tuple[float, int]] = []
        finished: list[BeamHypothesis] = []
        at = 0
        for gi, g in enumerate(self.groups):
            if g.done:
                current += [self.pad_token_id] * self.group_size
                continue
            if g.scores is None:
                g.scores = torch.full((self.group_size,), _NEG, dtype=torch.float,
                                      device=logprobs.device)
                g.scores[0] = 0.0
            rows = (logprobs.expand(self.group_size, -1) if first
                    else logprobs[at:at + self.group_size])
            chosen = self._step_group(g, gi, rows, current, new_len, finished)
            current += [t for _, t, _ in chosen]
            if not g.done:
                parents += [0 if first else at + p for p, _, _ in chosen]
                tokens += [t for _, t, _ in chosen]
                lps += [lp for _, _, lp in chosen]
            at += 0 if first else self.group_size
        self.gen_len = new_len
        if new_len >= self.max_tokens:
            finished += self._close_running()
        self.done = self.done or all(g.done for g in self.groups)
        if self.done:
            return BeamStep([], [], True, finished)
        return BeamStep(parents, tokens, False, finished, lps)

    def _step_group(self, g: _Group, gi: int, rows: torch.Tensor, current: list[int],
                    new_len: int, finished: list[BeamHypothesis]
                    ) -> list[tuple[int, int, tuple[float, int]]]:
        """One group's HF step; returns its next beams as (parent row in the group, token,
        (logprob, rank)) and updates its running state, buffer and done flag."""
        vocab = rows.shape[1]
        if gi > 0 and self.diversity_penalty > 0:
            prev = torch.tensor(current, dtype=torch.long, device=rows.device)
            rows = rows - self.diversity_penalty * torch.bincount(prev, minlength=vocab)
        if g.controls is not None:
            rows = g.controls.process(rows)
        flat = (rows + g.scores[:, None]).reshape(1, -1)
        top_scores, top_idx = torch.topk(flat, self.num_candidates, dim=1, largest=True,
                                         sorted=True)
        ids_l = (top_idx % vocab)[0].tolist()
        parents_l = (top_idx // vocab)[0].tolist()
        scores_l = top_scores[0].tolist()
        cand = candidate_logprobs(rows, parents_l, top_idx[0] % vocab)
        chosen: list[tuple[int, int, tuple[float, int]]] = []
        picked: list[int] = []
        for rank, (tok, p, sc) in enumerate(zip(ids_l, parents_l, scores_l)):
            if tok in self.stop_ids:
                if rank < self.group_size:
                    self._add(g, [*g.running[p], tok], [*g.running_lps[p], cand[rank]], sc,
                              new_len, "stop", finished)
            else:
                chosen.append((p, tok, cand[rank]))
                picked.append(rank)
            if len(chosen) == self.group_size:
                break
        g.done = g.done or self._is_done(g, max(scores_l), new_len)
        g.scores = top_scores[0, torch.tensor(picked, device=top_scores.device)]
        g.running = [[*g.running[p], t] for p, t, _ in chosen]
        g.running_lps = [[*g.running_lps[p], lp] for p, _, lp in chosen]
        if g.controls is not None and not g.done:
            g.controls.advance([p for p, _, _ in chosen], [t for _, t, _ in chosen])
        return chosen

    def _add(self, g: _Group, toks: list[int], lps: list[tuple[float, int]], sum_lp: float,
             gen_len: int, reason: str, finished: list[BeamHypothesis]) -> None:
        """HF ``BeamHypotheses.add``: keep the group's best ``W/G`` hypotheses."""
        score = sum_lp / (gen_len ** self.length_penalty)
        if len(g.hyps) < self.group_size or score > g.worst:
            h = BeamHypothesis(toks, sum_lp, score, reason, lps)
            g.hyps.append((score, h))
            finished.append(h)
            if len(g.hyps) > self.group_size:
                order = sorted((s, i) for i, (s, _) in enumerate(g.hyps))
                del g.hyps[order[0][1]]
                g.worst = order[1][0]
            else:
                g.worst = min(score, g.worst)

    def _is_done(self, g: _Group, best_sum: float, cur_len: int) -> bool:
        """HF ``BeamHypotheses.is_done`` (``cur_len``: generated length with the new token)."""
        if len(g.hyps) < self.group_size:
            return False
        if self.early_stopping is True:
            return True
        lp = self.length_penalty
        length = self.max_tokens if self.early_stopping == "never" and lp > 0.0 else cur_len
        return g.worst >= best_sum / length ** lp

    def _close_running(self) -> list[BeamHypothesis]:
        """At ``max_tokens``: each unfinished group's running beams enter its buffer (HF
        ``finalize``)."""
        finished: list[BeamHypothesis] = []
        for g in self.groups:
            if g.done:
                continue
            for toks, lps, sc in zip(g.running, g.running_lps, g.scores.tolist()):
                self._add(g, list(toks), list(lps), sc, len(toks), "length", finished)
        self.done = True
        return finished

    def running_scores(self) -> list[float]:
        """The live beams' cumulative log-probs, unfinished groups in order (the rows of the
        next step), for the trace."""
        return [s for g in self.groups if not g.done and g.scores is not None
                for s in g.scores.tolist()]

    def finished_slots(self) -> list[tuple[int, tuple[float, float, int, str]]]:
        """Every group's buffer, best first within a group: (slot, (score, sum of log-probs,
        number of tokens, finish reason)); group ``i`` owns slots ``i * W/G`` onwards."""
        return [(gi * self.group_size + j,
                 (score, h.sum_logprobs, len(h.token_ids), h.finish_reason))
                for gi, g in enumerate(self.groups)
                for j, (score, h) in enumerate(sorted(g.hyps, key=lambda x: -x[0]))]

    def finalize(self) -> list[BeamHypothesis]:
        """The best ``num_return_sequences`` hypotheses of all groups (HF's stable sort by score,
        then the last first)."""
        pool = sorted((h for g in self.groups for h in g.hyps), key=lambda x: x[0])
        return [pool.pop()[1] for _ in range(min(self.num_return_sequences, len(pool)))]

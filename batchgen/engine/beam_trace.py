"""What beam search records beside its selection: each token's top-k alternatives
(``BeamSearchParams(logprobs=k)``) and, with ``return_trace=True``, a per-step trace of the live
beams (parent, token, score, the KV blocks of their block tables) and of the finished buffer.

Both are opt-in. The alternatives cost one ``topk`` over the group's ``[W, V]`` log-probs per
step and ``W * k`` numbers on the host; the hypotheses keep a reference to that step's record
(no per-token dicts until the output is built). The trace costs nothing when off (the policy
checks one attribute per group step) and, on, ``W`` live records and at most ``W`` finished
records per step: steps x width records (a live record's block list grows with its beam's
length, one id per block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from batchgen.engine.beam import BeamSearchState, BeamStep
    from batchgen.engine.sequence import Sequence

__all__ = ["BeamTrace", "StepTop", "TokenLogprob", "step_top"]

_IMPOSSIBLE = float("-inf")  # a masked token's log-prob (structured outputs)


@dataclass
class StepTop:
    """One beam step's top-k alternatives, on the host: row ``r`` (a live beam, the parent
    of its candidates) has ``ids[r]`` with log-probs ``logprobs[r]``, best first."""

    ids: list[list[int]]
    logprobs: list[list[float]]


def step_top(logprobs: torch.Tensor, k: int) -> StepTop:
    """The top ``k`` of every row of a step's ``[rows, V]`` log-probs: one ``topk`` call and
    one transfer of ``rows * k`` values (never a per-vocabulary Python loop)."""
    vals, ids = torch.topk(logprobs.to(torch.float32), k=min(k, logprobs.shape[-1]), dim=-1)
    return StepTop(ids.tolist(), vals.tolist())


class TokenLogprob(NamedTuple):
    """A generated token's log-prob and rank (1 = the most likely) in its parent beam's
    distribution at that step, and, with ``logprobs=k``, that step's alternatives (``top``,
    row ``row``)."""

    logprob: float
    rank: int
    top: StepTop | None = None
    row: int = 0

    def entry(self, token: int) -> dict[int, tuple[float, int]]:
        """``{token: (logprob, rank)}``, the chosen token first (with its true rank even
        outside the top k), then the alternatives ranked 1..k (vLLM's logprobs shape). Tokens a
        grammar forbids (-inf) are no alternatives: the list stops before the first of them."""
        d = {token: (self.logprob, self.rank)}
        if self.top is not None:
            for r, (t, lp) in enumerate(zip(self.top.ids[self.row], self.top.logprobs[self.row])):
                if lp == _IMPOSSIBLE:
                    break
                d.setdefault(t, (lp, r + 1))
        return d


@dataclass
class BeamTrace:
    """How one request's beams evolved, as plain records (see :meth:`to_records`).

    ``live``: per step (0 = the first generated token) one record per running beam after the
    step: ``beam`` (its slot), ``parent`` (the slot it continued at the previous step),
    ``token``, ``cumulative_logprob`` (HF's running beam score) and ``blocks``, the physical KV
    block ids of its block table once its new token's K/V is written (read at the next step,
    after any copy-on-write: beams sharing a prefix show the same ids for the shared blocks).
    ``finished``: per step, the finished buffer's filled slots: ``slot``, ``score`` (HF's
    length-penalised ``sequences_scores``), ``cumulative_logprob``, ``num_tokens``,
    ``finish_reason``.
    """

    live: list[dict[str, Any]] = field(default_factory=list)
    finished: list[dict[str, Any]] = field(default_factory=list)
    _pending: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def num_steps(self) -> int:
        """Beam steps recorded so far."""
        return 1 + max((r["step"] for r in (*self.live, *self.finished)), default=-1)

    def record(self, beams: list[Sequence], step: BeamStep, state: BeamSearchState) -> None:
        """One step of the group: ``beams`` are the live beams that were scored (their
        tables hold the previous step's tokens), ``step`` the selection, ``state`` after it."""
        for rec, seq in zip(self._pending, beams):
            rec["blocks"] = block_ids(seq)
        n = state.gen_len - 1
        scores = state.running_scores() if not step.done else []
        self._pending = [{"step": n, "beam": j, "parent": p, "token": t,
                          "cumulative_logprob": s, "blocks": []}
                         for j, (p, t, s) in enumerate(zip(step.parents, step.tokens, scores))]
        self.live += self._pending
        self.finished += [{"step": n, "slot": j, "score": score, "cumulative_logprob": total,
                           "num_tokens": length, "finish_reason": reason}
                          for j, (score, total, length, reason) in state.finished_slots()]

    def to_records(self) -> list[dict[str, Any]]:
        """Live and finished records in one list (``kind`` tells them apart; the other
        kind's columns are None), ordered by step: ``pandas.DataFrame(trace.to_records())``."""
        cols = ("step", "kind", "beam", "parent", "token", "cumulative_logprob", "score",
                "num_tokens", "finish_reason", "blocks")
        rows = [{**dict.fromkeys(cols), **r, "kind": "live"} for r in self.live]
        rows += [{**dict.fromkeys(cols), **{k: v for k, v in r.items() if k != "slot"},
                  "beam": r["slot"], "kind": "finished"} for r in self.finished]
        rows.sort(key=lambda r: (r["step"], r["kind"] != "live", r["beam"]))
        return rows

    def to_pandas(self) -> Any:
        """The records as a pandas DataFrame (pandas is optional: imported only here)."""
        import pandas as pd

        return pd.DataFrame(self.to_records())


def block_ids(seq: Sequence) -> list[int]:
    """The physical KV blocks of a running sequence's block table (its persistent-batch
    row, which the scheduler keeps equal to the block manager's table)."""
    b = seq.batch
    if b is None:
        return []
    n = int(b.cols["num_blocks"][seq.slot])
    return b.block_table[seq.slot, :n].tolist()

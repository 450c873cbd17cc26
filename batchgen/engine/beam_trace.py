"""Recording a beam request's trace (``BeamSearchParams(return_trace=True)``): the live beams
after each step (parent, token, score, the KV blocks of their block tables) and the finished
buffer, written into the user's ``BeamTrace`` (outputs.py).

It costs nothing when off (the policy checks one attribute per group step) and, on, ``W`` live
records and at most ``W`` finished records per step: steps x width records (a live record's
block list grows with its beam's length, one id per block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchgen.engine.beam import BeamSelector, BeamStep
from batchgen.engine.sequence import Sequence
from batchgen.outputs import BeamTrace

__all__ = ["TraceRecorder"]

Tables = Callable[[Sequence], list[int]]  # a running sequence's block table (a copy)


class TraceRecorder:
    """Writes one request's BeamTrace, step by step."""

    def __init__(self) -> None:
        self.trace = BeamTrace()
        self._pending: list[dict[str, Any]] = []  # last step's live records, blocks unread

    def record(self, beams: list[Sequence], step: BeamStep, state: BeamSelector,
               tables: Tables) -> None:
        """One step of the group: ``beams`` are the live beams that were scored (their
        tables hold the previous step's tokens: the pending records' blocks), ``step`` the
        selection, ``state`` after it."""
        for rec, seq in zip(self._pending, beams):
            rec["blocks"] = tables(seq)
        n = state.gen_len - 1
        scores = state.running_scores() if not step.done else []
        self._pending = [{"step": n, "beam": j, "parent": p, "token": t,
                          "cumulative_logprob": s, "blocks": []}
                         for j, (p, t, s) in enumerate(zip(step.parents, step.tokens, scores))]
        self.trace.live += self._pending
        self.trace.finished += [
            {"step": n, "slot": j, "score": score, "cumulative_logprob": total,
             "num_tokens": length, "finish_reason": reason}
            for j, (score, total, length, reason) in state.finished_slots()]

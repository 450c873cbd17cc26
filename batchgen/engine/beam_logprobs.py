"""A beam token's log-prob, rank and (with ``BeamSearchParams(logprobs=k)``) its step's top-k
alternatives. The alternatives cost one ``topk`` over the group's ``[W, V]`` log-probs per step
and ``W * k`` numbers on the host; hypotheses keep a reference to that step's record (no
per-token dicts until the output is built)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["StepTop", "TokenLogprob", "step_top"]

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

"""Selection policies over one prompt's scored candidates, and scoring generated candidates
with a reward model or a Python callable (a verifier)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchgen.checks import ValidationError

POLICIES = "best, threshold:X (X a number), pairs or top:k (k an int >= 1)"


@dataclass(frozen=True)
class Select:
    """A parsed policy: `kind` in best/threshold/pairs/top and its argument."""
    kind: str
    arg: float = 0.0

    def __call__(self, scores: Sequence[float]) -> dict[str, Any]:
        """The selection for one row: indices of the kept candidates ("chosen"), and for
        pairs also "rejected". Ties go to the lower index."""
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        if not order:
            return {"chosen": []}
        if self.kind == "best":
            return {"chosen": order[:1]}
        if self.kind == "top":
            return {"chosen": order[:int(self.arg)]}
        if self.kind == "threshold":
            return {"chosen": [i for i in range(len(scores)) if scores[i] >= self.arg]}
        pair = len(order) >= 2 and scores[order[0]] > scores[order[-1]]
        return {"chosen": order[:1] if pair else [], "rejected": order[-1:] if pair else []}


def parse_select(policy: object) -> Select:
    """"best", "threshold:X", "pairs" or "top:k" → Select, else a ValidationError naming
    `select` and the allowed values."""
    def bad() -> ValidationError:
        return ValidationError(f"select must be one of {POLICIES}, got {policy!r}",
                               parameter="select", value=policy)
    if not isinstance(policy, str):
        raise bad()
    kind, _, arg = policy.partition(":")
    if kind in ("best", "pairs") and not arg:
        return Select(kind)
    if kind == "threshold":
        try:
            value = float(arg)
        except ValueError:
            raise bad() from None
        if math.isfinite(value):
            return Select(kind, value)
    if kind == "top" and arg.isdigit() and int(arg) >= 1:
        return Select(kind, int(arg))
    raise bad()


def score_outputs(outputs: Sequence[Any], scorer: Any) -> list[list[float]]:
    """Each RequestOutput's candidates scored: `scorer` a RewardModel (prompt + candidate
    text, the reward's first label, all candidates in one call so they share the prompt's
    blocks) or a callable (prompt, text) -> float."""
    texts = [(o.prompt or "", c.text) for o in outputs for c in o.outputs]
    if hasattr(scorer, "reward"):
        flat = [r.outputs.probs[0] for r in scorer.reward([p + t for p, t in texts])]
    elif callable(scorer):
        flat = [float(_call(scorer, p, t)) for p, t in texts]
    else:
        raise ValidationError("score must be a reward model or a callable (prompt, text) -> "
                              f"float, got {type(scorer).__name__}", parameter="score",
                              value=type(scorer).__name__)
    out, i = [], 0
    for o in outputs:
        out.append(flat[i:i + len(o.outputs)])
        i += len(o.outputs)
    return out


def _call(fn: Callable[[str, str], float], prompt: str, text: str) -> float:
    return fn(prompt, text)

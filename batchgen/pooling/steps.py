"""Process reward model step scores for a prompt + response (Qwen2.5-Math-PRM's way): the
response split into steps, the step tag after each, the head read at the tags (the softmax
probability of the last label, "good step"), and the steps' scores reduced to one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchgen.checks import ValidationError, check_choice, check_type
from batchgen.pooling.params import PoolingParams

PRM_AGGREGATES = ("min", "last", "mean", "prod")
DEFAULT_STEP_TAG = "<extra_0>"  # Qwen2.5-Math-PRM's step tag
DEFAULT_SEPARATOR = "\n\n"


def label_score(values: Sequence[float]) -> float:
    """One label: the raw value; several: the softmax probability of the last label."""
    if len(values) == 1:
        return float(values[0])
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return exps[-1] / sum(exps)


@dataclass(frozen=True)
class StepScoring:
    """How a PRM scores a response: `separator` splits it into steps, `tag` (one token of the
    PRM's tokenizer) follows each step, `aggregate` (min, last, mean or prod) reduces the
    step scores to the candidate's score."""

    tag: str = DEFAULT_STEP_TAG
    aggregate: str = "min"
    separator: str = DEFAULT_SEPARATOR

    def __post_init__(self) -> None:
        check_type(self.tag, "prm_step_tag", str)
        check_choice(self.aggregate, "prm_aggregate", PRM_AGGREGATES)
        check_type(self.separator, "prm_step_separator", str)
        if not self.separator:
            raise ValidationError("prm_step_separator must be a non-empty string, got ''",
                                  parameter="prm_step_separator", value=self.separator)

    def tag_id(self, tokenizer: Any) -> int:
        """The tag's token id, or a ValidationError when the tokenizer makes it more (or
        fewer) than one token."""
        ids = tokenizer(self.tag, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValidationError(
                f"prm_step_tag must be one token of the process reward model's tokenizer "
                f"(Qwen2.5-Math-PRM's is {DEFAULT_STEP_TAG!r}), got {self.tag!r} = {len(ids)} "
                "tokens", parameter="prm_step_tag", value=self.tag)
        return int(ids[0])

    def steps(self, response: str) -> list[str]:
        """The response's steps (empty pieces dropped; an empty response is one empty step)."""
        return [s for s in response.split(self.separator) if s.strip()] or [""]

    def text(self, prompt: str, response: str) -> str:
        """What the PRM reads: the prompt, then each step followed by the tag."""
        return prompt + "".join(s + self.tag for s in self.steps(response))

    def score_steps(self, heads: Any, pairs: Sequence[tuple[str, str]]) -> list[list[float]]:
        """Each (prompt, response)'s step scores from `heads` (a RewardModel over a
        `*ForTokenClassification` model): the head's rows at the response's tags, computed
        from its first tag on (the prompt before it may be a prefix-cache hit)."""
        from batchgen.prompts import TokensPrompt

        tokenizer = heads.llm.get_tokenizer()
        tag_id = self.tag_id(tokenizer)
        ids = [tokenizer(self.text(p, r))["input_ids"] for p, r in pairs]
        counts = [len(self.steps(r)) for _, r in pairs]
        tags = [[i for i, t in enumerate(row) if t == tag_id] for row in ids]
        for k, at in zip(counts, tags):
            if len(at) < k:
                raise ValidationError(
                    f"prm_step_tag {self.tag!r} merged with the text around it ({len(at)} "
                    f"tags read for {k} steps): use a special token of the PRM's tokenizer",
                    parameter="prm_step_tag", value=self.tag)
        outs = heads.token_classify([TokensPrompt(prompt_token_ids=row) for row in ids],
                                    PoolingParams(step_tag_id=tag_id),
                                    starts=[at[-k] for k, at in zip(counts, tags)])
        return [[label_score(r) for r in out.outputs.data.tolist()[-k:]]  # a tag in the
                for k, out in zip(counts, outs)]  # prompt: no step

    def reduce(self, steps: Sequence[float]) -> float:
        """The candidate's score from its steps' scores."""
        if self.aggregate == "min":
            return min(steps)
        if self.aggregate == "last":
            return steps[-1]
        if self.aggregate == "mean":
            return sum(steps) / len(steps)
        return math.prod(steps)

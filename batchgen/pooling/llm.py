"""`PoolingLLM`: vLLM's pooling runner as an `LLM` (`LLM(model, runner="pooling")`, or
`runner="auto"` on a `*ForSequenceClassification` / `*ForTokenClassification` folder through
`vllm_compat`): `reward`, `classify`, `score` and `encode` on the paged engine, the calls of
`RewardModel` with this LLM as their engine."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchgen.checks import ValidationError, check_choice
from batchgen.llm import LLM
from batchgen.pooling.heads import as_causal_lm
from batchgen.pooling.outputs import (
    ClassificationRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from batchgen.pooling.params import PoolingParams, resolve_runner
from batchgen.pooling.scorer import RewardModel, load_head_model

ENCODE_TASKS = ("classify", "token_classify")


def wants_pooling(model: Any, runner: object = "auto") -> bool:
    """Whether `LLM(model, runner=...)` is the pooling runner: "pooling" itself, or "auto" on
    a local folder whose config names only pooling architectures (read from config.json,
    before any weight)."""
    if runner == "pooling":
        return True
    if runner != "auto" or not isinstance(model, (str, os.PathLike)):
        return False
    config = Path(model) / "config.json"
    if not config.is_file():
        return False
    archs = json.loads(config.read_text()).get("architectures") or []
    return resolve_runner("auto", archs) == "pooling"


class PoolingLLM(LLM):
    """An `LLM` over a reward model (`*ForSequenceClassification`) or a process reward model
    (`*ForTokenClassification`): vLLM's pooling calls; `engine_args` as `LLM`'s."""

    def __init__(self, model: str | os.PathLike, *, runner: str = "pooling",
                 tokenizer: str | os.PathLike | None = None, **engine_args: Any) -> None:
        hf = load_head_model(model, runner)
        super().__init__(as_causal_lm(hf), tokenizer=tokenizer or str(model),
                         logprobs_mode="raw_logits", **engine_args)
        self.scores = RewardModel.over(hf, self)

    def reward(self, prompts: Any, pooling_params: PoolingParams | None = None
               ) -> list[ClassificationRequestOutput]:
        """The raw reward of each prompt (no activation unless `use_activation=True`)."""
        return self.scores.reward(prompts, pooling_params)

    def classify(self, prompts: Any, pooling_params: PoolingParams | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's head outputs at its last token."""
        return self.scores.classify(prompts, pooling_params)

    def score(self, queries: str | Sequence[str], documents: str | Sequence[str],
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Cross-encoder scores of (query, document) pairs."""
        return self.scores.score(queries, documents, pooling_params)

    def encode(self, prompts: Any, pooling_params: PoolingParams | None = None,
               pooling_task: str = "token_classify"
               ) -> list[PoolingRequestOutput] | list[ClassificationRequestOutput]:
        """vLLM's `encode`: per-token head rows ("token_classify", a process reward model's
        step scores) or the last token's ("classify")."""
        check_choice(pooling_task, "pooling_task", ENCODE_TASKS)
        if pooling_task == "classify":
            return self.scores.classify(prompts, pooling_params)
        return self.scores.token_classify(prompts, pooling_params)

    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None) -> Any:
        """Not served yet: embedding models are not run on the engine."""
        raise ValidationError("embed: embedding models are not served by batchgen yet "
                              "(reward and process reward models are: reward, classify, "
                              "score, encode)", parameter="embed", value=None)

"""`PoolingLLM`: vLLM's pooling runner as an `LLM` (`LLM(model, runner="pooling")`, or
`runner="auto"` on a `*ForSequenceClassification` / `*ForTokenClassification` / bare `*Model`
folder, through `batchgen.LLM` or `vllm_compat`): `embed`, `reward`, `classify`, `score` and `encode` on the
paged engine. A head model's calls are `RewardModel`'s with this LLM as their engine; an
embedding model's are `Embedder`'s (batchgen.pooling.embedder); a causal LM named with
vLLM's `hf_overrides={"classifier_from_token": [...]}` is a yes/no-logit reranker
(batchgen.pooling.rerank)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from batchgen.checks import ValidationError, check_choice
from batchgen.llm import LLM
from batchgen.pooling.embed import as_embedding_lm, load_embedding_model, pooling_type
from batchgen.pooling.embedder import Embedder
from batchgen.pooling.heads import as_causal_lm
from batchgen.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from batchgen.pooling.params import PoolingParams
from batchgen.pooling.rerank import load_token_reranker
from batchgen.pooling.scorer import RewardModel, load_head_model
from batchgen.runners import folder_architectures, register_runner, resolve_runner, wants_pooling

ENCODE_TASKS = ("embed", "classify", "token_classify")
HEAD_KINDS = ("SequenceClassification", "TokenClassification")
__all__ = ["ENCODE_TASKS", "PoolingLLM", "wants_pooling"]


class PoolingLLM(LLM):
    """An `LLM` over a reward model (`*ForSequenceClassification`), a process reward model
    (`*ForTokenClassification`), an embedding model (a bare `*Model`, or any causal LM's
    folder under runner="pooling": its backbone, pooled as `pooler_config` or the folder's
    sentence-transformers files say, else last token) or a yes/no-logit reranker (a causal LM
    with `hf_overrides={"architectures": [...ForSequenceClassification], "classifier_from_token":
    ["no", "yes"], "is_original_qwen3_reranker": True}`): vLLM's pooling calls; `engine_args`
    as `LLM`'s. Registered as the "pooling" runner: `batchgen.LLM(model, runner="pooling")`
    (or "auto" on a pooling folder) builds one."""

    runner_kind = "pooling"

    def __init__(self, model: str | os.PathLike, *, runner: str = "pooling",
                 tokenizer: str | os.PathLike | None = None, pooler_config: Any = None,
                 hf_overrides: dict[str, Any] | None = None, **engine_args: Any) -> None:
        tok = tokenizer or str(model)
        archs = folder_architectures(model) or []
        self.scores: RewardModel | None = None
        self.embedder: Embedder | None = None
        if hf_overrides is not None:
            hf = load_token_reranker(model, tok, hf_overrides)
        elif any(a.endswith("For" + k) for a in archs for k in HEAD_KINDS):
            hf = load_head_model(model, runner)
        else:
            check_choice(runner, "runner", ("pooling", "auto"))
            if resolve_runner(runner, archs) != "pooling":
                load_head_model(model, runner)  # refused: a generator under runner="auto"
            kind = pooling_type(model, pooler_config)
            base = load_embedding_model(model)
            hidden = int(base.config.hidden_size)
            engine_args["max_logprobs"] = max(hidden, engine_args.get("max_logprobs", 20))
            super().__init__(as_embedding_lm(base), tokenizer=tok, logprobs_mode="raw_logits",
                             **engine_args)
            self.embedder = Embedder(self, hidden, kind)
            return
        if pooler_config is not None:
            raise ValidationError("pooler_config must be None for a classification, reward or "
                                  "reranker model (it sets an embedding model's pooling), got "
                                  f"{pooler_config!r}", parameter="pooler_config",
                                  value=pooler_config)
        super().__init__(as_causal_lm(hf), tokenizer=tok, logprobs_mode="raw_logits",
                         **engine_args)
        self.scores = RewardModel.over(hf, self)

    def _heads(self, call: str) -> RewardModel:
        """The head model's calls, or a ValidationError: an embedding model has no head."""
        if self.scores is None:
            raise ValidationError(f"{call} needs a classification, reward or reranker model "
                                  "(this PoolingLLM serves an embedding model: embed, "
                                  "score, encode(pooling_task='embed'))", parameter=call,
                                  value=None)
        return self.scores

    def _embeds(self) -> Embedder:
        """The embedding model's calls, or a ValidationError naming what is served."""
        if self.embedder is None:
            raise ValidationError("embed needs an embedding model (this PoolingLLM serves a "
                                  "classification/reward model: reward, classify, score, "
                                  "encode)", parameter="embed", value=None)
        return self.embedder

    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (pooled, Matryoshka `dimensions`, L2-normalized unless
        `normalize=False`): `outputs.embedding`."""
        return self._embeds().embed(prompts, pooling_params)

    def reward(self, prompts: Any, pooling_params: PoolingParams | None = None
               ) -> list[ClassificationRequestOutput]:
        """The raw reward of each prompt (no activation unless `use_activation=True`)."""
        return self._heads("reward").reward(prompts, pooling_params)

    def classify(self, prompts: Any, pooling_params: PoolingParams | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's head outputs at its last token."""
        return self._heads("classify").classify(prompts, pooling_params)

    def score(self, queries: str | Sequence[str], documents: str | Sequence[str],
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `score`: a cross-encoder's or reranker's score of each (query, document)
        pair (its activation unless `use_activation=False`), or an embedding model's cosine
        similarity."""
        if self.embedder is not None:
            return self.embedder.score(queries, documents, pooling_params)
        return self._heads("score").score(queries, documents, pooling_params)

    def encode(self, prompts: Any, pooling_params: PoolingParams | None = None,
               pooling_task: str = "token_classify"
               ) -> list[PoolingRequestOutput] | list[ClassificationRequestOutput]:
        """vLLM's `encode`: per-token head rows ("token_classify", a process reward model's
        step scores), the last token's ("classify") or an embedding ("embed": `outputs.data`
        the pooled tensor)."""
        check_choice(pooling_task, "pooling_task", ENCODE_TASKS)
        if pooling_task == "embed":
            return self._embeds().encode(prompts, pooling_params)
        if pooling_task == "classify":
            return self._heads("encode").classify(prompts, pooling_params)
        return self._heads("encode").token_classify(prompts, pooling_params)


register_runner("pooling", PoolingLLM)

"""`RewardModel`: a sequence-classification reward model served by batchgen's paged engine
(`reward`, `classify`, `score`), with vLLM's pooling outputs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from batchgen.checks import ValidationError, check_type
from batchgen.pooling.embedder import pair_lists
from batchgen.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from batchgen.pooling.params import PoolingParams, resolve_runner
from batchgen.pooling.poolers import pool


def load_head_model(path: str | os.PathLike, runner: str = "auto") -> Any:
    """The folder's `*ForSequenceClassification` model (float32 on the CPU), refused before
    its weights load when its architecture is not a pooling one under runner="auto", or
    under runner="generate"."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    archs = list(getattr(config, "architectures", None) or [])
    kind = next((k for k in ("SequenceClassification", "TokenClassification")
                 if any(a.endswith("For" + k) for a in archs)), None)
    if resolve_runner(runner, archs) != "pooling" or kind is None:
        raise ValidationError(
            "model must be a sequence-classification (reward) model or a token-classification "
            f"(process reward) model for the pooling runner, got architectures {archs} with "
            f"runner={runner!r}", parameter="model", value=archs)
    auto = getattr(transformers, "AutoModelFor" + kind)
    return auto.from_pretrained(path, dtype="float32")


class RewardModel:
    """A reward/classifier model on the paged engine. `engine_args` go to `LLM` (block_size,
    max_num_batched_tokens, enable_prefix_caching, num_kv_blocks, ...)."""

    def __init__(self, model: str | os.PathLike, runner: str = "auto", **engine_args: Any):
        from batchgen.llm import LLM
        from batchgen.pooling.heads import as_causal_lm

        hf = load_head_model(model, runner)
        self._bind(hf, LLM(as_causal_lm(hf), tokenizer=str(model), logprobs_mode="raw_logits",
                           **engine_args))

    @classmethod
    def over(cls, hf: Any, llm: Any) -> RewardModel:
        """The calls over an `LLM` already built on `as_causal_lm(hf)` (PoolingLLM's)."""
        scores = cls.__new__(cls)
        scores._bind(hf, llm)
        return scores

    def _bind(self, hf: Any, llm: Any) -> None:
        self.num_labels = hf.score.out_features
        self.token_level = type(hf).__name__.endswith("ForTokenClassification")
        self.llm = llm

    def classify(self, prompts: Any, pooling_params: PoolingParams | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's head outputs at its last token: raw unless `use_activation=True`."""
        import torch

        from batchgen.params import SamplingParams

        params = pooling_params or PoolingParams()
        check_type(params, "pooling_params", PoolingParams)
        sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.num_labels,
                            truncate_prompt_tokens=params.truncate_prompt_tokens)
        outs = self.llm.generate(prompts, sp)
        result = []
        for out in outs:
            top = out.outputs[0].logprobs[0]
            row = torch.tensor([[top[i].logprob for i in range(self.num_labels)]])
            vals = pool("classify", row, params)
            result.append(ClassificationRequestOutput(
                str(out.request_id), ClassificationOutput(vals.tolist()),
                list(out.prompt_token_ids)))
        return result

    def token_classify(self, prompts: Any, pooling_params: PoolingParams | None = None,
                       starts: Sequence[int] | None = None) -> list[PoolingRequestOutput]:
        """A process reward model's per-token head outputs [T, L] (under `step_tag_id`, only
        the step-tag positions): position i's from the prompt logprobs of token i + 1 (raw
        logits), the last position's from the first sampled token's. `starts` (one per
        prompt): the first position each needs; the rows before it are NaN and its tokens
        before it may be prefix-cache hits (candidates of one prompt compute it once)."""
        import torch

        from batchgen.params import SamplingParams

        params = pooling_params or PoolingParams()
        check_type(params, "pooling_params", PoolingParams)
        labels = range(self.num_labels)
        sps = [SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.num_labels,
                              prompt_logprobs=self.num_labels, prompt_logprobs_start=s + 1,
                              truncate_prompt_tokens=params.truncate_prompt_tokens)
               for s in (starts if starts is not None else [0])]
        nan = [float("nan")] * self.num_labels
        result = []
        for out in self.llm.generate(prompts, sps if starts is not None else sps[0]):
            rows = [nan if d is None else [d[i].logprob for i in labels]
                    for d in out.prompt_logprobs[1:]]
            rows.append([out.outputs[0].logprobs[0][i].logprob for i in labels])
            ids = list(out.prompt_token_ids)
            data = pool("token_classify", torch.tensor(rows), params, ids)
            result.append(PoolingRequestOutput(str(out.request_id), PoolingOutput(data), ids))
        return result

    def reward(self, prompts: Any, pooling_params: PoolingParams | None = None
               ) -> list[ClassificationRequestOutput]:
        """vLLM's `reward` for a sequence-classification reward model: the raw reward."""
        return self.classify(prompts, pooling_params)

    def score(self, queries: str | Sequence[str], documents: str | Sequence[str],
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `score` for a cross-encoder or reranker: each text pair joined as one prompt
        (query + document), the first label's output after the head's activation (sigmoid
        for one label, as vLLM's score applies by default; raw under `use_activation=False`)."""
        params = pooling_params or PoolingParams()
        check_type(params, "pooling_params", PoolingParams)
        if params.use_activation is None:
            params = replace(params, use_activation=True)
        qs, ds = pair_lists(queries, documents)
        outs = self.classify([q + d for q, d in zip(qs, ds)], params)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]),
                                     o.prompt_token_ids) for o in outs]

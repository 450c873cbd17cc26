"""`Embedder`: an embedding model's calls (`embed`, `encode(pooling_task="embed")`, `score`
as cosine similarity) over an LLM built on `as_embedding_lm` (batchgen.pooling.embed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from batchgen.checks import ValidationError, check_type
from batchgen.pooling.embed import hidden_rows
from batchgen.pooling.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from batchgen.pooling.params import PoolingParams
from batchgen.pooling.poolers import pool


def pair_lists(queries: str | Sequence[str], documents: str | Sequence[str]
               ) -> tuple[list[str], list[str]]:
    """vLLM's `score` pairing: one query for every document, or as many queries as
    documents; else a ValidationError naming `queries`."""
    qs = [queries] if isinstance(queries, str) else list(queries)
    ds = [documents] if isinstance(documents, str) else list(documents)
    if len(qs) == 1:
        qs = qs * len(ds)
    if len(qs) != len(ds):
        raise ValidationError(f"queries must be one text or as many as documents ({len(ds)}),"
                              f" got {len(qs)}", parameter="queries", value=len(qs))
    return qs, ds


class Embedder:
    """Pooled hidden states of each prompt, read from the engine (`llm`, on an
    `as_embedding_lm` model with `logprobs_mode="raw_logits"` and `max_logprobs >= hidden`).
    `kind`: "LAST", "MEAN" or "CLS" pooling."""

    def __init__(self, llm: Any, hidden: int, kind: str) -> None:
        self.llm, self.hidden, self.kind = llm, hidden, kind

    def _pooled(self, prompts: Any, params: PoolingParams | None
                ) -> tuple[list[torch.Tensor], list[Any]]:
        """Each prompt's pooled vector (`params` applied) and its RequestOutput."""
        from batchgen.params import SamplingParams

        params = params or PoolingParams()
        check_type(params, "pooling_params", PoolingParams)
        dims = params.dimensions
        if dims is not None and dims > self.hidden:
            raise ValidationError(f"dimensions must be at most the model's hidden size "
                                  f"({self.hidden}), got {dims}", parameter="dimensions",
                                  value=dims)
        every = self.kind != "LAST"
        sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.hidden,
                            truncate_prompt_tokens=params.truncate_prompt_tokens,
                            flat_logprobs=True, detokenize=False)
        if every:  # every prompt position's row: named prompt ids, one array per request
            prompts, sp = self._every_position(prompts, sp)
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        vecs = []
        for out in outs:
            rows = hidden_rows(out, self.hidden, every)
            if self.kind == "CLS":
                rows = rows[:1]
            vecs.append(pool("embed", rows, params, method="mean" if self.kind == "MEAN"
                             else "last"))
        return vecs, outs

    def _every_position(self, prompts: Any, sp: Any) -> tuple[list[Any], list[Any]]:
        """Token-id prompts (tokenized and truncated as `generate` would) and, per prompt,
        params naming the H hidden columns at every scored prompt row
        (`prompt_logprob_token_ids`: the raw rows come back as one float32 array)."""
        import numpy as np

        from batchgen.prompts import TokensPrompt

        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        texts = [p if isinstance(p, str) else p.get("prompt") for p in items]
        todo = [i for i, p in enumerate(items) if isinstance(p, str)
                or "prompt_token_ids" not in p]
        enc = self.llm.get_tokenizer()([texts[i] for i in todo])["input_ids"] if todo else []
        ids = [None if i in todo else list(p["prompt_token_ids"]) for i, p in enumerate(items)]
        for i, e in zip(todo, enc):
            ids[i] = list(e)
        k, limit = sp.truncate_prompt_tokens, self.llm.requests.limits.max_model_len
        cols = np.arange(self.hidden, dtype=np.int32)
        out_prompts, out_params = [], []
        for tok in ids:
            tok = tok if k is None else tok[-(limit - 1 if k == -1 else k):]
            out_prompts.append(TokensPrompt(prompt_token_ids=tok))
            table = np.broadcast_to(cols, (len(tok) - 1, self.hidden)) if len(tok) > 1 else None
            out_params.append(replace(sp, truncate_prompt_tokens=None,
                                      prompt_logprob_token_ids=table))
        return out_prompts, out_params

    def embed(self, prompts: Any, params: PoolingParams | None = None
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's `embed`: `outputs.embedding`, a list of floats per prompt."""
        vecs, outs = self._pooled(prompts, params)
        return [EmbeddingRequestOutput(str(o.request_id), EmbeddingOutput(v.tolist()),
                                       list(o.prompt_token_ids)) for v, o in zip(vecs, outs)]

    def encode(self, prompts: Any, params: PoolingParams | None = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's `encode(pooling_task="embed")`: `outputs.data`, the pooled tensor."""
        vecs, outs = self._pooled(prompts, params)
        return [PoolingRequestOutput(str(o.request_id), PoolingOutput(v),
                                     list(o.prompt_token_ids)) for v, o in zip(vecs, outs)]

    def score(self, queries: str | Sequence[str], documents: str | Sequence[str],
              params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `score` for an embedding model: the cosine similarity of each (query,
        document) pair's embeddings (every distinct text embedded once)."""
        qs, ds = pair_lists(queries, documents)
        texts = list(dict.fromkeys(qs + ds))
        vecs, outs = self._pooled(texts, params)
        at = {t: i for i, t in enumerate(texts)}
        result = []
        for k, (q, d) in enumerate(zip(qs, ds)):
            a, b = at[q], at[d]
            cos = torch.nn.functional.cosine_similarity(vecs[a], vecs[b], dim=0)
            result.append(ScoringRequestOutput(
                str(k), ScoringOutput(float(cos)),
                list(outs[a].prompt_token_ids) + list(outs[b].prompt_token_ids)))
        return result

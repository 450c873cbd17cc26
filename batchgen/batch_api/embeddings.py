"""OpenAI's `/v1/embeddings` lines in a batch file, served by an embedding model's
`PoolingLLM.embed` (batchgen.pooling): each line's `input` (a string, a list of strings, a
list of token ids or a list of those) becomes one embedding each, answered as OpenAI's
embeddings response (`object: "list"`, `data: [{object: "embedding", index, embedding}]`,
`usage`)."""

from __future__ import annotations

import time
from typing import Any

from batchgen.batch_api.requests import EMBEDDINGS_URL, BatchRequest, LineError

_FIELDS = ("input", "model", "encoding_format", "dimensions", "user")


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def embedding_inputs(body: dict[str, Any]) -> list[Any]:
    """The body's inputs as prompts (texts, or {"prompt_token_ids"}), or a LineError naming
    the field."""
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise LineError("invalid_request", f"unsupported body field(s) for {EMBEDDINGS_URL}: "
                        f"{', '.join(unknown)}", unknown[0])
    if body.get("encoding_format", "float") != "float":
        raise LineError("invalid_request", "encoding_format must be 'float', got "
                        f"{body.get('encoding_format')!r}", "encoding_format")
    x = body.get("input")
    items = [x] if isinstance(x, str) or _is_ids(x) else x
    if not isinstance(items, list) or not items or not all(
            (isinstance(i, str) and i) or _is_ids(i) for i in items):
        raise LineError("invalid_request", "input must be a non-empty string, a list of them, "
                        "a list of token ids or a list of those", "input")
    return [i if isinstance(i, str) else {"prompt_token_ids": i} for i in items]


def render_embedding(llm: Any, req: BatchRequest) -> None:
    """Check an embeddings line (LineError): an embedding model serves it, its fields are
    OpenAI's, `dimensions` within the model's; sets the line's prompts and PoolingParams."""
    from batchgen.pooling.params import PoolingParams

    embedder = getattr(llm, "embedder", None)
    if embedder is None:
        raise LineError("invalid_url", f"{EMBEDDINGS_URL} needs an embedding model "
                        "(this model is not one)", "url")
    req.prompt = embedding_inputs(req.body)
    dims = req.body.get("dimensions")
    try:
        req.extra["pooling"] = PoolingParams(dimensions=dims)
    except ValueError as e:
        raise LineError("invalid_request", str(e), "dimensions") from e
    if dims is not None and dims > embedder.hidden:
        raise LineError("invalid_request", f"dimensions must be at most {embedder.hidden}, "
                        f"got {dims}", "dimensions")


def embedding_answers(llm: Any, reqs: list[BatchRequest], model: str
                      ) -> list[dict[str, Any]]:
    """Embed every line's inputs (one `embed` call per distinct PoolingParams, so lines batch
    together): each line's OpenAI embeddings response body, in order."""
    groups: dict[Any, list[BatchRequest]] = {}
    for r in reqs:
        groups.setdefault(r.extra["pooling"], []).append(r)
    bodies: dict[int, dict[str, Any]] = {}
    for params, group in groups.items():
        outs = llm.embed([p for r in group for p in r.prompt], params)
        at = 0
        for r in group:
            mine, at = outs[at:at + len(r.prompt)], at + len(r.prompt)
            used = sum(len(o.prompt_token_ids) for o in mine)
            bodies[id(r)] = {"object": "list", "model": model, "created": int(time.time()),
                             "data": [{"object": "embedding", "index": i,
                                       "embedding": o.outputs.embedding}
                                      for i, o in enumerate(mine)],
                             "usage": {"prompt_tokens": used, "total_tokens": used}}
    return [bodies[id(r)] for r in reqs]

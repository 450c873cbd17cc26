"""Output lines of a batch file, shaped as the OpenAI Batch API's: `{id, custom_id, response:
{status_code, request_id, body}, error}`, the body a `chat.completion` or `text_completion`."""

from __future__ import annotations

import time
import uuid
from typing import Any

from batchgen.batch_api.requests import BatchRequest, LineError
from batchgen.outputs import CompletionOutput, RequestOutput, TokenLogprobs


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def answer_line(req: BatchRequest, out: RequestOutput, model: str) -> dict[str, Any]:
    """The output line of a served request (status 200)."""
    body = chat_body(req, out, model) if req.is_chat else completion_body(req, out, model)
    return {"id": _new_id("batch_req"), "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": _new_id("req"), "body": body},
            "error": None}


def embedding_line(req: BatchRequest, body: dict[str, Any]) -> dict[str, Any]:
    """The output line of a served /v1/embeddings request (status 200)."""
    return {"id": _new_id("batch_req"), "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": _new_id("req"), "body": body},
            "error": None}


def error_line(custom_id: str | None, err: LineError) -> dict[str, Any]:
    """The output line of a line that could not be served: a top-level `error` {code,
    message}, and the 400 response the API would have given (none for a line that is not
    JSON: there was no request)."""
    response = None
    if err.code != "invalid_json":
        response = {"status_code": 400, "request_id": _new_id("req"), "body": {"error": {
            "message": err.message, "type": "invalid_request_error", "param": err.param,
            "code": err.code}}}
    return {"id": _new_id("batch_req"), "custom_id": custom_id, "response": response,
            "error": {"code": err.code, "message": err.message}}


def _usage(out: RequestOutput) -> dict[str, int]:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def chat_body(req: BatchRequest, out: RequestOutput, model: str) -> dict[str, Any]:
    """A `chat.completion` object: one choice per sample."""
    k = req.extra.get("top_logprobs", 0)
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text,
                                              "refusal": None},
                "logprobs": None if c.logprobs is None else {
                    "content": [_chat_token(c, i, k) for i in range(len(c.logprobs))],
                    "refusal": None},
                "finish_reason": c.finish_reason} for c in out.outputs]
    return {"id": _new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(out)}


def _chat_token(c: CompletionOutput, i: int, k: int) -> dict[str, Any]:
    """One generated token's entry in chat logprobs: its text, logprob, bytes, top k."""
    token = c.token_ids[i]
    entry = c.logprobs[i]  # type: ignore[index]
    chosen = entry[token]
    return {**_token(chosen.decoded_token, chosen.logprob),
            "top_logprobs": [_token(lp.decoded_token, lp.logprob) for _, lp in _top(entry, k)]}


def _token(text: str | None, logprob: float) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, Any]]:
    """The k most likely tokens of a position, by rank."""
    return sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:k]


def completion_body(req: BatchRequest, out: RequestOutput, model: str) -> dict[str, Any]:
    """A `text_completion` object: one choice per sample (the prompt first with `echo`)."""
    echo = out.prompt or "" if req.body.get("echo") else ""
    choices = [{"index": c.index, "text": echo + c.text,
                "logprobs": None if c.logprobs is None else _completion_logprobs(
                    c, req.extra.get("top_logprobs", 0), len(echo)),
                "finish_reason": c.finish_reason} for c in out.outputs]
    return {"id": _new_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(out)}


def _completion_logprobs(c: CompletionOutput, k: int, offset: int) -> dict[str, Any]:
    """The legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for token, entry in zip(c.token_ids, c.logprobs or []):
        text = entry[token].decoded_token or ""
        tokens.append(text)
        lps.append(entry[token].logprob)
        tops.append({lp.decoded_token or "": lp.logprob for _, lp in _top(entry, k)} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}

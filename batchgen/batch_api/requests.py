"""One line of an OpenAI Batch API file -> a batchgen request (prompt and SamplingParams), or
the error that line gets in the output (a line that cannot be served never stops the others)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from batchgen.params import SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"  # served by an embedding model (batch_api/embeddings.py)
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)

# Body fields that map one to one onto SamplingParams (OpenAI's, then vLLM's extras).
_SAME_NAME = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "stop",
              "seed", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
              "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
              "bad_words")
# Accepted and not used: bookkeeping fields a hosted API takes that change no output.
_IGNORED = ("model", "user", "metadata", "store", "service_tier", "stream", "stream_options",
            "parallel_tool_calls")
_CHAT_FIELDS = ("messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                "logit_bias", "chat_template_kwargs")
_COMPLETION_FIELDS = ("prompt", "max_tokens", "logprobs", "echo", "logit_bias", "best_of")
_PARTS = ("text", "image_url")  # chat content parts (image_url: a VLM's images)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class LineError(Exception):
    """Why one line cannot be served: `code` (OpenAI-style) and a one-line message."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass
class BatchRequest:
    """A servable line: its custom_id, url, body, and (once rendered) its prompt and params."""

    line: int  # its output line (0-based; blank input lines have none)
    custom_id: str
    url: str
    body: dict[str, Any]
    prompt: Any = None  # a TokensPrompt once rendered
    params: SamplingParams | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # echo, top_logprobs: for the answer

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL


def parse_line(text: str, number: int) -> BatchRequest:
    """Check the envelope of input line `number` (1-based: for messages): a JSON object with
    custom_id, method, url and body; LineError if bad."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError("invalid_json", f"line {number} is not JSON: {e.msg}") from e
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"line {number} must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError("invalid_request", "custom_id must be a non-empty string", "custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError("invalid_request", f"method must be 'POST', got {method!r}", "method")
    url = obj.get("url")
    if url not in URLS:
        raise LineError("invalid_url", f"url must be one of {URLS}, got {url!r}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be a JSON object", "body")
    return BatchRequest(number - 1, cid, url, body)


def custom_id_of(text: str) -> str | None:
    """The custom_id of a line, if it is JSON with a string one (for error lines)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None


def sampling_params(req: BatchRequest, defaults: dict[str, Any]) -> SamplingParams:
    """The body's sampling fields as SamplingParams over `defaults` (the model's
    generation_config); LineError naming the field when one is unknown or out of range."""
    body, chat = req.body, req.is_chat
    known = set(_SAME_NAME) | set(_IGNORED) | set(_CHAT_FIELDS if chat else _COMPLETION_FIELDS)
    unknown = sorted(set(body) - known)
    if unknown:
        raise LineError("invalid_request", f"unsupported body field(s) for {req.url}: "
                        f"{', '.join(unknown)}", unknown[0])
    if body.get("stream"):
        raise LineError("invalid_request", "stream must be false in a batch file", "stream")
    kw = dict(defaults)
    kw.update({k: body[k] for k in _SAME_NAME if body.get(k) is not None})
    kw["max_tokens"] = _max_tokens(body, chat)
    kw["logprobs"] = _logprobs(req)
    if body.get("logit_bias") is not None:
        kw["logit_bias"] = _logit_bias(body["logit_bias"])
    if not chat and body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise LineError("invalid_request", "best_of must equal n (or be 1): batchgen returns "
                        "every sample it draws", "best_of")
    if not chat and body.get("echo") and body.get("logprobs") is not None:
        raise LineError("invalid_request", "echo with logprobs is not supported (prompt "
                        "tokens are not scored)", "echo")
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        raise LineError("invalid_request", str(e), str(e).split(" ", 1)[0]) from e


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    """max_completion_tokens (chat's current name), else max_tokens; chat defaults to the
    room left in the context (None), completions to OpenAI's 16."""
    value = body.get("max_completion_tokens") if chat else None
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        return None if chat else COMPLETION_DEFAULT_MAX_TOKENS
    return value


def _logprobs(req: BatchRequest) -> int | None:
    """SamplingParams.logprobs: chat's `logprobs: true` + `top_logprobs: k`, or completions'
    `logprobs: k` (k alternatives besides the chosen token)."""
    body = req.body
    if req.is_chat:
        on, top = body.get("logprobs"), body.get("top_logprobs")
        if on not in (None, True, False):
            raise LineError("invalid_request", f"logprobs must be true or false, got {on!r}",
                            "logprobs")
        if top is not None and not on:
            raise LineError("invalid_request", "top_logprobs needs logprobs: true",
                            "top_logprobs")
        if top is not None and not (isinstance(top, int) and 0 <= top <= 20):
            raise LineError("invalid_request", f"top_logprobs must be an integer in [0, 20], "
                            f"got {top!r}", "top_logprobs")
        req.extra["top_logprobs"] = top or 0
        return (top or 0) if on else None
    k = body.get("logprobs")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise LineError("invalid_request", f"logprobs must be an integer >= 0, got {k!r}",
                        "logprobs")
    req.extra["top_logprobs"] = k or 0
    return k


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]} as {int: float}."""
    try:
        out = {int(k): float(v) for k, v in bias.items()}
    except (AttributeError, TypeError, ValueError) as e:
        raise LineError("invalid_request", "logit_bias must map token ids to numbers",
                        "logit_bias") from e
    if any(not -100 <= v <= 100 for v in out.values()):
        raise LineError("invalid_request", "logit_bias values must be in [-100, 100]",
                        "logit_bias")
    return out


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The body's messages: content parts all of type text joined into one string; image
    parts (image_url) kept as parts for the chat renderer (a VLM's images; other
    part types are refused)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise LineError("invalid_request", "messages must be a non-empty list of "
                        "{'role', 'content'} objects", "messages")
    out = []
    for m in msgs:
        if not isinstance(m.get("role"), str):
            raise LineError("invalid_request", "every message needs a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") in _PARTS for p in content):
                raise LineError("invalid_request", "content parts must be of type "
                                f"{', '.join(_PARTS)}", "messages")
            if all(p["type"] == "text" for p in content):
                content = "".join(str(p.get("text", "")) for p in content)
        out.append({**m, "content": content})
    return out


def completion_prompt(body: dict[str, Any]) -> Any:
    """The body's prompt: a string or a list of token ids (one prompt per line)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise LineError("invalid_request", "prompt must be a non-empty string or a list of token "
                    "ids (one prompt per line)", "prompt")


def file_images(body: dict[str, Any]) -> list[str]:
    """A SHA-256 of each local image file a chat body names (image_url parts with file://
    URLs), in order: a resume recomputes a line whose file changed under the same URL (an
    unreadable file counts as "missing"; the line's own check reports it)."""
    out = []
    msgs = body.get("messages")
    for m in msgs if isinstance(msgs, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        for p in content if isinstance(content, list) else []:
            url = p.get("image_url") if isinstance(p, dict) else None
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str) and url.startswith("file://"):
                try:
                    path = Path(unquote(urlparse(url).path))  # as multimodal/inputs.py reads it
                    out.append(hashlib.sha256(path.read_bytes()).hexdigest())
                except OSError:
                    out.append("missing")
    return out

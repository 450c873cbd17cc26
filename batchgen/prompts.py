"""The prompt forms `generate`, `beam_search` and `chat` take (vLLM's names)."""

from __future__ import annotations

from typing import Any, TypedDict, Union


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """A prompt given as token ids; `prompt` (optional) is its text, echoed in the output."""

    prompt_token_ids: list[int]
    prompt: str


PromptType = Union[str, TextPrompt, TokensPrompt]  # noqa: UP007 (a runtime alias for 3.10)
ChatMessage = dict[str, Any]  # {"role": ..., "content": ...}, as chat templates take them
Conversation = list[ChatMessage]

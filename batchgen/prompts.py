"""The prompt forms `generate`, `beam_search` and `chat` take (vLLM's names)."""

from __future__ import annotations

from typing import Any, TypedDict, Union


class TextPrompt(TypedDict, total=False):
    """A text prompt, tokenized by the model's tokenizer; with `multi_modal_data` (a
    vision-language model) by its processor, which expands each image's placeholder.

    multi_modal_data: {"image": image | [images]}, an image being a PIL image, a numpy or
    torch array, a local path, a file:// or a data: URL; multi_modal_uuids: {"image": key |
    [keys]}, the user's own cache keys for them; mm_processor_kwargs: keyword arguments for
    this prompt's processor call."""

    prompt: str
    multi_modal_data: dict[str, Any]
    multi_modal_uuids: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]


class TokensPrompt(TypedDict, total=False):
    """A prompt given as token ids; `prompt` (optional) is its text, echoed in the output."""

    prompt_token_ids: list[int]
    prompt: str


# Every key a prompt dict may hold: batchgen acts on each, so any other is refused by name.
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_uuids",
               "mm_processor_kwargs")
# The keys that only mean something beside multi_modal_data.
IMAGE_KEYS = ("multi_modal_uuids", "mm_processor_kwargs")

PromptType = Union[str, TextPrompt, TokensPrompt]  # noqa: UP007 (a runtime alias for 3.10)
ChatMessage = dict[str, Any]  # {"role": ..., "content": ...}, as chat templates take them
Conversation = list[ChatMessage]


def check_prompt_keys(prompt: dict[str, Any], name: str) -> None:
    """ValueError naming a key batchgen would not act on (a misspelt one, another engine's,
    image options without images, images with token ids)."""
    for key in prompt:
        if key not in PROMPT_KEYS:
            raise ValueError(f"{name} has the key {key!r}, which batchgen does not act on; "
                             f"a prompt dict takes {', '.join(PROMPT_KEYS)}")
    if prompt.get("multi_modal_data") is None:
        for key in IMAGE_KEYS:
            if prompt.get(key) is not None:
                raise ValueError(f"{name}[{key!r}] acts only beside 'multi_modal_data', which "
                                 "the prompt does not have")
    elif "prompt_token_ids" in prompt:
        raise ValueError(f"{name} has both 'prompt_token_ids' and 'multi_modal_data': images "
                         "need a text 'prompt' (the processor expands their placeholders)")

"""Each logprob entry's text (`Logprob.decoded_token`) as vLLM gives it, so that a sequence's
chosen tokens' texts join into its text:

- a token is decoded alone, with the leading spaces a SentencePiece (Metaspace) tokenizer's
  decode strips from a piece that starts a word put back;
- a text ending in an unfinished UTF-8 sequence (U+FFFD, a byte-fallback or split multi-byte
  token) is decoded after up to four of the tokens chosen before it: the text past theirs
  (past those of them that completed nothing themselves), or "" when none completes it."""

from __future__ import annotations

import json
from typing import Any

REPLACEMENT = "\ufffd"
MAX_CONTEXT = 4  # preceding tokens tried: a UTF-8 character has at most 4 bytes


class TokenTexts:
    """The decoded_token texts of one tokenizer; single-token texts memoised."""

    def __init__(self, tokenizer: Any, restore_spaces: bool = True) -> None:
        self.tokenizer = tokenizer
        self.marker = space_marker(tokenizer) if restore_spaces else None
        self._memo: dict[int, str] = {}

    def piece(self, token: int) -> str:
        """The token decoded alone, its stripped leading spaces restored."""
        text = self._memo.get(token)
        if text is None:
            text = self.tokenizer.decode([token])
            if self.marker is not None:
                raw = self.tokenizer.convert_ids_to_tokens(token) or ""
                lead = len(raw) - len(raw.lstrip(self.marker))
                text = " " * max(lead - (len(text) - len(text.lstrip(" "))), 0) + text
            self._memo[token] = text
        return text

    def text(self, token: int, context: list[int]) -> str:
        """`token`'s text where it follows the chosen tokens `context` (oldest first)."""
        text = self.piece(token)
        return text if not text.endswith(REPLACEMENT) else self.completion(token, context)

    def completion(self, token: int, context: list[int]) -> str:
        """The text `token` completes after the last 1..4 context tokens (those that end an
        unfinished UTF-8 sequence themselves count as part of it), or "" when none does."""
        for n in range(1, min(len(context), MAX_CONTEXT) + 1):
            before = context[-n:]
            full = self.tokenizer.decode(before + [token])
            if full.endswith(REPLACEMENT):
                continue
            clean = len(before)  # the context tokens before the unfinished run
            while clean and self.piece(before[clean - 1]).endswith(REPLACEMENT):
                clean -= 1
            prefix = self.tokenizer.decode(before[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b),
                          min(len(prefix), len(full)))
            return full[common:]
        return ""


def space_marker(tokenizer: Any) -> str | None:
    """The word-start marker of a fast tokenizer whose pre-tokenizer is Metaspace (or a
    sequence holding one), whose single-token decode strips a leading space; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (ValueError, AttributeError):
        return None
    for p in [pre, *pre.get("pretokenizers", [])] if pre.get("type") == "Sequence" else [pre]:
        if p.get("type") == "Metaspace":
            return p.get("replacement", "\u2581")
    return None

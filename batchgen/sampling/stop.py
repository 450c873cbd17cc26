"""Stop conditions and incremental detokenisation, with vLLM's semantics.

Semantics (vLLM v1):

* Checks run in this order on every new token: stop token (EOS unless ``ignore_eos``, then
  ``stop_token_ids``), stop strings, then length (``num_generated >= max_tokens``). So an EOS
  that is also the last allowed token finishes with ``"stop"``, not ``"length"``.
* EOS / stop ids count only from the ``min_tokens``-th generated token on (the sampler bans
  them before that anyway), and a stop string must end in text produced after the
  ``min_tokens``-th token (vLLM v1).
* ``eos_token_id`` may be one id or several (all count as EOS); ``None`` disables EOS.
* ``finish_reason`` is ``"stop"`` or ``"length"``. ``stop_reason`` is the stop token id or
  the stop string; it is ``None`` for EOS and for ``"length"`` (vLLM: "None if the
  completion finished for some other reason including encountering the EOS token").
* The token that ended the sequence always stays in ``token_ids`` (EOS, a stop id, or the
  token completing a stop string). The text never contains a stop token's text, nor the
  stop string or anything after it, unless ``include_stop_str_in_output`` (then the stop
  token's text / the stop string is kept, anything after the stop string is still cut).
* If several stop strings occur in the new text, the one that starts first wins.
* Text is decoded without ``clean_up_tokenization_spaces`` and with the last few prompt
  tokens as left context (so SentencePiece keeps the leading space of the first generated
  word, as in vLLM); for byte-level BPE this equals ``tokenizer.decode(generated_ids)``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import numpy as np
from tokenizers.decoders import DecodeStream

from batchgen.params import BeamSearchParams, SamplingParams

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens kept as left context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
MAX_PENDING_TOKENS = 16  # give up waiting for a complete character after this many tokens
REPLACEMENT_CHAR = "\ufffd"

# Why a row stops after its new token (stop_codes); GOES_ON: it does not.
GOES_ON, EOS_STOP, ID_STOP, LENGTH_STOP = 0, 1, 2, 3


def stop_codes(tokens: np.ndarray, generated: np.ndarray, min_tokens: np.ndarray,
               max_tokens: np.ndarray, stop_ids: np.ndarray, ignore_eos: np.ndarray,
               eos_ids: np.ndarray) -> np.ndarray:
    """The StopChecker's token rules for a whole batch at once, in its order: from the
    min_tokens-th generated token on, EOS (unless ignore_eos), then a stop id; then the length.
    `generated` counts the new token; `stop_ids` is [rows, K] with -1 pads."""
    allowed = generated >= min_tokens
    eos = allowed & ~ignore_eos & (tokens[:, None] == eos_ids[None, :]).any(axis=1)
    ids = allowed & (stop_ids == tokens[:, None]).any(axis=1)
    length = generated >= max_tokens
    return np.where(eos, EOS_STOP, np.where(ids, ID_STOP, np.where(length, LENGTH_STOP,
                                                                    GOES_ON)))


def finish_of(code: int, token: int) -> tuple[str, int | None]:
    """(finish_reason, stop_reason) of a stop code (not GOES_ON) for the row's last token."""
    if code == LENGTH_STOP:
        return "length", None
    return "stop", (token if code == ID_STOP else None)


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    """Decode ids exactly, without post-hoc space clean-up (it is not incremental)."""
    if not ids:
        return ""
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizers skip every added token marked special
        ids.update(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
    return frozenset(ids)


def _id_set(ids: int | Iterable[int] | None) -> frozenset[int]:
    """One EOS id, several (Llama 3 style generation configs) or none, as a set."""
    if ids is None:
        return frozenset()
    if isinstance(ids, int):
        return frozenset((ids,))
    return frozenset(ids)


class _Detokenizer:
    """What both detokenizers share: the tokenizer, the skipped ids, the prompt's tail as
    context (skipped ids left out) and the text so far."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 special: frozenset[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if special is None:
            special = special_ids(tokenizer)
        self._skip = special if skip_special_tokens else frozenset()
        self._context = [t for t in prompt_token_ids if t not in self._skip][-PROMPT_CONTEXT_TOKENS:]
        self._pieces: list[str] = []  # the text so far, as emitted (joined when read whole)
        self.length = 0  # its characters

    @property
    def text(self) -> str:
        """The text so far (joined on demand: while running only its tail is read)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def tail(self, n: int) -> str:
        """The last `n` characters, from the last few pieces (never the whole text)."""
        out: list[str] = []
        got = 0
        for piece in reversed(self._pieces):
            if got >= n:
                break
            out.append(piece)
            got += len(piece)
        return "".join(reversed(out))[-n:] if n > 0 else ""

    def _emit(self, new_text: str) -> None:
        if new_text:
            self._pieces.append(new_text)
            self.length += len(new_text)

    def _twin(self) -> Any:
        """A shallow copy whose text no longer shares this one's list."""
        twin = copy.copy(self)
        twin._pieces = list(self._pieces)
        return twin


class IncrementalDetokenizer(_Detokenizer):
    """Turns generated ids into text one token at a time over a bounded window of ids.

    Keeps ``ids`` = a few prompt tokens + the generated tokens not yet settled, and two
    offsets into it (vLLM's ``prefix_offset`` / ``read_offset``): text is emitted as
    ``decode(ids[prefix:]) - decode(ids[prefix:read])``, and only once it does not end in an
    incomplete UTF-8 character (U+FFFD). Skipped special tokens never enter the window.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._ids: list[int] = list(self._context)
        self._prefix = 0
        self._read = len(self._ids)

    def _window_texts(self) -> tuple[str, str]:
        """(decode of the settled context, decode of the whole window)."""
        prefix_text = _decode(self.tokenizer, self._ids[self._prefix:self._read], self.skip_special_tokens)
        full_text = _decode(self.tokenizer, self._ids[self._prefix:], self.skip_special_tokens)
        return prefix_text, full_text

    def _advance(self, new_text: str) -> str:
        """Emit ``new_text``, settle the window and drop ids no longer needed as context."""
        self._emit(new_text)
        self._prefix = self._read
        self._read = len(self._ids)
        if self._prefix > 0:  # keep the list bounded: forget everything left of the window
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return new_text

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while pending)."""
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        prefix_text, full_text = self._window_texts()
        pending = len(self._ids) - self._read
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            return self._advance(full_text[len(prefix_text):])
        if pending >= MAX_PENDING_TOKENS:  # invalid UTF-8 that will never complete
            return self._advance(full_text[len(prefix_text):])
        return ""

    def flush(self) -> str:
        """Emit whatever is pending (it may end in U+FFFD); call once at the end."""
        if len(self._ids) == self._read:
            return ""
        prefix_text, full_text = self._window_texts()
        return self._advance(full_text[len(prefix_text):])

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy (its id window is a short list)."""
        twin = self._twin()
        twin._ids = list(self._ids)
        return twin


class StreamDetokenizer(_Detokenizer):
    """The same contract as IncrementalDetokenizer, on tokenizers' own incremental decoder
    (`tokenizers.decoders.DecodeStream`): the same prompt context and skipped ids, text held
    back while a character is incomplete, given up after MAX_PENDING_TOKENS, flushed at the
    end. Used for every fast tokenizer."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._window = list(self._context)  # settled ids: the stream's context
        self._pending: list[int] = []  # ids fed since the last text came out
        self._stream = DecodeStream(ids=self._window, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while pending)."""
        if token_id in self._skip:
            return ""
        chunk = self._stream.step(self.tokenizer.backend_tokenizer, token_id)
        self._pending.append(token_id)
        if chunk is not None:
            return self._settle(chunk, restart=False)
        if len(self._pending) >= MAX_PENDING_TOKENS:  # invalid UTF-8 that will never complete
            return self._settle(self._pending_text(), restart=True)
        return ""

    def flush(self) -> str:
        """Emit whatever is pending (it may end in U+FFFD); call once at the end."""
        return self._settle(self._pending_text(), restart=True) if self._pending else ""

    def fork(self) -> StreamDetokenizer:
        """An independent copy (the Rust stream copies its state)."""
        twin = self._twin()
        twin._stream = copy.copy(self._stream)
        twin._window, twin._pending = list(self._window), list(self._pending)
        return twin

    def _pending_text(self) -> str:
        prefix = _decode(self.tokenizer, self._window, self.skip_special_tokens)
        full = _decode(self.tokenizer, self._window + self._pending, self.skip_special_tokens)
        return full[len(prefix):]

    def _settle(self, new_text: str, restart: bool) -> str:
        """Emit `new_text`; the settled ids become the context (a fresh stream after a forced
        emit, whose bytes the old stream still holds)."""
        self._emit(new_text)
        self._window = (self._window + self._pending)[-PROMPT_CONTEXT_TOKENS:]
        self._pending = []
        if restart:
            self._stream = DecodeStream(ids=self._window,
                                        skip_special_tokens=self.skip_special_tokens)
        return new_text


def detokenizer(tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                special: frozenset[int] | None = None
                ) -> StreamDetokenizer | IncrementalDetokenizer:
    """tokenizers' DecodeStream for a fast tokenizer, the windowed decoder otherwise."""
    cls = (StreamDetokenizer if getattr(tokenizer, "backend_tokenizer", None) is not None
           else IncrementalDetokenizer)
    return cls(tokenizer, prompt_token_ids, skip_special_tokens, special)


class StopChecker:
    """Decides when one sequence stops, and its final text; see the module docstring. Samples
    feed it every token; beams ask `would_stop` of each candidate and replay a finished
    hypothesis through a fresh checker for its text, so the same tokens give the same text."""

    def __init__(
        self,
        params: SamplingParams | BeamSearchParams,
        eos_token_id: int | Iterable[int] | None,
        tokenizer: Any | None,
        prompt_token_ids: list[int],
        max_tokens: int,
        special: frozenset[int] | None = None,
    ):
        self.eos_ids = _id_set(eos_token_id)
        # detokenize=False: no text at all (stop strings are refused with it)
        self.tokenizer = tokenizer if params.detokenize else None
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens
        self.stop_strings: list[str] = list(params.stop_strings)
        self.stop_ids = frozenset(params.stop_ids)
        self.ignore_eos = params.ignore_eos
        self.min_tokens: int = params.stop_min_tokens
        self.include_stop = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        if self.tokenizer is not None and special is None:
            special = special_ids(self.tokenizer)
        self.special = special or frozenset()
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._stop_token_text_dropped = False  # the last token's text is not in the output
        self._truncate_at: int | None = None  # text index where a stop string cut the text
        self.detokenizer: StreamDetokenizer | IncrementalDetokenizer | None = None
        if self.tokenizer is not None and self.stop_strings:
            self.detokenizer = detokenizer(self.tokenizer, prompt_token_ids, self.skip_special_tokens,
                                           self.special)
        self._search_from = 0  # stop strings must end after this text index (min_tokens)

    @property
    def finished(self) -> bool:
        """Whether a stop condition has been met."""
        return self.finish_reason is not None

    def fork(self) -> StopChecker:
        """An independent copy of this checker's state (a beam's child continues from it)."""
        twin = copy.copy(self)
        if self.detokenizer is not None:
            twin.detokenizer = self.detokenizer.fork()
        return twin

    def would_stop(self, token_id: int, num_generated: int) -> bool:
        """Would appending `token_id` (as generated token `num_generated`) end the sequence
        with "stop"? Leaves this checker unchanged."""
        return self.fork().append(token_id, num_generated)[0] == "stop"

    def _stop_token(self, token_id: int, num_generated: int) -> bool:
        """Check EOS / stop ids; record the reason. Never before min_tokens."""
        if num_generated < self.min_tokens:
            return False
        if token_id in self.eos_ids and not self.ignore_eos:
            self.finish_reason, self.stop_reason = "stop", None
            return True
        if token_id in self.stop_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
            return True
        return False

    def _find_stop_string(self, new_chars: int) -> bool:
        """Search the new text (plus the overlap a stop string may need); cut the text on a hit."""
        detok = self.detokenizer
        assert detok is not None
        # Only matches that end in the new text (and after the min_tokens mark) are new: each
        # stop string is searched from there, over the text's tail alone.
        end = max(detok.length - new_chars, self._search_from)
        starts = {s: max(end - len(s) + 1, 0) for s in self.stop_strings}
        lo = min(starts.values())
        window = detok.tail(detok.length - lo)
        hits = []
        for s, start in starts.items():
            i = window.find(s, start - lo)
            if i >= 0:
                hits.append((i + lo, -len(s), s))
        if not hits:
            return False
        i, _, s = min(hits)
        self.finish_reason, self.stop_reason = "stop", s
        self._truncate_at = i + len(s) if self.include_stop else i
        return True

    def _detok(self, token_id: int | None, search: bool = True) -> None:
        """Feed the detokenizer (or flush it when ``token_id`` is None) and search stop strings."""
        if self.detokenizer is None:
            return
        new = self.detokenizer.flush() if token_id is None else self.detokenizer.step(token_id)
        if new and search and self.stop_strings and self._truncate_at is None:
            self._find_stop_string(len(new))

    def append(self, token_id: int, num_generated: int) -> tuple[str | None, int | str | None]:
        """Add generated token number `num_generated` (1-based); return (finish_reason,
        stop_reason), (None, None) to go on."""
        if self.finished:
            raise RuntimeError("append() after the sequence finished")
        n = num_generated
        if self._stop_token(token_id, n):
            # The stop token stays in token_ids; its text only with include_stop_str_in_output.
            self._stop_token_text_dropped = not self.include_stop
            if self.include_stop:
                self._detok(token_id, search=n > self.min_tokens)  # a stop string takes over
        else:
            # Stop strings must end in text produced after the min_tokens-th token (vLLM).
            self._detok(token_id, search=n > self.min_tokens)
            if self.detokenizer is not None and n <= self.min_tokens:
                self._search_from = self.detokenizer.length
        if not self.finished and n >= self.max_tokens:
            self.finish_reason, self.stop_reason = "length", None
        if self.finished:
            self._detok(None, search=n > self.min_tokens)  # settle pending text; may hold a stop
        return self.finish_reason, self.stop_reason

    def final_text(self, token_ids: list[int]) -> str:
        """Output text of the generated `token_ids` fed so far: the detokenizer's (cut at a stop
        string) or one exact windowed decode."""
        if self.detokenizer is not None:
            text = self.detokenizer.text
            return text if self._truncate_at is None else text[:self._truncate_at]
        if self.tokenizer is None:
            return ""
        ids = token_ids[:-1] if self._stop_token_text_dropped else token_ids
        return decode_with_context(self.tokenizer, self.prompt_token_ids, ids,
                                   self.skip_special_tokens, self.special)


class StopFactory:
    """Makes StopCheckers for one tokenizer and one EOS set (the tokenizer's special ids are
    computed once, here)."""

    def __init__(self, tokenizer: Any | None, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.special = special_ids(tokenizer) if tokenizer is not None else frozenset()

    def __call__(self, params: SamplingParams | BeamSearchParams, prompt_token_ids: list[int],
                 max_tokens: int) -> StopChecker:
        return StopChecker(params, self.eos_token_ids, self.tokenizer, prompt_token_ids,
                           max_tokens, self.special)

    def output_text(self, params: SamplingParams | BeamSearchParams,
                    prompt_token_ids: list[int], token_ids: list[int], stop_token: bool) -> str:
        """The text of generated `token_ids` of a sequence without stop strings, decoded once:
        the last token's text is dropped when it was a stop token (EOS or a stop id) and
        include_stop_str_in_output is off."""
        if self.tokenizer is None or not params.detokenize:
            return ""
        ids = token_ids[:-1] if stop_token and not params.include_stop_str_in_output else token_ids
        return decode_with_context(self.tokenizer, prompt_token_ids, ids,
                                   params.skip_special_tokens, self.special)

    def text(self, params: SamplingParams | BeamSearchParams, prompt_token_ids: list[int],
             token_ids: list[int]) -> str:
        """The text a sequence generating `token_ids` ends with (replayed through a checker:
        stop strings cut it where they cut the sequence)."""
        checker = self(params, prompt_token_ids, max(len(token_ids), 1))
        for n, t in enumerate(token_ids, 1):
            if checker.append(t, n)[0] is not None:
                break
        return checker.final_text(token_ids)


def decode_with_context(tokenizer: Any, prompt_token_ids: list[int], ids: list[int],
                        skip_special_tokens: bool = True,
                        special: frozenset[int] | None = None) -> str:
    """Decode generated ids in one call, with the same prompt context as the detokenizer."""
    if special is None:
        special = special_ids(tokenizer)
    skip = special if skip_special_tokens else frozenset()
    context = [t for t in prompt_token_ids if t not in skip][-PROMPT_CONTEXT_TOKENS:]
    full = _decode(tokenizer, context + list(ids), skip_special_tokens)
    prefix = _decode(tokenizer, context, skip_special_tokens)
    if full.startswith(prefix):
        return full[len(prefix):]
    return _decode(tokenizer, list(ids), skip_special_tokens)

"""From the user's prompts and params to validated SequenceGroups, before any work starts:
every prompt is checked and tokenized, and every request bounded, before the first is queued."""

from __future__ import annotations

import numbers
import random
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import islice, zip_longest
from typing import Any

from batchgen.checks import NO_TOKENIZER, ValidationError, check_type
from batchgen.engine.kv_manager import request_peak_blocks
from batchgen.engine.sequence import SequenceGroup, sample_seed
from batchgen.id_table import check_table_rows
from batchgen.kinds import RequestKind
from batchgen.multimodal.ahead import Processed, ProcessorPool
from batchgen.multimodal.inputs import chat_images
from batchgen.multimodal.items import MMPrompt
from batchgen.multimodal.prompt import ImagePrompts, NoImages
from batchgen.param_bounds import check_model_bounds
from batchgen.params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from batchgen.prompts import (
    Conversation,
    PromptType,
    TextPrompt,
    TokensPrompt,
    check_prompt_keys,
)
from batchgen.sampling.grammar import Constraint, Grammars
from batchgen.sampling.stop import StopFactory

Params = SamplingParams | BeamSearchParams


@dataclass(frozen=True)
class Limits:
    """What bounds a request: the model and the engine's pool and step sizes."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_logprobs: int = 20  # vLLM's: the most (prompt) logprobs a request may ask; -1: any
    trace_replay: bool = False  # vLLM's enable_trace_replay: trace_decode_token_ids allowed


class RequestBuilder:
    """Turns one call's prompts and params into SequenceGroups with their policies."""

    def __init__(self, tokenizer: Any, limits: Limits, stops: StopFactory,
                 eos_token_ids: list[int], seed: int | None = 0,
                 pad_token_id: int | None = None, grammars: Grammars | None = None,
                 images: ImagePrompts | NoImages | None = None) -> None:
        self.tokenizer = tokenizer
        # prompts with multi_modal_data: the processor's (a vision-language model), or refused
        self.images = ProcessorPool(images if images is not None else NoImages("this model's"))
        self.limits = limits
        self.stops = stops
        self.eos_token_ids = eos_token_ids
        # what HF writes into a finished beam group's rows (counted by the diversity penalty)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (
            eos_token_ids[0] if eos_token_ids else 0)
        # structured outputs: one xgrammar compiler, made on the first constrained request
        self.grammars = grammars or Grammars(tokenizer, limits.vocab_size, eos_token_ids)
        # unseeded samples draw their seeds here: reproducible under the LLM's seed, in the
        # order requests are built (seed None: from the OS)
        self._rng = random.Random(seed)

    def build(self, prompts: PromptType | Iterable[PromptType], params: Any, kind: RequestKind
              ) -> list[SequenceGroup]:
        """Validate and tokenize everything, then make the groups (ValueError on any bad
        input, naming it, before anything is queued)."""
        prompts = as_prompt_list(prompts)
        per_prompt = _params_per_prompt(params, len(prompts), kind)
        return self._build(prompts, per_prompt, 0, kind, self._ahead(prompts, 0))

    def stream(self, prompts: PromptType | Iterable[PromptType], params: Any,
               kind: RequestKind, chunk: int) -> Iterator[SequenceGroup]:
        """The groups of any iterable of prompts (a generator of unknown length too), built
        lazily: `chunk` prompts at a time are pulled, validated and tokenized as one batch. A
        bad prompt raises when its chunk is reached, naming its input index."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        start = 0
        for batch, ahead in self._read_ahead(_batched(_paired(prompts, params, kind), chunk)):
            yield from self._build([pr for pr, _ in batch], [pa for _, pa in batch], start,
                                   kind, ahead)
            start += len(batch)

    def _read_ahead(self, batches: Iterator[list[Any]]
                    ) -> Iterator[tuple[list[Any], dict[int, Future[Processed]]]]:
        """Each batch with its image prompts' processing started; on a model that takes
        images, while a batch's groups run the next batch is pulled and its images processed in the workers (an error
        pulling it is raised only when it is reached)."""
        if not isinstance(self.images.prompts, ImagePrompts):  # text only: as lazy as it was
            yield from ((batch, {}) for batch in batches)
            return
        start, batch = 0, next(batches, None)
        ahead = self._ahead([pr for pr, _ in batch], start) if batch else {}
        while batch is not None:
            try:
                following = next(batches, None)
            except Exception:  # the user's iterator, or a params mismatch
                yield batch, ahead
                raise
            start += len(batch)
            after = self._ahead([pr for pr, _ in following], start) if following else {}
            yield batch, ahead
            batch, ahead = following, after

    def _ahead(self, prompts: list[Any], start: int) -> dict[int, Future[Processed]]:
        """Start processing the prompts with images (by input index) in the workers."""
        return {i: self.images.submit(p, _label(i)) for i, p in enumerate(prompts, start)
                if isinstance(p, dict) and p.get("multi_modal_data") is not None}

    def _build(self, prompts: list[Any], per_prompt: list[Any], start: int, kind: RequestKind,
               ahead: dict[int, Future[Processed]] | None = None) -> list[SequenceGroup]:
        """Groups for prompts `start`, `start + 1`, ... (all checked before any is made)."""
        texts, token_ids, images = self._tokenize(prompts, start, ahead=ahead)
        token_ids = [self._truncate(ids, p, mm) for ids, p, mm in
                     zip(token_ids, per_prompt, images)]
        limits = [self._check(start + i, ids, p, kind)
                  for i, (ids, p) in enumerate(zip(token_ids, per_prompt))]
        groups = [kind.group(self, start + i, text, ids, p, t) for i, (text, ids, p, t)
                  in enumerate(zip(texts, token_ids, per_prompt, limits))]
        for group, mm in zip(groups, images):
            group.mm = mm
        return groups

    def check_one(self, prompt: PromptType, params: Any, kind: RequestKind,
                  name: str = "prompt") -> TokensPrompt:
        """Raise the ValueError `build` would for this one request (messages call it `name`),
        building nothing; else return it tokenized, so running it does not tokenize again
        (callers that must not let one bad request stop the others check each first:
        run-batch, a dataset job's rows)."""
        (text,), (ids,), (mm,) = self._tokenize([prompt], name=name)
        self._check(name, self._truncate(ids, params, mm), params, kind)
        if mm is not None:  # its images are processed again when it runs
            return prompt  # type: ignore[return-value]
        checked = TokensPrompt(prompt_token_ids=ids)
        if text is not None:
            checked["prompt"] = text
        return checked

    def render_chat(self, conversations: Conversation | Seq[Conversation],
                    chat_template: str | None, add_generation_prompt: bool,
                    continue_final_message: bool, tools: list[dict] | None,
                    chat_template_kwargs: dict[str, Any] | None,
                    tokenizer_of: Callable[[int], Any] | None = None
                    ) -> list[TokensPrompt | TextPrompt]:
        """Each conversation through the tokenizer's chat template (or `chat_template`), as
        token ids: the template's own BOS, none added twice. One conversation (a list of
        messages) or a list of them. Image parts (image_url: a file:// or data: URL;
        image_pil) become the template's image placeholders and the prompt's
        multi_modal_data (tokenized by the processor, without a second BOS).
        `tokenizer_of(i)`: conversation i's tokenizer (an adapter's own), else the LLM's."""
        if self.tokenizer is None:
            raise ValueError(f"chat renders a chat template: {NO_TOKENIZER}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False")
        convs = list(conversations)
        if not convs or isinstance(convs[0], dict):
            convs = [convs]  # one conversation
        kw = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, tools=tools,
                  **(chat_template_kwargs or {}))
        out: list[TokensPrompt | TextPrompt] = []
        for i, conv in enumerate(convs):
            if not (isinstance(conv, list) and all(isinstance(m, dict) for m in conv)):
                raise ValueError(f"messages[{i}] must be a list of {{'role', 'content'}} dicts")
            tok = self.tokenizer if tokenizer_of is None else tokenizer_of(i)
            if chat_template is None and not getattr(tok, "chat_template", None):
                raise ValueError("this model's tokenizer has no chat template: pass "
                                 "chat_template= (a Jinja template string) to chat()")
            conv, images = chat_images(conv, f"messages[{i}]")
            if images:
                out.append(TextPrompt(prompt=tok.apply_chat_template(conv, tokenize=False, **kw),
                                      multi_modal_data={"image": images},
                                      mm_processor_kwargs={"add_special_tokens": False}))
                continue
            ids = tok.apply_chat_template(conv, tokenize=True, return_dict=False, **kw)
            text = tok.apply_chat_template(conv, tokenize=False, **kw)
            out.append(TokensPrompt(prompt_token_ids=list(ids), prompt=text))
        return out

    def _truncate(self, ids: list[int], p: Params, mm: MMPrompt | None = None) -> list[int]:
        """truncate_prompt_tokens=k keeps the last k tokens (-1: as many as max_model_len
        leaves room for, with one token to generate); refused with images (cutting would
        split their placeholders from their features)."""
        k = p.truncate_prompt_tokens
        if k is None:
            return ids
        if mm is not None:
            raise ValueError("truncate_prompt_tokens cannot apply to a prompt with images")
        return ids[-(self.limits.max_model_len - 1 if k == -1 else k):]

    def _tokenize(self, prompts: list[PromptType], start: int = 0, name: str | None = None,
                  ahead: dict[int, Future[Processed]] | None = None
                  ) -> tuple[list[str | None], list[list[int]], list[MMPrompt | None]]:
        """Batched tokenisation of text prompts; token-id prompts pass through; prompts with
        images go through the model's processor (their results taken from `ahead`, by input
        index, where the workers already started them). Messages name prompt i `prompts[i]`
        (or `name`, for a single prompt)."""
        ahead = ahead or {}
        texts: list[str | None] = []
        ids: list[list[int] | None] = []
        images: list[MMPrompt | None] = []
        for i, p in enumerate(prompts, start):
            label = name or _label(i)
            if isinstance(p, dict):
                check_prompt_keys(p, label)
            mm = None
            if isinstance(p, dict) and p.get("multi_modal_data") is not None:
                todo_mm = ahead.get(i) or self.images.submit(p, label)
                text, tok, mm = todo_mm.result()
            else:
                text, tok = _text_or_ids(p, label)
            texts.append(text)
            ids.append(tok)
            images.append(mm)
        todo = [i for i, t in enumerate(ids) if t is None]  # positions in this batch
        if todo:
            if self.tokenizer is None:
                raise ValueError("prompts must be token ids ({'prompt_token_ids': [...]}): "
                                 f"{NO_TOKENIZER}")
            enc = self.tokenizer([texts[i] for i in todo])["input_ids"]
            for i, e in zip(todo, enc):
                ids[i] = list(e)
        return texts, ids, images  # type: ignore[return-value]

    def _check(self, at: int | str, ids: list[int], p: Params, kind: RequestKind) -> int:
        """Refuse a request that could never run, naming the prompt (`prompts[at]`, or `at`
        when it is a name), the argument and the limit; returns its max_tokens capped by
        max_model_len."""
        lim = self.limits
        if not ids:
            raise ValidationError(f"{_label(at)} is empty: a prompt needs at least one token (the "
                                  "decoder prompt cannot be empty)", parameter="prompts")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= lim.vocab_size:
            raise ValidationError(f"{_label(at)} has token id {lo if lo < 0 else hi} out of "
                                  f"vocabulary: outside the model's vocabulary "
                                  f"[0, {lim.vocab_size})", parameter="prompts")
        if len(ids) >= lim.max_model_len:
            raise ValidationError(f"{_label(at)} has {len(ids)} tokens; max_model_len is "
                                  f"{lim.max_model_len}, leaving no room to generate (the "
                                  f"maximum context length is {lim.max_model_len} tokens)",
                                  parameter="prompts")
        check_table_rows(p.prompt_logprob_token_ids, len(ids), p.prompt_logprobs_start
                         if p.prompt_logprob_token_ids is not None else 0)
        if p.stop_strings and self.tokenizer is None:
            raise ValueError(f"stop strings are matched on text: {NO_TOKENIZER} (use "
                             "stop_token_ids)")
        self._check_vocab(p)
        room = lim.max_model_len - len(ids)
        t = room if p.max_tokens is None else min(p.max_tokens, room)
        t = _trace_limit(p, t, lim.trace_replay)
        arg = kind.width_arg
        kind.check(p, lim.max_num_batched_tokens)
        need = request_peak_blocks(len(ids), p.width, t, lim.block_size)
        if need > lim.num_blocks:
            raise ValueError(
                f"{_label(at)} with {arg}={p.width} and up to {t} new tokens needs {need} KV "
                f"blocks and can never fit the pool of {lim.num_blocks} blocks; "
                f"raise num_kv_blocks / kv_cache_memory or lower max_tokens / {arg}")
        return t

    def _check_vocab(self, p: Params) -> None:
        """Token ids and counts a request names must fit the vocabulary (and max_logprobs);
        what needs a tokenizer must have one; a grammar must compile."""
        check_model_bounds(p, self.limits.vocab_size, self.limits.max_logprobs,
                           self.limits.max_model_len)
        if p.bad_words and self.tokenizer is None:
            raise ValueError(f"bad_words are tokenized: {NO_TOKENIZER}")
        if p.structured_outputs is not None:  # compiled now: a bad one fails before any work
            self.grammars.compile(p.structured_outputs)

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's rule: each word's ids, and those of " word" when that is as long but starts
        with another token."""
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            out.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return out

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    def constraint(self, so: StructuredOutputsParams) -> Constraint:
        """A new matcher for a sequence under `so` (compiled once per constraint)."""
        return self.grammars.constraint(so)

    def seed_of(self, seed: int | None, index: int) -> int:
        """The seed of sample `index`: from (seed, index) when the request is seeded, else a
        fresh draw from this builder's generator (seeded by the LLM's seed)."""
        return sample_seed(seed, index) if seed is not None else self._rng.getrandbits(64)


def _text_or_ids(p: Any, label: str) -> tuple[str | None, list[int] | None]:
    """A text prompt's text (ids None: tokenized in a batch), or a token-id prompt's text
    (if given) and ids; ValueError naming the prompt for any other form."""
    if isinstance(p, str):
        return p, None
    if isinstance(p, dict) and "prompt_token_ids" in p:
        tok = p["prompt_token_ids"]
        if isinstance(tok, (str, bytes)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in tok):
            raise ValueError(f"{label}['prompt_token_ids'] must be a list of ints")
        return p.get("prompt"), [int(t) for t in tok]
    if isinstance(p, dict) and isinstance(p.get("prompt"), str):
        return p["prompt"], None
    raise ValueError(f"{label} must be a str, a {{'prompt': str}} or a "
                     f"{{'prompt_token_ids': [...]}}, got {type(p).__name__}")


def _label(at: int | str) -> str:
    """How a message names a prompt: `prompts[i]` by its index, or the name it was given."""
    return at if isinstance(at, str) else f"prompts[{at}]"


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a str or a dict) or any sequence or iterable of them (a list, a tuple, a
    numpy array, a pandas Series, a generator) as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise ValueError("prompts must be a str, a {'prompt': ...} or {'prompt_token_ids': "
                         f"[...]}} dict, or an iterable of those, got {type(prompts).__name__}")
    return list(prompts)


def _paired(prompts: Iterable[Any], params: Any, kind: RequestKind
            ) -> Iterator[tuple[Any, Any]]:
    """(prompt, params) pairs: one params object for every prompt, or an iterable of them
    aligned with the prompts (the two must end together)."""
    name, cls = kind.params_arg, kind.params_type
    if isinstance(params, cls):
        for prompt in prompts:
            yield prompt, params
        return
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise ValueError(f"{name} must be a {cls.__name__} or an iterable of them aligned "
                         f"with the prompts, got {type(params).__name__}")
    done = object()
    for i, (prompt, p) in enumerate(zip_longest(prompts, params, fillvalue=done)):
        if prompt is done or p is done:
            raise ValueError(f"{name} and prompts must have the same length: one ended at "
                             f"item {i}")
        check_type(p, f"{name}[{i}]", cls)
        yield prompt, p


def _batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Lists of `size` items (the last one shorter), pulled lazily."""
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


def _params_per_prompt(sp: Any, n: int, kind: RequestKind) -> list[Any]:
    """One params object per prompt (a single one applies to all)."""
    name, cls = kind.params_arg, kind.params_type
    if isinstance(sp, cls):
        return [sp] * n
    check_type(sp, name, (list, tuple), f"a {cls.__name__} or a list of {n}")
    sp = list(sp)
    if len(sp) != n:
        raise ValidationError(f"{name} must be one {cls.__name__} or a list of {n} "
                              f"(one per prompt), got {len(sp)} items", parameter=name)
    for i, p in enumerate(sp):
        check_type(p, f"{name}[{i}]", cls)
    return sp


def _trace_limit(p: Params, max_tokens: int, enabled: bool) -> int:
    """vLLM's trace replay: a request's trace needs the engine's flag, and its length (what
    fits the context) bounds max_tokens."""
    trace = getattr(p, "trace_decode_token_ids", None)
    if not trace:
        return max_tokens
    if not enabled:
        raise ValidationError("trace_decode_token_ids is set but trace replay is not enabled. "
                              "Start the engine with --enable-trace-replay (LLM(enable_trace_"
                              "replay=True)) to use it.", parameter="trace_decode_token_ids",
                              value=len(trace))
    return min(len(trace), max_tokens)

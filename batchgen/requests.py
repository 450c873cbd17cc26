"""From the user's prompts and params to validated SequenceGroups, before any work starts:
every prompt is checked and tokenized, and every request bounded, before the first is queued."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.beam import BeamSearchState
from batchgen.engine.policy import BeamPolicy, SamplePolicy
from batchgen.engine.scheduler import request_peak_blocks
from batchgen.engine.sequence import Sequence, SequenceGroup, sample_seed
from batchgen.params import BeamSearchParams, SamplingParams
from batchgen.sampling.stop import StopFactory

PromptType = str | dict[str, Any]
Params = SamplingParams | BeamSearchParams


@dataclass(frozen=True)
class Limits:
    """What bounds a request: the model and the engine's pool and step sizes."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int


class RequestBuilder:
    """Turns one call's prompts and params into SequenceGroups with their policies."""

    def __init__(self, tokenizer: Any, limits: Limits, stops: StopFactory,
                 eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.stops = stops
        self.eos_token_ids = eos_token_ids

    def build(self, prompts: PromptType | Seq[PromptType], params: Any, kind: type
              ) -> list[SequenceGroup]:
        """Validate and tokenize everything, then make the groups (ValueError on any bad
        input, naming it, before anything is queued)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Seq):
            raise ValueError("prompts must be a str, a dict with 'prompt_token_ids', or a list "
                             f"of those, got {type(prompts).__name__}")
        prompts = list(prompts)
        per_prompt = _params_per_prompt(params, len(prompts), kind)
        texts, token_ids = self._tokenize(prompts)
        limits = [self._check(i, ids, p) for i, (ids, p) in enumerate(zip(token_ids, per_prompt))]
        return [self._group(i, text, ids, p, t)
                for i, (text, ids, p, t) in enumerate(zip(texts, token_ids, per_prompt, limits))]

    def _tokenize(self, prompts: list[PromptType]) -> tuple[list[str | None], list[list[int]]]:
        """Batched tokenisation of text prompts; token-id prompts pass through."""
        texts: list[str | None] = []
        ids: list[list[int] | None] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                texts.append(p)
                ids.append(None)
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                tok = p["prompt_token_ids"]
                if not (isinstance(tok, (list, tuple)) and all(
                        isinstance(t, int) and not isinstance(t, bool) for t in tok)):
                    raise ValueError(f"prompts[{i}]['prompt_token_ids'] must be a list of ints")
                texts.append(p.get("prompt"))
                ids.append(list(tok))
            else:
                raise ValueError(f"prompts[{i}] must be a str or a dict with 'prompt_token_ids',"
                                 f" got {type(p).__name__}")
        todo = [i for i, t in enumerate(ids) if t is None]
        if todo:
            if self.tokenizer is None:
                raise ValueError("prompts must be token ids ({'prompt_token_ids': [...]}): the "
                                 "model folder has no tokenizer")
            enc = self.tokenizer([texts[i] for i in todo])["input_ids"]
            for i, e in zip(todo, enc):
                ids[i] = list(e)
        return texts, ids  # type: ignore[return-value]

    def _check(self, i: int, ids: list[int], p: Params) -> int:
        """Refuse a request that could never run, naming the argument and the limit; returns
        its max_tokens capped by max_model_len."""
        lim = self.limits
        if not ids:
            raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= lim.vocab_size:
            raise ValueError(f"prompts[{i}] has token id {lo if lo < 0 else hi} outside the "
                             f"model's vocabulary [0, {lim.vocab_size})")
        if len(ids) >= lim.max_model_len:
            raise ValueError(f"prompts[{i}] has {len(ids)} tokens; max_model_len is "
                             f"{lim.max_model_len}, leaving no room to generate")
        if p.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the model folder has none "
                             "(use stop_token_ids)")
        if getattr(p, "logprobs", None) is not None and p.logprobs > lim.vocab_size:
            raise ValueError(f"logprobs must be <= the vocabulary size {lim.vocab_size}, "
                             f"got {p.logprobs}")
        room = lim.max_model_len - len(ids)
        t = room if p.max_tokens is None else min(p.max_tokens, room)
        name = "beam_width" if isinstance(p, BeamSearchParams) else "n"
        step_limit = min(lim.max_num_seqs, lim.max_num_batched_tokens)
        if name == "beam_width" and p.width > step_limit:
            raise ValueError(f"beam_width ({p.width}) must be <= max_num_seqs and "
                             f"max_num_batched_tokens ({step_limit}): all beams decode together")
        need = request_peak_blocks(len(ids), p.width, t, lim.block_size)
        if need > lim.num_blocks:
            raise ValueError(
                f"prompts[{i}] with {name}={p.width} and up to {t} new tokens needs {need} KV "
                f"blocks and can never fit the pool of {lim.num_blocks} blocks; "
                f"raise num_kv_blocks / kv_cache_memory or lower max_tokens / {name}")
        return t

    def _group(self, i: int, text: str | None, ids: list[int], p: Params, max_tokens: int
               ) -> SequenceGroup:
        """The group with its policy and its sequences: n samples (each with its own stop
        state and, when seeded, generator), or one beam leader."""
        if isinstance(p, SamplingParams):
            group = SequenceGroup(i, text, ids, p, max_tokens, SamplePolicy())
            group.seqs = [self._sample(group, k) for k in range(p.n)]
            return group
        state = BeamSearchState(
            p.beam_width, max_tokens, p.length_penalty,
            True if p.beam_width == 1 else p.early_stopping,  # HF num_beams=1: greedy
            eos_token_ids=[] if p.ignore_eos else self.eos_token_ids,
            num_return_sequences=p.num_return_sequences, vocab_size=self.limits.vocab_size,
            stop_token_ids=p.stop_ids)
        policy = BeamPolicy(state, lambda tokens: self.stops.text(p, ids, tokens))
        group = SequenceGroup(i, text, ids, p, max_tokens, policy)
        stop = self.stops(p, ids, max_tokens) if p.stop_strings else None
        group.seqs = [Sequence(group, 0, list(ids), stop)]
        return group

    def _sample(self, group: SequenceGroup, k: int) -> Sequence:
        p = group.params
        gen = None
        if p.seed is not None:
            gen = torch.Generator().manual_seed(sample_seed(p.seed, k))
        return Sequence(group, k, list(group.prompt_token_ids),
                        self.stops(p, group.prompt_token_ids, group.max_tokens), gen,
                        logprobs=[] if p.logprobs is not None else None)


def _params_per_prompt(sp: Any, n: int, kind: type) -> list[Any]:
    """One params object per prompt (a single one applies to all)."""
    name = "sampling_params" if kind is SamplingParams else "params"
    if sp is None and kind is SamplingParams:
        return [SamplingParams()] * n
    if isinstance(sp, kind):
        return [sp] * n
    if not isinstance(sp, (list, tuple)):
        raise ValueError(f"{name} must be a {kind.__name__} or a list of {n}, "
                         f"got {type(sp).__name__}")
    sp = list(sp)
    if len(sp) != n or not all(isinstance(p, kind) for p in sp):
        raise ValueError(f"{name} must be one {kind.__name__} or a list of {n} "
                         f"(one per prompt), got {len(sp)} items")
    return sp

"""lm-evaluation-harness on batchgen: `BatchgenLM`, an lm-eval model registered as "batchgen"
(the `[eval]` extra). Each request list is one batched `generate` call: loglikelihoods from
prompt logprobs of the continuations (contexts shared through the prefix cache), rolling loglikelihoods over lm-eval's own windows, and `generate_until`.
Tokenisation, windows and truncation follow lm-eval's `hf` backend, so the metrics equal it."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("batchgen.eval needs lm-evaluation-harness: pip install "
                      "'batchgen[eval]' (or 'lm-eval>=0.4.13')") from e

from batchgen.checks import check, check_int
from batchgen.llm import LLM
from batchgen.params import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until
# lm-eval arguments every backend is given; batchgen batches a whole request list itself.
_IGNORED_ARGS = ("batch_size", "max_batch_size")
# gen_kwargs that map onto SamplingParams under the same name (after lm-eval normalises
# until / max_gen_toks / do_sample / temperature).
_GEN_KWARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
               "presence_penalty", "frequency_penalty", "min_tokens")
Pair = tuple[tuple[str, str] | None, list[int], list[int]]  # (cache key, context, continuation)


@register_model("batchgen")
class BatchgenLM(TemplateLM):
    """An lm-eval model served by a batchgen `LLM`: `pretrained` is a model folder (or an
    `LLM` already built); other keyword arguments go to `LLM` (`tensor_parallel_size`,
    `max_model_len`, `num_kv_blocks`, `dtype`, ...); `device="auto"` is batchgen's choice.
    `lora_local_path` (lm-eval's name): a PEFT LoRA folder every request runs under (the
    `LLM` built with `enable_lora=True` and its rank; a given `LLM` must have LoRA on)."""

    def __init__(self, pretrained: str | os.PathLike | LLM, *, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool | None = None,
                 device: str | None = None, use_tqdm: bool = False,
                 lora_local_path: str | os.PathLike | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.lora = _lora(lora_local_path, kwargs, isinstance(pretrained, LLM))
        for name in _IGNORED_ARGS:
            kwargs.pop(name, None)
        if isinstance(pretrained, LLM):
            check(not kwargs and device is None, "kwargs", "empty when pretrained is an LLM",
                  sorted(kwargs))
            self.llm = pretrained
        else:
            self.llm = LLM(pretrained, device=None if device == "auto" else device, **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        check(self.tokenizer is not None, "pretrained", "a model folder with a tokenizer",
              str(pretrained))
        limit = self.llm.max_model_len - 2  # a window of max_length + 1 tokens, and one to generate
        check_int(max_length, "max_length", minimum=1, allow_none=True)
        check(max_length is None or max_length <= limit, "max_length",
              f"<= max_model_len - 2 = {limit}", max_length)
        check_int(max_gen_toks, "max_gen_toks")
        check(add_bos_token in (None, True, False), "add_bos_token", "None, True or False",
              add_bos_token)
        self._max_length = max_length or limit
        self._max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.use_tqdm = use_tqdm

    # ---- tokenisation (as lm-eval's hf backend) ------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """BOS if the tokenizer has one, else EOS (the `hf` backend's choice)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        """The `hf` backend's rule: the tokenizer's own special tokens unless told, none when
        the string already starts with the prefix token's text."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(
                string, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        return self.tokenizer.encode(string, **kw)

    # ---- scoring -------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: Sequence[Pair], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether each continuation token is the argmax)
        per (context, continuation) pair, all scored in one generate call."""
        prompts, starts = [], []
        for _, ctx, cont in requests:
            check(len(cont) >= 1, "continuation", "at least one token", cont)
            ids = (ctx + cont)[-(self.max_length + 1):]
            prompts.append(ids)
            starts.append(max(len(ids) - len(cont), 1))
        results = []
        for lps, start, (key, _, _) in zip(self._score(prompts, starts), starts, requests):
            answer = (sum(lp for lp, _ in lps[start:]),
                      all(rank == 1 for _, rank in lps[start:]))
            results.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _score(self, prompts: list[list[int]], starts: list[int]) -> list[list[Any]]:
        """Per token list: (logprob, rank) of each token from its start on, given the tokens
        before it (rank 1: the argmax; None before the start). Identical lists are scored
        once, all in one call: one list per context first, then the others (see `_order`)."""
        first: dict[tuple[int, ...], int] = {}
        for p, start in zip(prompts, starts):
            key = tuple(p)
            first[key] = min(start, first.get(key, start))
        unique = _order(first)
        params = [SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                                 prompt_logprobs_start=first[u], detokenize=False)
                  for u in unique]
        outs = self.llm.generate([{"prompt_token_ids": list(u)} for u in unique], params,
                                 use_tqdm=self.use_tqdm, lora_request=self.lora)
        scored = {u: [None if e is None else (e[t].logprob, e[t].rank)
                      for t, e in zip(u, out.prompt_logprobs)]
                  for u, out in zip(unique, outs)}
        return [scored[tuple(p)] for p in prompts]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """Each document's total logprob over lm-eval's disjoint rolling windows of
        `max_length` tokens (all windows of all documents in one call)."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ----------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuations of every context in one generate call, stopped at
        `until` (and EOS), up to `max_gen_toks`, cut at the first stop string."""
        prompts, params, stops = [], [], []
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        for context, gen_kwargs in (req.args for req in requests):
            p, until = self._gen_params(gen_kwargs, eos)
            keep = max(self.max_length - p.max_tokens, 1)  # the hf backend's left truncation
            prompts.append({"prompt_token_ids": self.tok_encode(context)[-keep:]})
            params.append(p)
            stops.append(until)
        outs = self.llm.generate(prompts, params, use_tqdm=self.use_tqdm,
                                 lora_request=self.lora)
        texts = []
        for req, out, until in zip(requests, outs, stops):
            text = postprocess_generated_text(out.outputs[0].text, until, None)
            texts.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _gen_params(self, gen_kwargs: dict[str, Any], eos: str) -> tuple[SamplingParams,
                                                                         list[str]]:
        """SamplingParams from a task's gen_kwargs (lm-eval's normalisation first), and the
        stop strings to cut the text at (`until` plus the EOS text)."""
        check(isinstance(gen_kwargs, dict), "gen_kwargs", "a dict", gen_kwargs)
        kw = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
        until = handle_stop_sequences(kw.pop("until", None), eos=eos)
        max_tokens = int(kw.pop("max_gen_toks"))
        do_sample = kw.pop("do_sample", False)
        unknown = sorted(set(kw) - set(_GEN_KWARGS))
        check(not unknown, "gen_kwargs", f"keys among until, max_gen_toks, do_sample, "
              f"{', '.join(_GEN_KWARGS)}", unknown)
        if not do_sample:
            kw["temperature"] = 0.0
        stop = [s for s in until if s and s != eos]
        return SamplingParams(max_tokens=max_tokens, stop=stop or None, **kw), until


def _order(starts: dict[tuple[int, ...], int]) -> list[tuple[int, ...]]:
    """The token lists in submission order: the first (in sorted order) of each context, then
    the rest. The scheduler admits in order, so the first wave computes every context once and
    the second takes them from the prefix cache (the choices of a question share their
    context; the hit covers the tokens before `start - 1`, see `prompt_logprobs_start`)."""
    leaders: dict[tuple[int, ...], tuple[int, ...]] = {}
    for u in sorted(starts):
        leaders.setdefault(u[:starts[u] - 1], u)
    lead = set(leaders.values())
    return list(leaders.values()) + [u for u in sorted(starts) if u not in lead]


def _lora(path: str | os.PathLike | None, kwargs: dict[str, Any], built: bool) -> Any:
    """The LoRARequest of `lora_local_path` (None without one); for an `LLM` built here,
    `enable_lora=True` and `max_lora_rank` of at least the adapter's rank."""
    if path is None:
        return None
    from batchgen.lora import LoRARequest

    if not built:
        config = Path(path) / "adapter_config.json"
        rank = json.loads(config.read_text()).get("r", 16) if config.is_file() else 16
        kwargs.setdefault("enable_lora", True)
        kwargs.setdefault("max_lora_rank", max(16, int(rank)))
    return LoRARequest("lm-eval", 1, str(path))

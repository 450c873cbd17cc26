"""LLM: the user-facing entry point (vLLM's offline API over batchgen's paged engine)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm.auto import tqdm

from batchgen import cpu_allocator
from batchgen.attention import cpu_kernel
from batchgen.attention.torch_backend import TorchPagedAttention
from batchgen.config import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    CacheConfig,
    check_positive_int,
    pool_blocks,
)
from batchgen.engine.beam import BeamHypothesis, BeamSearchState
from batchgen.engine.engine import Engine, StepStats
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import SequenceGroup
from batchgen.kv.block_manager import BlockManager, blocks_for
from batchgen.kv.cache import KVCache, kv_cache_bytes
from batchgen.model import loader
from batchgen.model.runner import ModelRunner
from batchgen.outputs import (
    BeamSearchOutput,
    BeamSequence,
    CompletionOutput,
    KVStats,
    RequestOutput,
)
from batchgen.params import BeamSearchParams, SamplingParams
from batchgen.sampling.sampler import Sampler

logger = logging.getLogger("batchgen")
if not logger.handlers:
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("[batchgen] %(message)s"))
    logger.addHandler(_h)
    logger.setLevel(logging.INFO)

# None picks the best available: on the CPU with a float32/bfloat16 KV pool, the decode kernel
# when it builds (else pure PyTorch); "torch" never compiles anything; "cpu_kernel" insists.
ATTENTION_BACKENDS = ("torch", "cpu_kernel")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")

PromptType = str | dict[str, Any]


class LLM:
    """A local HF model folder served from one paged KV pool.

    >>> llm = LLM("path/to/model")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str | os.PathLike, *, block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 kv_cache_dtype: str = "auto",
                 gpu_memory_utilization: float = 0.90, kv_cache_memory: int | None = None,
                 num_kv_blocks: int | None = None, dtype: str | torch.dtype = "auto",
                 device: str | torch.device | None = None, attention_backend: str | None = None,
                 seed: int = 0) -> None:
        check_positive_int(block_size, "block_size")
        check_positive_int(max_model_len, "max_model_len", allow_none=True)
        check_positive_int(max_num_seqs, "max_num_seqs")
        check_positive_int(max_num_batched_tokens, "max_num_batched_tokens", allow_none=True)
        check_positive_int(kv_cache_memory, "kv_cache_memory", allow_none=True)
        check_positive_int(num_kv_blocks, "num_kv_blocks", allow_none=True)
        if not (isinstance(gpu_memory_utilization, (int, float))
                and 0 < gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {gpu_memory_utilization!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {kv_cache_dtype!r}")
        if attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be None or one of {ATTENTION_BACKENDS}, "
                             f"got {attention_backend!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, "
                             f"got {enable_prefix_caching!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")

        path = loader.check_model_dir(model)
        config = loader.load_config(path)
        self.device = _resolve_device(device)
        if self.device.type == "cpu":
            cpu_allocator.tune_host_allocator()  # reuse freed activations (see the module)
        self.dtype = loader.resolve_dtype(dtype, config)
        self.tokenizer = loader.load_tokenizer(path)
        self.model = loader.load_model(path, config, self.dtype, self.device)
        self.config = config
        geo = loader.kv_geometry(config)
        model_max = max_model_len or geo.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        if geo.max_position_embeddings and model_max > geo.max_position_embeddings:
            raise ValueError(f"max_model_len must be <= the model's max_position_embeddings "
                             f"({geo.max_position_embeddings}), got {max_model_len}")

        kv_dtype = self.dtype if kv_cache_dtype == "auto" else loader.resolve_dtype(
            kv_cache_dtype, config)
        beta = kv_cache_bytes(geo.num_layers, geo.num_kv_heads, geo.head_dim, 1,
                              torch.empty((), dtype=kv_dtype).element_size())
        gpu_free = _gpu_kv_budget(self.device, gpu_memory_utilization)
        num_blocks = pool_blocks(block_size, beta, self.device, num_kv_blocks, kv_cache_memory,
                                 gpu_free, max_num_seqs * blocks_for(model_max, block_size) + 1)
        self.cache_config = CacheConfig(block_size, num_blocks, beta)
        capacity = num_blocks * block_size
        if max_model_len is not None and max_model_len > capacity:
            raise ValueError(f"max_model_len ({max_model_len}) must fit the KV pool of "
                             f"{capacity} tokens; raise num_kv_blocks / kv_cache_memory")
        self.max_model_len = min(model_max, capacity)
        self.max_num_batched_tokens = max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS

        self.cache = KVCache(geo.num_layers, num_blocks, block_size, geo.num_kv_heads,
                             geo.head_dim, kv_dtype, self.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, self.max_num_batched_tokens)
        backend = _attention_backend(attention_backend, self.device, kv_dtype)
        runner = ModelRunner(self.model, self.cache, backend, self.device)
        self.eos_token_ids = _eos_ids(config, loader.load_generation_config(path),
                                      self.tokenizer)
        self.engine = Engine(runner, self.cache, self.block_manager, self.scheduler,
                             Sampler(seed), self.tokenizer, self.eos_token_ids)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._last_stats = KVStats(num_blocks, block_size, 0, 0, 0, 0, 0)
        logger.info(self.cache_config.capacity_line(self.max_model_len))

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        groups = self._make_groups(prompts, sampling_params, SamplingParams)
        self._run(groups, use_tqdm)
        return [self._request_output(g) for g in groups]

    def beam_search(self, prompts: PromptType | Seq[PromptType],
                    params: BeamSearchParams | Seq[BeamSearchParams],
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search inside the engine with HF `generate(num_beams=...)` semantics; all
        prompts run at once under continuous batching and beams share prefix blocks."""
        groups = self._make_groups(prompts, params, BeamSearchParams)
        self._run(groups, use_tqdm)
        return [self._beam_output(g) for g in groups]

    def _run(self, groups: list[SequenceGroup], use_tqdm: bool) -> None:
        """Run validated groups to completion and record the call's KV figures."""
        if not groups:
            return
        self.block_manager.reset_stats()
        self.engine.prompt_tokens_computed = 0
        preempt0 = self.scheduler.num_preemptions
        for g in groups:
            self.engine.add_group(g)
        try:
            self.engine.run(self._progress(len(groups)) if use_tqdm else None)
        except BaseException:
            self.scheduler.abort_all()  # an error or Ctrl-C must not leak into the next call
            raise
        finally:
            self._close_progress()
            self._last_stats = KVStats(
                self.block_manager.num_blocks, self.block_manager.block_size,
                self.block_manager.peak_blocks_in_use, self.block_manager.cow_copies,
                self.scheduler.num_preemptions - preempt0, self.block_manager.prefix_hit_tokens,
                self.engine.prompt_tokens_computed)

    def kv_stats(self) -> KVStats:
        """KV figures of the last call: pool size, peak blocks in use, COW copies, preemptions."""
        return self._last_stats

    def get_tokenizer(self):
        return self.tokenizer

    # ---- input handling -----------------------------------------------------------------------
    def _make_groups(self, prompts: PromptType | Seq[PromptType],
                     sampling_params: Any, kind: type) -> list[SequenceGroup]:
        """Validate and tokenize everything before any work starts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Seq):
            raise ValueError("prompts must be a str, a dict with 'prompt_token_ids', or a list "
                             f"of those, got {type(prompts).__name__}")
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts), kind)
        texts, token_ids = self._tokenize(prompts)
        groups = []
        for i, (text, ids, p) in enumerate(zip(texts, token_ids, params)):
            max_tokens = self._check_request(i, ids, p)
            beam = self._beam_state(p, max_tokens) if kind is BeamSearchParams else None
            groups.append(SequenceGroup(i, text, ids, p, max_tokens, beam=beam))
        return groups

    def _beam_state(self, p: BeamSearchParams, max_tokens: int) -> BeamSearchState:
        """HF beam search state; width 1 is greedy decoding, as HF `generate(num_beams=1)`."""
        return BeamSearchState(
            p.beam_width, max_tokens, p.length_penalty,
            True if p.beam_width == 1 else p.early_stopping,
            eos_token_ids=[] if p.ignore_eos else self.eos_token_ids,
            num_return_sequences=p.num_return_sequences, vocab_size=self.vocab_size,
            stop_token_ids=p.stop_ids)

    def _params_per_prompt(self, sp: Any, n: int, kind: type) -> list[Any]:
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

    def _check_request(self, i: int, ids: list[int], p: SamplingParams | BeamSearchParams
                       ) -> int:
        """Refuse a request that could never run, naming the argument and the limit; returns
        its max_tokens capped by max_model_len."""
        if not ids:
            raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"prompts[{i}] has token id {lo if lo < 0 else hi} outside the "
                             f"model's vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompts[{i}] has {len(ids)} tokens; max_model_len is "
                             f"{self.max_model_len}, leaving no room to generate")
        if p.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the model folder has none "
                             "(use stop_token_ids)")
        if getattr(p, "logprobs", None) is not None and p.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be <= the vocabulary size {self.vocab_size}, "
                             f"got {p.logprobs}")
        bs = self.block_manager.block_size
        room = self.max_model_len - len(ids)
        t = room if p.max_tokens is None else min(p.max_tokens, room)
        if isinstance(p, BeamSearchParams):
            width, name = p.beam_width, "beam_width"
            need = blocks_for(len(ids), bs) + width * (blocks_for(t, bs) + 1)
            limit = min(self.scheduler.max_num_seqs, self.max_num_batched_tokens)
            if width > limit:
                raise ValueError(f"beam_width ({width}) must be <= max_num_seqs and "
                                 f"max_num_batched_tokens ({limit}): all beams decode together")
        else:
            width, name = p.n, "n"
            need = blocks_for(len(ids), bs) + width * blocks_for(t + 1, bs)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompts[{i}] with {name}={width} and up to {t} new tokens needs {need} KV "
                f"blocks and can never fit the pool of {self.block_manager.num_blocks} blocks; "
                "raise num_kv_blocks / kv_cache_memory or lower max_tokens / " + name)
        return t

    # ---- outputs and progress -----------------------------------------------------------------
    def _request_output(self, g: SequenceGroup) -> RequestOutput:
        outs = [CompletionOutput(index=s.index, text=s.stop.final_text(),
                                 token_ids=s.output_token_ids,
                                 cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                                 finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                for s in sorted(g.seqs, key=lambda s: s.index)]
        return RequestOutput(request_id=str(g.index), prompt=g.prompt,
                             prompt_token_ids=g.prompt_token_ids, outputs=outs)

    def _beam_output(self, g: SequenceGroup) -> BeamSearchOutput:
        seqs = [BeamSequence(token_ids=h.token_ids, text=self._beam_text(g, h),
                             cumulative_logprob=h.sum_logprobs, score=h.score,
                             finish_reason=h.finish_reason)
                for h in g.beam.finalize()]
        return BeamSearchOutput(prompt=g.prompt, prompt_token_ids=g.prompt_token_ids,
                                sequences=seqs)

    def _beam_text(self, g: SequenceGroup, h: BeamHypothesis) -> str:
        """Decoded hypothesis, cut before the stop string that ended it (as generate does)."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(h.token_ids, skip_special_tokens=True)
        if h.finish_reason == "stop":
            hits = [text.find(s) for s in g.params.stop_strings if s in text]
            if hits:
                text = text[:min(hits)]
        return text

    def _progress(self, total: int):
        bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        counts = [0, 0, 0.0]  # input tokens, output tokens, last postfix time
        self._bar = bar

        def on_step(stats: StepStats) -> None:
            counts[0] += stats.prompt_tokens
            counts[1] += stats.output_tokens
            if stats.finished:
                bar.update(len(stats.finished))
            now = time.perf_counter()
            if now - counts[2] > 0.2 or bar.n == total:
                el = max(now - start, 1e-9)
                bar.set_postfix_str(f"input: {counts[0] / el:,.0f} tok/s, "
                                    f"output: {counts[1] / el:,.0f} tok/s", refresh=False)
                counts[2] = now
        return on_step

    def _close_progress(self) -> None:
        bar = getattr(self, "_bar", None)
        if bar is not None:
            bar.close()
            self._bar = None


def _attention_backend(choice: str | None, device: torch.device, kv_dtype: torch.dtype
                       ) -> TorchPagedAttention:
    """The attention backend for `attention_backend` (validated by the caller)."""
    fits_kernel = device.type == "cpu" and kv_dtype in cpu_kernel.KV_DTYPES
    if choice == "cpu_kernel":
        if not fits_kernel:
            raise ValueError("attention_backend='cpu_kernel' needs device='cpu' and a float32 "
                             f"or bfloat16 KV cache, got device={device.type!r}, KV dtype "
                             f"{kv_dtype}")
        try:
            return TorchPagedAttention(device, decode_kernel=cpu_kernel.load())
        except cpu_kernel.KernelUnavailable as e:
            raise RuntimeError(f"attention_backend='cpu_kernel': {e}") from e
    kernel = cpu_kernel.try_load() if choice is None and fits_kernel else None
    return TorchPagedAttention(device, decode_kernel=kernel)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


def _gpu_kv_budget(device: torch.device, utilization: float) -> int | None:
    """Bytes the KV pool may take on a GPU: utilization x total, minus what is in use now,
    minus a reserve for activations (10% of the remainder, at least 512 MiB)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    budget = utilization * total - (total - free)
    return int(budget - max(512 << 20, 0.1 * budget))


def _eos_ids(config, generation_config, tokenizer) -> list[int]:
    """Every id that ends a sequence as EOS: the config's, the generation config's (e.g. a chat
    model's end-of-turn id) and the tokenizer's, as HF generate and vLLM do."""
    ids: list[int] = []
    sources = [getattr(config, "eos_token_id", None),
               getattr(generation_config, "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None)]
    for eos in sources:
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return ids

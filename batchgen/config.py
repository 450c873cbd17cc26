"""Engine settings (validated in one place) and the KV capacity maths (blocks from memory,
max concurrency, the start-up capacity line)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

import torch

from batchgen.attention.registry import BACKENDS
from batchgen.checks import (
    check,
    check_choice,
    check_flag,
    check_int,
    check_seed,
    is_int,
    is_number,
)
from batchgen.defaults import DEFAULT_CPU_KV_BYTES, KV_CACHE_DTYPES
from batchgen.kv.block_manager import blocks_for
from batchgen.kv.cache import kv_cache_bytes, num_blocks_for_memory
from batchgen.kv.swap import GIB, host_available_bytes, host_blocks_for
from batchgen.model.loader import KVGeometry
from batchgen.quantization.methods import NAMES as QUANTIZATION_NAMES
from batchgen.sampling.logprobs_mode import check_logprobs_mode
from batchgen.vllm_args import ALIASES, split_engine_args

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# async_scheduling=None: this environment variable ("1" or "0"), else the default (measured:
# benchmarks/host_overhead.py --overlap, RESULTS.md)
ASYNC_SCHEDULING_ENV = "BATCHGEN_ASYNC_SCHEDULING"
ASYNC_SCHEDULING_DEFAULT = False
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_IMAGES_PER_PROMPT = 1  # vLLM's: more need limit_mm_per_prompt={"image": N}
# The shortest useful sequence: one prompt token and one generated token. A max_model_len or a
# pool under it could run no request at all.
MIN_MODEL_LEN = 2
PREEMPTION_MODES = ("recompute", "swap")
# vLLM's engine arguments batchgen accepts, with the values it can honour: the model code is
# always transformers' own; workers are batchgen's ("mp"), none ("uni", one rank) or the
# caller's world ("external_launcher"); quantization: the served methods (batchgen/quantization).
MODEL_IMPLS = ("auto", "transformers")
EXECUTOR_BACKENDS = (None, "mp", "uni", "external_launcher")
QUANTIZATIONS = (None, *QUANTIZATION_NAMES)
# vLLM's: the order waiting requests start in ("priority": lower `priority` first, ties by
# arrival); what a generation_config of "vllm" means (the model's generation_config.json
# ignored); the structured-outputs backends that mean xgrammar, the one batchgen runs.
SCHEDULING_POLICIES = ("fcfs", "priority")
GENERATION_CONFIGS = ("auto", "vllm")
STRUCTURED_BACKENDS = ("auto", "xgrammar")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default max_logprobs
_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


@dataclass
class EngineConfig:
    """The LLM's engine arguments; constructing one checks them all (ValueError naming the
    argument) before anything is loaded or allocated."""

    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.90
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    attention_backend: str | None = None
    seed: int | None = 0
    enforce_eager: bool = True  # CUDA graphs for decode steps when False (GPU + FlashInfer)
    tensor_parallel_size: int = 1  # vLLM's name: ranks (processes, GPUs) the weights split over
    trust_remote_code: bool = False
    swap_space: float = 0  # GiB of host RAM per rank for swapped-out blocks (vLLM's unit)
    preemption_mode: str | None = None  # None: "swap" when swap_space > 0, else "recompute"
    logprobs_mode: str = "raw_logprobs"  # vLLM's: what sample and prompt logprobs report
    enable_sleep_mode: bool = False  # sleep()/wake_up() free and restore the KV pool
    model_impl: str = "auto"
    distributed_executor_backend: str | None = None
    quantization: str | None = None
    async_scheduling: bool | None = None  # None: $BATCHGEN_ASYNC_SCHEDULING, else the default
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # most (prompt) logprobs a request asks; -1: any
    disable_log_stats: bool = True  # False: per-request metrics and aggregate stats
    enable_chunked_prefill: bool | None = None  # accepted: prefills are always chunked here
    scheduling_policy: str = "fcfs"
    generation_config: str = "auto"
    structured_outputs_config: object = None  # vLLM's: a dict (or its config) of defaults
    chat_template: str | None = None  # LLM.chat's template when a call gives none
    skip_tokenizer_init: bool = False  # vLLM's: no tokenizer (token-id prompts, no text)

    @classmethod
    def from_llm_args(cls, given: dict[str, Any], extra: dict[str, Any]) -> EngineConfig:
        """The config of `LLM(**given, **extra)`: its parameters that are this class's fields
        (vLLM's None defaults as batchgen's; kv_cache_memory_bytes, vLLM's name, as
        kv_cache_memory), and `extra`, vLLM's other engine arguments, checked (accepted at
        their defaults, refused otherwise; aliases taken)."""
        names = {f.name for f in fields(cls)}
        args = {k: v for k, v in given.items() if k in names}
        for name in ("block_size", "max_num_seqs", "enable_prefix_caching",
                     "gpu_memory_utilization"):
            if args.get(name, 0) is None:
                args[name] = _DEFAULTS[name]
        check_int(given.get("kv_cache_memory_bytes"), "kv_cache_memory_bytes", allow_none=True)
        args["kv_cache_memory"] = _kv_cache_memory(given.get("kv_cache_memory"),
                                                   given.get("kv_cache_memory_bytes"))
        for name, value in split_engine_args(extra).items():  # vLLM's spelling, checked so
            check_int(value, next(k for k, v in ALIASES.items() if v == name), allow_none=True)
            args[name] = value
        return cls(**args)
    limit_mm_per_prompt: dict[str, int] | None = None  # vLLM's: images per prompt (1)
    mm_processor_kwargs: dict[str, Any] | None = None  # the processor's call, every prompt

    def __post_init__(self) -> None:
        check_int(self.block_size, "block_size")
        check_int(self.max_num_seqs, "max_num_seqs")
        check(self.max_model_len is None or (is_int(self.max_model_len)
                                             and self.max_model_len >= MIN_MODEL_LEN),
              "max_model_len", f"None or an integer >= {MIN_MODEL_LEN} (room for a prompt "
              "token and a generated one)", self.max_model_len)
        for name in ("max_num_batched_tokens", "kv_cache_memory", "num_kv_blocks"):
            check_int(getattr(self, name), name, allow_none=True)
        check(is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
              "gpu_memory_utilization", "a number in (0, 1]", self.gpu_memory_utilization)
        check_choice(self.kv_cache_dtype, "kv_cache_dtype", KV_CACHE_DTYPES)
        check_choice(self.attention_backend, "attention_backend", (None, *BACKENDS))
        check_flag(self.enable_prefix_caching, "enable_prefix_caching")
        check_flag(self.enforce_eager, "enforce_eager")
        check_flag(self.trust_remote_code, "trust_remote_code")
        check_int(self.tensor_parallel_size, "tensor_parallel_size")
        self.seed = check_seed(self.seed)
        self._check_swap()
        self._check_vllm_args()
        self._check_async()
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS

    def _check_vllm_args(self) -> None:
        """vLLM's arguments that batchgen honours or refuses (ValueError with the choices)."""
        check_logprobs_mode(self.logprobs_mode)
        check_flag(self.enable_sleep_mode, "enable_sleep_mode")
        check_choice(self.model_impl, "model_impl", MODEL_IMPLS)
        check_choice(self.distributed_executor_backend, "distributed_executor_backend",
                     EXECUTOR_BACKENDS)
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend 'uni' runs one rank: it needs "
                             f"tensor_parallel_size=1, got {self.tensor_parallel_size}")
        check_choice(self.quantization, "quantization", QUANTIZATIONS)
        check(is_int(self.max_logprobs) and self.max_logprobs >= -1, "max_logprobs",
              "an integer >= -1 (-1: the whole vocabulary)", self.max_logprobs)
        check_flag(self.disable_log_stats, "disable_log_stats")
        check_flag(self.skip_tokenizer_init, "skip_tokenizer_init")
        check(self.enable_chunked_prefill in (None, True, False), "enable_chunked_prefill",
              "None, True or False", self.enable_chunked_prefill)
        check_choice(self.scheduling_policy, "scheduling_policy", SCHEDULING_POLICIES)
        check_choice(self.generation_config, "generation_config", GENERATION_CONFIGS)
        _check_structured_config(self.structured_outputs_config)
        check(self.chat_template is None or isinstance(self.chat_template, str), "chat_template",
              "None or a Jinja template string", self.chat_template)
        self._check_images()

    @property
    def disable_any_whitespace(self) -> bool:
        """structured_outputs_config's engine-wide switch: JSON constraints of every request
        compile without free whitespace (a request may also ask it alone)."""
        return bool(_structured_fields(self.structured_outputs_config).get(
            "disable_any_whitespace", False))

    def _check_images(self) -> None:
        """limit_mm_per_prompt: {"image": N >= 0} (vLLM's; images per prompt, 1 when not
        given); mm_processor_kwargs: a dict of the processor's keyword arguments."""
        limit = self.limit_mm_per_prompt
        check(limit is None or (isinstance(limit, dict) and set(limit) <= {"image"}
                                and all(is_int(v) and v >= 0 for v in limit.values())),
              "limit_mm_per_prompt", "None or a dict {'image': N} with N >= 0", limit)
        kw = self.mm_processor_kwargs
        check(kw is None or (isinstance(kw, dict) and all(isinstance(k, str) for k in kw)),
              "mm_processor_kwargs", "None or a dict of keyword arguments", kw)

    @property
    def image_limit(self) -> int:
        """The most images one prompt may hold."""
        return int((self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGES_PER_PROMPT))

    def _check_async(self) -> None:
        """async_scheduling (the next step planned while this one's forward runs): True or
        False; None takes $BATCHGEN_ASYNC_SCHEDULING ("1" or "0"; how CI runs the parity
        tests both ways), else ASYNC_SCHEDULING_DEFAULT, and is False with tensor
        parallelism (whose runner must run on the main thread: it holds Ctrl-C there)."""
        if self.async_scheduling is None:
            env = os.environ.get(ASYNC_SCHEDULING_ENV)
            check_choice(env, ASYNC_SCHEDULING_ENV, (None, "0", "1"))
            wanted = ASYNC_SCHEDULING_DEFAULT if env is None else env == "1"
            self.async_scheduling = wanted and self.tensor_parallel_size == 1
        check_flag(self.async_scheduling, "async_scheduling")
        check(not (self.async_scheduling and self.tensor_parallel_size > 1), "async_scheduling",
              "False with tensor_parallel_size > 1", self.async_scheduling)

    def _check_swap(self) -> None:
        """swap_space: GiB >= 0 that the host can give (every rank has its own host pool);
        preemption_mode: "swap" needs a host pool, and is the default when there is one."""
        check(is_number(self.swap_space) and self.swap_space >= 0, "swap_space",
              "a number of GiB >= 0", self.swap_space)
        check_choice(self.preemption_mode, "preemption_mode", (None, *PREEMPTION_MODES))
        if self.preemption_mode is None:
            self.preemption_mode = "swap" if self.swap_space > 0 else "recompute"
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode 'swap' needs swap_space > 0 (GiB of host RAM "
                             "to swap preempted blocks into), got swap_space=0")
        want, avail = self.swap_space * GIB * self.tensor_parallel_size, host_available_bytes()
        if want > avail:
            raise ValueError(f"swap_space must fit the host's available memory "
                             f"({avail / GIB:.1f} GiB for {self.tensor_parallel_size} rank(s)), "
                             f"got {self.swap_space} GiB")


def _kv_cache_memory(kv_cache_memory: int | None, kv_cache_memory_bytes: int | None
                     ) -> int | None:
    """The KV byte budget, given under either name (kv_cache_memory_bytes is vLLM's)."""
    if kv_cache_memory is not None and kv_cache_memory_bytes is not None:
        raise ValueError("pass kv_cache_memory or kv_cache_memory_bytes (vLLM's name for "
                         "it), not both")
    return kv_cache_memory if kv_cache_memory is not None else kv_cache_memory_bytes


def _structured_fields(value: object) -> dict[str, Any]:
    """vLLM's StructuredOutputsConfig as a dict of its fields (a dict, or an object's)."""
    if value is None:
        return {}
    fields = value if isinstance(value, dict) else getattr(value, "__dict__", None)
    check(isinstance(fields, dict), "structured_outputs_config",
          "None, a dict or a StructuredOutputsConfig", type(value).__name__)
    return fields


def _check_structured_config(value: object) -> None:
    """vLLM's StructuredOutputsConfig: its backend must be xgrammar's ("auto" picks it),
    `disable_any_whitespace` a bool (vLLM's engine-wide switch: every request's JSON without
    free whitespace), its other fields their defaults (per-request StructuredOutputsParams
    set properties here)."""
    for key, v in _structured_fields(value).items():
        if key == "backend":
            check_choice(v, "structured_outputs_config.backend", STRUCTURED_BACKENDS)
        elif key == "disable_any_whitespace":
            check_flag(v, "structured_outputs_config.disable_any_whitespace")
        else:
            check(not v, f"structured_outputs_config.{key}", "its default (set it per request "
                  "in StructuredOutputsParams)", v)


# batchgen's values where vLLM's LLM passes None ("the engine's default")
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    bytes_per_token: int  # β
    num_host_blocks: int = 0  # the swap pool's blocks (swap_space)
    state_bytes_per_seq: int = 0  # models with state mixers: per sequence, not per token
    state_slots: int = 0  # state slots preallocated (max_num_seqs; more when n/beams need)
    quantization: str | None = None  # the weights' method (vLLM's name), None: full precision

    @property
    def num_tokens(self) -> int:
        return self.block_size * self.num_blocks

    def max_concurrency(self, seq_len: int) -> float:
        """How many sequences of `seq_len` tokens fit at once."""
        return self.num_blocks / math.ceil(seq_len / self.block_size)

    def capacity_line(self, max_model_len: int) -> str:
        """The start-up log line that capacity planning needs."""
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.bytes_per_token} bytes/token (beta), "
                f"{self.num_tokens * self.bytes_per_token / 2**20:.1f} MiB; maximum concurrency "
                f"for {max_model_len} tokens per request: {self.max_concurrency(max_model_len):.2f}x"
                + self.state_line() + self.host_line()
                + (f"; weights quantized: {self.quantization}" if self.quantization else ""))

    def state_line(self) -> str:
        """The mixers' state pool's part of the capacity line (empty without one)."""
        if not self.state_bytes_per_seq:
            return ""
        total = self.state_bytes_per_seq * self.state_slots
        return (f"; mixer state: {self.state_bytes_per_seq} bytes/sequence (any length), "
                f"{self.state_slots} slots = {total / 2**20:.1f} MiB")

    def host_line(self) -> str:
        """The swap pool's part of the capacity line (empty without one)."""
        if not self.num_host_blocks:
            return ""
        tokens = self.num_host_blocks * self.block_size
        return (f"; host swap pool: {self.num_host_blocks} blocks = {tokens} tokens, "
                f"{tokens * self.bytes_per_token / 2**20:.1f} MiB of CPU RAM")


@dataclass(frozen=True)
class KVLayout:
    """What a token costs in the pool and how long a sequence may be, from the config alone."""

    kv_dtype: torch.dtype
    bytes_per_token: int  # β = L · H_kv · (d_k + d_v) · b
    target_len: int  # max_model_len wanted (the pool may cap it)


@dataclass(frozen=True)
class PoolSize:
    """The pool's blocks, the max_model_len it allows, and the host swap pool's blocks."""

    num_blocks: int
    max_model_len: int
    num_host_blocks: int


def kv_layout(cfg: EngineConfig, geo: KVGeometry, model_dtype: torch.dtype) -> KVLayout:
    """The pool's dtype, β for this rank's KV heads (`geo`), and the wanted max_model_len."""
    kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, model_dtype)
    beta = kv_cache_bytes(geo.num_kv_layers, geo.num_kv_heads, geo.head_dim, 1,
                          torch.empty((), dtype=kv_dtype).element_size(),
                          head_dim_v=geo.stored_v_width)
    return KVLayout(kv_dtype, beta, target_max_model_len(cfg, geo.max_position_embeddings))


def size_pool(cfg: EngineConfig, layout: KVLayout, device: torch.device,
              gpu_free_bytes: int | None, swap_space: float) -> PoolSize:
    """The one pool-sizing function (LLM and `batchgen kv-plan`): blocks from num_kv_blocks,
    kv_cache_memory, the GPU's free bytes or the CPU default; max_model_len within them; the
    host pool's blocks in `swap_space` GiB. ValueError naming the setting that cannot fit."""
    num_blocks = pool_blocks(cfg, layout.bytes_per_token, device, gpu_free_bytes,
                             layout.target_len)
    max_len = fit_max_model_len(cfg, layout.target_len, num_blocks * cfg.block_size)
    host = host_pool_blocks(swap_space, cfg.block_size, layout.bytes_per_token)
    return PoolSize(num_blocks, max_len, host)


def cpu_kv_budget() -> int:
    """The CPU pool's default bytes: 4 GiB (vLLM's CPU default), at most half the host's
    available memory (a trainer in the same process needs the rest)."""
    return min(DEFAULT_CPU_KV_BYTES, host_available_bytes() // 2)


def pool_blocks(cfg: EngineConfig, bytes_per_token: int, device: torch.device,
                gpu_free_bytes: int | None, model_max_len: int) -> int:
    """Blocks in the pool: given outright, from a byte budget, or from the device's free memory
    (GPU) / the CPU default (`cpu_kv_budget`), never more than the engine could ever use:
    max_num_seqs sequences of max_model_len tokens (and the scratch block)."""
    bs = cfg.block_size
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_memory is not None:
        blocks = num_blocks_for_memory(cfg.kv_cache_memory, bs, bytes_per_token)
        if blocks < 1:
            raise ValueError(f"kv_cache_memory must hold at least one block of {bs} tokens "
                             f"({bs * bytes_per_token} bytes), got {cfg.kv_cache_memory}")
        return blocks
    budget = gpu_free_bytes if device.type == "cuda" else cpu_kv_budget()
    one_seq = blocks_for(model_max_len, bs) * bs * bytes_per_token
    if budget is None or budget < one_seq:
        if device.type != "cuda":
            raise ValueError(
                f"one sequence of max_model_len={model_max_len} tokens needs {one_seq} bytes "
                f"of KV cache, and the CPU default is {budget} (4 GiB, at most half the "
                "available memory); lower max_model_len, or pass kv_cache_memory")
        raise ValueError(
            f"one sequence of max_model_len={model_max_len} tokens needs {one_seq} bytes of KV "
            f"cache, and gpu_memory_utilization={cfg.gpu_memory_utilization} leaves "
            f"{max(budget or 0, 0)} after the weights and activations; raise "
            "gpu_memory_utilization, lower max_model_len, or pass kv_cache_memory")
    useful = cfg.max_num_seqs * blocks_for(model_max_len, bs) + 1
    return max(1, min(num_blocks_for_memory(budget, bs, bytes_per_token), useful))


def host_pool_blocks(swap_space: float, block_size: int, bytes_per_token: int) -> int:
    """Blocks of the host swap pool: the whole blocks in swap_space GiB, at least one when a
    pool is asked for (0 without one)."""
    if not swap_space:
        return 0
    n = host_blocks_for(swap_space, block_size, bytes_per_token)
    if n < 1:
        raise ValueError(f"swap_space must hold at least one block of {block_size} tokens "
                         f"({block_size * bytes_per_token} bytes), got {swap_space} GiB")
    return n


def target_max_model_len(cfg: EngineConfig, model_max: int | None) -> int:
    """The longest sequence wanted: max_model_len if given (within the model's positions), else
    the model's max_position_embeddings (or a default when the config names none)."""
    if cfg.max_model_len is None:
        return model_max or DEFAULT_MAX_MODEL_LEN
    if model_max and cfg.max_model_len > model_max:
        raise ValueError(f"max_model_len must be <= the model's max_position_embeddings "
                         f"({model_max}), got {cfg.max_model_len}")
    return cfg.max_model_len


def fit_max_model_len(cfg: EngineConfig, target: int, capacity: int) -> int:
    """max_model_len within a pool of `capacity` tokens: a given one must fit it; the default
    is capped by it."""
    if cfg.max_model_len is not None and cfg.max_model_len > capacity:
        raise ValueError(f"max_model_len ({cfg.max_model_len}) must fit the KV pool of "
                         f"{capacity} tokens; raise num_kv_blocks / kv_cache_memory")
    if capacity < MIN_MODEL_LEN:
        raise ValueError(f"the KV pool holds {capacity} token: too few for a prompt and one "
                         "generated token; raise num_kv_blocks / kv_cache_memory")
    return min(target, capacity)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype: the model's for "auto"; fp8 is float8 e4m3fn, fp8_e5m2 float8 e5m2
    (β halves vs 16 bits)."""
    return model_dtype if kv_cache_dtype == "auto" else _KV_DTYPES[kv_cache_dtype]

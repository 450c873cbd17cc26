"""LLM: the user-facing entry point (vLLM's offline API over batchgen's paged engine)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from batchgen import cpu_allocator
from batchgen.attention.backend import AttentionBackend
from batchgen.attention.registry import (
    BackendQuery,
    Candidate,
    backend_candidates,
    build_backend,
    reserved_bytes,
)
from batchgen.attention.spec import AttentionSpec, probe_specs
from batchgen.config import (
    CacheConfig,
    EngineConfig,
    fit_max_model_len,
    host_pool_blocks,
    kv_cache_torch_dtype,
    pool_blocks,
    target_max_model_len,
)
from batchgen.distributed.driver import start_group
from batchgen.distributed.plan import check_tp, rank_device
from batchgen.distributed.runner import TPRunner
from batchgen.distributed.worker import ShardSetup
from batchgen.engine.batch import PersistentBatch
from batchgen.engine.engine import Engine
from batchgen.engine.scheduler import Scheduler, StepStats
from batchgen.engine.sequence import SequenceGroup
from batchgen.kinds import BEAMS, SAMPLES, RequestKind
from batchgen.kv.block_manager import BlockManager, blocks_for
from batchgen.kv.cache import KVCache, kv_cache_bytes
from batchgen.kv.swap import HostPool
from batchgen.log import configure_logging, logger
from batchgen.model import loader
from batchgen.model.cuda_graphs import GRAPH_POOL_BYTES, CudaGraphCapturer, capture_sizes
from batchgen.model.inputs import StepInputs
from batchgen.model.loader import KVGeometry
from batchgen.model.profile import device_kv_budget
from batchgen.model.runner import ModelRunner
from batchgen.outputs import BeamSearchOutput, KVStats, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams
from batchgen.prompts import Conversation, PromptType
from batchgen.requests import Limits, RequestBuilder
from batchgen.results import ResultBuilder
from batchgen.sampling.sampler import Sampler
from batchgen.sampling.stop import StopFactory

# CPU steps are padded to a multiple of this many tokens (and at least this many logits rows):
# small-M GEMMs and the scalar tails of elementwise kernels round differently, and padding keeps
# each row's result independent of its batch.
CPU_MIN_BATCH_ROWS = 16
# A stream holds this many times max_num_seqs sequences waiting: enough to refill the batch as
# requests finish, few enough that a dataset of any size needs bounded memory.
STREAM_WINDOW = 2


@dataclass(frozen=True)
class _Plan:
    """What LLM.__init__ settles before the weights load."""

    path: Path
    tokenizer_path: Path
    config: PretrainedConfig
    geo: KVGeometry
    kv_dtype: torch.dtype
    backends: list[Candidate]  # best first
    target_len: int  # max_model_len wanted (the pool may cap it)
    beta: int  # KV bytes per token
    num_blocks: int | None  # None: a GPU pool sized once the weights are in


class LLM:
    """A local HF model folder served from one paged KV pool.

    >>> llm = LLM("path/to/model")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None,
                 block_size: int = 16, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, kv_cache_dtype: str = "auto",
                 gpu_memory_utilization: float = 0.90, kv_cache_memory: int | None = None,
                 kv_cache_memory_bytes: int | None = None, num_kv_blocks: int | None = None,
                 dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                 attention_backend: str | None = None, seed: int | None = 0,
                 enforce_eager: bool = True, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, swap_space: float = 0,
                 preemption_mode: str | None = None) -> None:
        configure_logging()
        cfg = EngineConfig(
            block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory=_kv_cache_memory(kv_cache_memory, kv_cache_memory_bytes),
            num_kv_blocks=num_kv_blocks, attention_backend=attention_backend, seed=seed,
            enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
            trust_remote_code=trust_remote_code, swap_space=swap_space,
            preemption_mode=preemption_mode)
        # Everything that can be checked is checked before the weights load.
        plan = self._check_before_loading(model, tokenizer, dtype, device, cfg)
        self._tp = start_group(self, plan.path, plan.config, self.dtype, self.device, cfg)
        try:
            specs = self._load(plan, cfg)
            backend = self._allocate(cfg, plan, specs)
            self._assemble(cfg, backend)
        except BaseException:
            if self._tp is not None:
                self._tp.shutdown()
            raise
        if not cfg.enforce_eager:
            self._capture_graphs(cfg)
        self._log_capacity()

    def _check_before_loading(self, model: str | os.PathLike,
                              tokenizer: str | os.PathLike | None, dtype: str | torch.dtype,
                              device: str | torch.device | None, cfg: EngineConfig) -> _Plan:
        """Everything the weights are not needed for: the folders, the config, the weights'
        headers, device, dtypes, attention backend, max_model_len and (unless it is sized
        from the GPU memory left once the weights are in) the pool."""
        path = loader.resolve_model_dir(model)
        tok_path = (path if tokenizer is None else
                    loader.resolve_model_dir(tokenizer, "tokenizer", loader.TOKENIZER_FILES))
        self.model_path = path
        config = loader.load_config(path, cfg.trust_remote_code)
        loader.check_weights(path)
        dev = _resolve_device(device)  # under TP, rank 0's: the first visible GPU
        self.device = dev if cfg.tensor_parallel_size == 1 else rank_device(dev, 0)
        check_tp(config, cfg.tensor_parallel_size, self.device)
        self.dtype = loader.resolve_dtype(dtype, config)
        kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, self.dtype)
        geo = loader.kv_geometry(config)  # this rank's share of the KV heads:
        geo = replace(geo, num_kv_heads=geo.num_kv_heads // cfg.tensor_parallel_size)
        backends = backend_candidates(cfg.attention_backend, BackendQuery(
            self.device, self.dtype, kv_dtype, geo.head_dim))
        target_len = target_max_model_len(cfg, geo.max_position_embeddings)
        beta = kv_cache_bytes(geo.num_layers, geo.num_kv_heads, geo.head_dim, 1,
                              torch.empty((), dtype=kv_dtype).element_size())
        num_blocks = (None if self._pool_from_gpu_memory(cfg)
                      else self._size_pool(cfg, beta, target_len, None))
        return _Plan(path, tok_path, config, geo, kv_dtype, backends, target_len, beta,
                     num_blocks)

    def _load(self, plan: _Plan, cfg: EngineConfig) -> list[AttentionSpec]:
        """Tokenizer, weights, generation config and EOS ids; returns the attention specs
        probed from the loaded model."""
        if self.device.type == "cpu":
            cpu_allocator.tune_host_allocator()  # reuse freed activations (see the module)
        self.tokenizer = loader.load_tokenizer(plan.tokenizer_path, cfg.trust_remote_code)
        self.model = loader.load_model(plan.path, plan.config, self.dtype, self.device,
                                       cfg.trust_remote_code, cfg.tensor_parallel_size)
        self.config = plan.config
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.generation_config = loader.load_generation_config(plan.path)
        self.eos_token_ids = _eos_ids(plan.config, self.generation_config, self.tokenizer)
        return probe_specs(self.model, plan.geo.num_layers, self.device)

    def _allocate(self, cfg: EngineConfig, plan: _Plan, specs: list[AttentionSpec]
                  ) -> AttentionBackend:
        """The pool (a GPU one sized now, from the memory the weights left) and the attention
        backend over it."""
        num_blocks = plan.num_blocks
        self._reserve: tuple[int, int] | None = None
        if num_blocks is None:
            self._reserve = self._gpu_reserve(cfg, plan, specs)
            num_blocks = self._size_pool(cfg, plan.beta, plan.target_len,
                                         self._gpu_budget(cfg, sum(self._reserve)))
        geo = plan.geo
        host_blocks = host_pool_blocks(cfg.swap_space, cfg.block_size, plan.beta)
        self.cache_config = CacheConfig(cfg.block_size, num_blocks, plan.beta, host_blocks)
        self.cache = KVCache(geo.num_layers, num_blocks, cfg.block_size, geo.num_kv_heads,
                             geo.head_dim, plan.kv_dtype, self.device)
        self.host_pool = HostPool(self.cache, host_blocks) if host_blocks else None
        self.attention_backend, backend = build_backend(
            plan.backends, specs, self.cache, self._max_step_tokens(cfg),
            insisted=cfg.attention_backend is not None)
        if self._tp is not None:  # every worker builds the same over its local heads
            max_pages = cfg.max_num_seqs * blocks_for(self.max_model_len, cfg.block_size)
            self._tp.send(("setup", ShardSetup(
                num_blocks, cfg.block_size, plan.kv_dtype, self.attention_backend,
                self._max_step_tokens(cfg), (cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                             max_pages, self._min_rows()), host_blocks)))
        return backend

    def _assemble(self, cfg: EngineConfig, backend: AttentionBackend) -> None:
        """The engine around the loaded model and the allocated pool: block manager,
        persistent batch, scheduler, runner with its step buffers, sampler, request
        builder."""
        num_blocks, bs = self.cache.num_blocks, cfg.block_size
        max_blocks = blocks_for(self.max_model_len, bs)
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.block_manager = BlockManager(num_blocks, bs, cfg.enable_prefix_caching,
                                          self.cache_config.num_host_blocks)
        batch = PersistentBatch(cfg.max_num_seqs, self.vocab_size, max_blocks,
                                self.eos_token_ids, self.device)
        self.scheduler = Scheduler(self.block_manager, batch, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, cfg.preemption_mode)
        inputs = StepInputs(cfg.max_num_batched_tokens, cfg.max_num_seqs,
                            cfg.max_num_seqs * max_blocks, bs, self.cache.scratch_block,
                            self._min_rows(), self.device)
        runner = ModelRunner(self.model, self.cache, backend, inputs, self.host_pool)
        self.engine = Engine(self.scheduler, runner if self._tp is None
                             else TPRunner(runner, self._tp), Sampler())
        stops = StopFactory(self.tokenizer, self.eos_token_ids)
        self.requests = RequestBuilder(
            self.tokenizer, Limits(self.max_model_len, self.vocab_size, bs, num_blocks,
                                   cfg.max_num_seqs, cfg.max_num_batched_tokens),
            stops, self.eos_token_ids, cfg.seed, _pad_id(self.config, self.generation_config))
        self.results = ResultBuilder(self.tokenizer, stops)
        self._last_stats = KVStats(num_blocks, bs, 0, 0, 0, 0, 0,
                                   self.cache_config.num_host_blocks)
        self._busy = False

    def _capture_graphs(self, cfg: EngineConfig) -> None:
        """Decode steps as CUDA graphs, where the device and the backend allow them."""
        if self._tp is not None:
            logger.info("enforce_eager=False: CUDA graphs are not captured with "
                        "tensor_parallel_size > 1 (every rank would need them); running eagerly")
            return
        if self.device.type != "cuda" or not self.engine.runner.backend.supports_graphs:
            logger.info("enforce_eager=False: CUDA graphs need a GPU and a backend that "
                        "supports them (here %s, %s); running eagerly", self.device.type,
                        self.attention_backend)
            return
        pages = cfg.max_num_seqs * blocks_for(self.max_model_len, cfg.block_size)
        self.engine.runner.use_graphs(capture_sizes(cfg.max_num_seqs), pages,
                                      CudaGraphCapturer())

    def _pool_from_gpu_memory(self, cfg: EngineConfig) -> bool:
        """Whether the pool is sized from the GPU memory the weights leave (once they are in),
        not from num_kv_blocks, kv_cache_memory or the CPU default."""
        return (self.device.type == "cuda" and cfg.num_kv_blocks is None
                and cfg.kv_cache_memory is None)

    def _gpu_reserve(self, cfg: EngineConfig, plan: _Plan, specs: list[AttentionSpec]
                     ) -> tuple[int, int]:
        """GPU bytes to keep beyond the pool: the attention backend's (workspace, wrappers,
        output; per captured size with graphs) and, with graphs, the graph pool's allowance."""
        sizes = None if cfg.enforce_eager else capture_sizes(cfg.max_num_seqs)
        backend = reserved_bytes(plan.backends, specs, self._max_step_tokens(cfg), sizes)
        graphs = sizes is not None and any(entry.graphs for entry, _ in plan.backends)
        return backend, GRAPH_POOL_BYTES if graphs else 0

    def _log_capacity(self) -> None:
        """The capacity line, the GPU memory kept beyond the pool when the pool was sized from
        free memory, and the backend."""
        logger.info(self.cache_config.capacity_line(self.max_model_len))
        if self._tp is not None:
            k, pool = self._tp.spec.tp_size, self.cache.pool.nbytes / 2**20
            logger.info("tensor parallel: %d ranks, each with that pool over %d of the model's "
                        "%d KV heads (%.1f MiB per rank, %.1f MiB in all)", k,
                        self.cache.num_kv_heads, self.cache.num_kv_heads * k, pool, pool * k)
        if self._reserve is not None:
            backend, graphs = self._reserve
            logger.info("GPU memory kept beyond the pool when sizing it: %.1f MiB for the "
                        "attention backend, %.1f MiB for the CUDA graph pool",
                        backend / 2**20, graphs / 2**20)
        logger.info("attention backend: %s", self.attention_backend)

    def _gpu_budget(self, cfg: EngineConfig, other: int) -> int:
        """Bytes for the GPU pool, after profiling the largest step's activations (on every
        rank under tensor parallelism: the pool is what the tightest rank can hold)."""
        profile = (self._max_step_tokens(cfg), cfg.max_num_seqs)
        if self._tp is not None:
            self._tp.send(("profile", *profile, cfg.gpu_memory_utilization, other))
        budget = device_kv_budget(self.model, *profile, self.device, cfg.gpu_memory_utilization,
                                  other)
        return budget if self._tp is None else self._tp.min_over_ranks(budget)

    def _min_rows(self) -> int:
        """The multiple a CPU step's rows are padded to (batch invariance); none on a GPU."""
        return CPU_MIN_BATCH_ROWS if self.device.type == "cpu" else 0

    def _max_step_tokens(self, cfg: EngineConfig) -> int:
        """The most query tokens one step can have, padding included (the backends size their
        buffers by it)."""
        m = self._min_rows()
        return -(-max(cfg.max_num_batched_tokens, m) // m) * m if m else cfg.max_num_batched_tokens

    def _size_pool(self, cfg: EngineConfig, beta: int, target_len: int, gpu_free: int | None
                   ) -> int:
        """Blocks in the pool; sets max_model_len, which must fit it."""
        num_blocks = pool_blocks(cfg, beta, self.device, gpu_free, target_len)
        self.max_model_len = fit_max_model_len(cfg, target_len, num_blocks * cfg.block_size)
        if self.max_model_len < target_len:
            logger.info("max_model_len = %d, what the KV pool holds (the model allows %d)",
                        self.max_model_len, target_len)
        return num_blocks

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Iterable[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. Without
        `sampling_params`, the model's generation_config.json defaults apply (as in vLLM)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._run(prompts, sampling_params, SAMPLES, use_tqdm)

    def generate_stream(self, prompts: PromptType | Iterable[PromptType],
                        sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
                        use_tqdm: bool | Callable[..., tqdm] = True
                        ) -> Iterator[tuple[int, RequestOutput]]:
        """`generate` over any iterable of prompts (a generator of unknown length too), yielding
        `(input index, RequestOutput)` as each request finishes. New requests are pulled as
        others finish, so the batch stays full while only a window of a few x max_num_seqs
        sequences is held; outputs equal `generate`'s. `sampling_params`: one for all, or an
        iterable aligned with the prompts. A bad prompt raises when it is reached; outputs
        already yielded stay valid. Closing the stream early frees every block."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._run_stream(prompts, sampling_params, SAMPLES, use_tqdm)

    def beam_search_stream(self, prompts: PromptType | Iterable[PromptType],
                           params: BeamSearchParams | Iterable[BeamSearchParams],
                           use_tqdm: bool | Callable[..., tqdm] = True
                           ) -> Iterator[tuple[int, BeamSearchOutput]]:
        """`beam_search` as a stream of `(input index, BeamSearchOutput)`, like
        `generate_stream`."""
        return self._run_stream(prompts, params, BEAMS, use_tqdm)

    def beam_search(self, prompts: PromptType | Iterable[PromptType],
                    params: BeamSearchParams | Seq[BeamSearchParams],
                    use_tqdm: bool | Callable[..., tqdm] = True) -> list[BeamSearchOutput]:
        """Beam search inside the engine with HF `generate(num_beams=...)` semantics; all
        prompts run at once under continuous batching and beams share prefix blocks."""
        return self._run(prompts, params, BEAMS, use_tqdm)

    def chat(self, messages: Conversation | Seq[Conversation],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `chat`: each conversation (or the one given) through the chat template, then
        `generate`. `chat_template_content_format` is accepted for vLLM's signature (content
        is passed to the template as given)."""
        prompts = self.requests.render_chat(messages, chat_template, add_generation_prompt,
                                            continue_final_message, tools, chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config.json (the sampling fields it sets
        away from their defaults, as vLLM reads them), else vLLM's defaults."""
        diff = self.generation_config.to_diff_dict() if self.generation_config else {}
        keys = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
        params = {k: diff[k] for k in keys if diff.get(k) is not None}
        if diff.get("max_new_tokens") is not None:
            params["max_tokens"] = diff["max_new_tokens"]
        return SamplingParams(**params)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (False, doing nothing, while a call is running)."""
        return self.block_manager.reset_prefix_cache()

    def kv_stats(self) -> KVStats:
        """KV figures of the last call: pool size, peak blocks in use, COW copies, preemptions,
        and with a swap pool its size, swap-outs, swap-ins and blocks moved."""
        return self._last_stats

    def get_tokenizer(self):
        """The HF tokenizer prompts are encoded with (None for a folder without one)."""
        return self.tokenizer

    def __repr__(self) -> str:
        c = self.cache_config
        return (f"LLM(model={str(self.model_path)!r}, dtype={self.dtype}, "
                f"device={str(self.device)!r}, attention_backend={self.attention_backend!r}, "
                f"kv_cache={c.num_blocks} blocks x {c.block_size} tokens "
                f"({self.cache.dtype}), max_model_len={self.max_model_len})")

    # ---- running a call -----------------------------------------------------------------------
    def _run(self, prompts: Any, params: Any, kind: RequestKind,
             use_tqdm: bool | Callable[..., tqdm]) -> list[Any]:
        """A batch call: every prompt validated first, all run, outputs in input order."""
        groups = self.requests.build(prompts, params, kind)
        for _ in self._stream(groups, len(groups), use_tqdm):
            pass
        return [kind.output(self.results, g) for g in groups]

    def _run_stream(self, prompts: Any, params: Any, kind: RequestKind,
                    use_tqdm: bool | Callable[..., tqdm]) -> Iterator[tuple[int, Any]]:
        """A stream call: groups built lazily from any iterable of prompts; (input index,
        output) as each finishes."""
        groups = self.requests.stream(prompts, params, kind, self.scheduler.max_num_seqs)
        for g in self._stream(groups, _length(prompts), use_tqdm):
            yield g.index, kind.output(self.results, g)

    def _stream(self, groups: Iterable[SequenceGroup], total: int | None,
                use_tqdm: bool | Callable[..., tqdm]) -> Iterator[SequenceGroup]:
        """Run groups (validated, or built lazily) and yield each as it finishes; the call's
        KV figures are recorded when it ends. One call at a time: a second one while a stream
        is open would mix their requests. An error or a Ctrl-C aborts the call and leaves the
        pool whole (see Engine.stream)."""
        if self._busy:
            raise RuntimeError("this LLM is already running a call (an open generate_stream "
                               "or beam_search_stream): finish or close it first")
        self._busy = True
        bm, sched = self.block_manager, self.scheduler
        bm.reset_stats()
        first = _counters(sched)
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=total, desc="Processed prompts", dynamic_ncols=True,
                       disable=not use_tqdm)
        try:
            yield from self.engine.stream(groups, STREAM_WINDOW * sched.max_num_seqs,
                                          _progress(bar, bm) if use_tqdm else None)
        finally:
            self._busy = False
            bar.close()
            preempts, prompt, outs, ins = (b - a for a, b in zip(first, _counters(sched)))
            self._last_stats = KVStats(
                bm.num_blocks, bm.block_size, bm.peak_blocks_in_use, bm.cow_copies,
                preempts, bm.prefix_hit_tokens, prompt, bm.num_host_blocks, outs, ins,
                bm.blocks_swapped_out, bm.blocks_swapped_in)


def _length(prompts: object) -> int | None:
    """How many prompts, when the iterable knows (for the progress bar's total)."""
    if isinstance(prompts, (str, dict)):
        return 1
    try:
        return len(prompts)  # type: ignore[arg-type]
    except TypeError:
        return None


def _counters(sched: Scheduler) -> tuple[int, int, int, int]:
    """The scheduler's running totals a call's KV figures are differences of."""
    return (sched.num_preemptions, sched.prompt_tokens_computed, sched.num_swap_outs,
            sched.num_swap_ins)


def _progress(bar: tqdm, bm: BlockManager):
    """A step callback that advances the bar by finished prompts and shows token rates (and,
    with a swap pool, the host blocks holding swapped-out groups)."""
    start = time.perf_counter()
    counts = [0, 0, 0.0]  # input tokens, output tokens, last postfix time

    def on_step(stats: StepStats) -> None:
        counts[0] += stats.prompt_tokens
        counts[1] += stats.output_tokens
        if stats.finished:
            bar.update(len(stats.finished))
        now = time.perf_counter()
        if now - counts[2] > 0.2 or bar.n == bar.total:
            el = max(now - start, 1e-9)
            host = (f", host KV: {bm.host_blocks_in_use()}/{bm.num_host_blocks} blocks"
                    if bm.num_host_blocks else "")
            bar.set_postfix_str(f"input: {counts[0] / el:,.0f} tok/s, "
                                f"output: {counts[1] / el:,.0f} tok/s{host}", refresh=False)
            counts[2] = now
    return on_step


def _kv_cache_memory(kv_cache_memory: int | None, kv_cache_memory_bytes: int | None
                     ) -> int | None:
    """The KV byte budget, given under either name (kv_cache_memory_bytes is vLLM's)."""
    if kv_cache_memory is not None and kv_cache_memory_bytes is not None:
        raise ValueError("pass kv_cache_memory or kv_cache_memory_bytes (vLLM's name for "
                         "it), not both")
    return kv_cache_memory if kv_cache_memory is not None else kv_cache_memory_bytes


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    return dev


def _pad_id(config, generation_config) -> int | None:
    """The pad id HF generate uses: the generation config's, else the model config's (None:
    HF falls back to the first EOS id)."""
    for source in (generation_config, config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return None


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

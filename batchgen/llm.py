"""LLM: the user-facing entry point (vLLM's offline API over batchgen's paged engine).

Building is the factory's (factory.py: plan before the weights, load, size, assemble) through an
executor (this process, or a tensor-parallel group: distributed/executor.py); this class is the
user's API and one call at a time over the assembled engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm.auto import tqdm

from batchgen.calls import length, model_name, queue_order, waves
from batchgen.config import EngineConfig
from batchgen.distributed.executor import start_executor
from batchgen.engine.sequence import SequenceGroup
from batchgen.factory import assemble, log_capacity, plan_engine
from batchgen.kinds import BEAMS, SAMPLES, RequestKind
from batchgen.log import configure_logging
from batchgen.lora.seam import LoRASeam
from batchgen.model.shared import weights_version
from batchgen.model.sleep import SleepState
from batchgen.model.weights import load_weights
from batchgen.outputs import BeamSearchOutput, KVStats, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams
from batchgen.progress import CallMeter
from batchgen.prompts import Conversation, PromptType
from batchgen.runners import RunnerDispatch
from batchgen.sampling.logprobs_mode import check_beam_mode
from batchgen.speculative.seam import SpecSeam
from batchgen.stats import Metric, StatsRecorder
from batchgen.vllm_args import check_call_args

logger = logging.getLogger("batchgen")

# A stream holds this x max_num_seqs sequences waiting: the batch refills, memory stays bounded.
STREAM_WINDOW = 2


class LLM(metaclass=RunnerDispatch):
    """A local HF model folder (or a loaded transformers model, as it is) on one paged KV pool;
    a pooling model's folder (`runner="pooling"`, or "auto" on one) gives a PoolingLLM.

    >>> LLM("path/to/model").generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str | os.PathLike | torch.nn.Module, *,
                 tokenizer: str | os.PathLike | None = None, block_size: int | None = 16,
                 max_model_len: int | None = None, max_num_seqs: int | None = 256,
                 max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool | None = True, kv_cache_dtype: str = "auto",
                 gpu_memory_utilization: float | None = 0.90, kv_cache_memory: int | None = None,
                 kv_cache_memory_bytes: int | None = None, num_kv_blocks: int | None = None,
                 dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
                 attention_backend: str | None = None, seed: int | None = 0,
                 enforce_eager: bool = True, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, swap_space: float = 0,
                 preemption_mode: str | None = None, logprobs_mode: str = "raw_logprobs",
                 enable_sleep_mode: bool = False, model_impl: str = "auto",
                 distributed_executor_backend: str | None = None,
                 quantization: str | None = None, async_scheduling: bool | None = None,
                 max_logprobs: int = 20, disable_log_stats: bool = True,
                 enable_chunked_prefill: bool | None = None, scheduling_policy: str = "fcfs",
                 generation_config: str = "auto", structured_outputs_config: Any = None,
                 chat_template: str | None = None, skip_tokenizer_init: bool = False,
                 limit_mm_per_prompt: dict[str, int] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None, **engine_args: Any) -> None:
        configure_logging()  # seams' args: batchgen/lora, /speculative; vLLM's others: default or refused
        lora, spec = LoRASeam.take(engine_args), SpecSeam.take(engine_args, tensor_parallel_size)
        cfg = EngineConfig.from_llm_args(locals(), engine_args)
        self.chat_template = chat_template
        self._use_generation_config = generation_config == "auto"
        self._stats = None if disable_log_stats else StatsRecorder(model_name(model))
        plan = spec.checked(plan_engine(model, tokenizer, dtype, device, cfg))  # before weights
        self.model_path, self.device, self.dtype = plan.path, plan.device, plan.dtype
        self.config, self.quantization = plan.config, plan.quant  # quantization: None = full
        self._executor = start_executor(self, plan, cfg)
        try:
            built = assemble(plan, cfg, self._executor)
        except BaseException as e:
            failure = self._executor.start_failed(e)  # stops the executor
            if failure is e:
                raise
            raise failure from e
        self.model, self.tokenizer = (parts := built.parts).model, built.parts.tokenizer
        self.generation_config, self.eos_token_ids = parts.generation_config, parts.eos_token_ids
        self.vocab_size, self.max_model_len = parts.vocab_size, built.max_model_len
        self.cache, self.cache_config = built.cache, built.cache_config
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.attention_backend = built.attention_backend
        self.engine, self.requests, self.results = built.engine, built.requests, built.results
        c, self._busy, self._spec = self.cache_config, False, spec.attach(self)
        self._last_stats = KVStats(c.num_blocks, c.block_size, 0, 0, 0, 0, 0, c.num_host_blocks)
        k, spmd = self._executor.tp_size, cfg.distributed_executor_backend == "external_launcher"
        # load_weights and sleep reach every rank only when each runs this code itself
        # (external_launcher; each frees its own shards), else they are refused under TP
        self._sleep = SleepState(self.cache, self.model, plan.module is None, built.state_pool)
        self._sleep_mode, self._tp_size = cfg.enable_sleep_mode, 1 if spmd else k
        self._weights_version, self._lora = weights_version(self.model), lora.attach(self)
        log_capacity(built, self._executor.tp_size)

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Iterable[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True, *,
                 lora_request: Any = None, priority: int | Seq[int] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. Without `sampling_params`, the
        model's generation_config.json defaults apply (as in vLLM). `priority` (one for all or
        one per prompt) orders admission under "priority", lower first; it changes no output."""
        check_call_args("generate", mm_processor_kwargs=mm_processor_kwargs,
                        tokenization_kwargs=tokenization_kwargs)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._run(prompts, sampling_params, SAMPLES, use_tqdm, priority, lora_request)

    def generate_stream(self, prompts: PromptType | Iterable[PromptType],
                        sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
                        use_tqdm: bool | Callable[..., tqdm] = True, *, lora_request: Any = None
                        ) -> Iterator[tuple[int, RequestOutput]]:
        """`generate` over any iterable of prompts (a generator of unknown length too), yielding
        `(input index, RequestOutput)` as each request finishes. New requests are pulled as
        others finish, so the batch stays full while only a window of a few x max_num_seqs
        sequences is held; outputs equal `generate`'s. `sampling_params`: one for all, or an
        iterable aligned with the prompts; `lora_request` as `generate`'s, a list by input index.
        A bad prompt raises when reached (outputs yielded stay valid); closing early frees all."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._run_stream(prompts, sampling_params, SAMPLES, use_tqdm, lora_request)

    def beam_search_stream(self, prompts: PromptType | Iterable[PromptType],
                           params: BeamSearchParams | Iterable[BeamSearchParams],
                           use_tqdm: bool | Callable[..., tqdm] = True, *, lora_request: Any = None
                           ) -> Iterator[tuple[int, BeamSearchOutput]]:
        """`beam_search` as a stream of `(input index, BeamSearchOutput)`."""
        check_beam_mode(self.engine.sampler.logprobs_mode)
        return self._run_stream(prompts, params, BEAMS, use_tqdm, lora_request)

    def beam_search(self, prompts: PromptType | Iterable[PromptType],
                    params: BeamSearchParams | Seq[BeamSearchParams],
                    use_tqdm: bool | Callable[..., tqdm] = True, *, lora_request: Any = None,
                    concurrency_limit: int | None = None,
                    priority: int | Seq[int] | None = None) -> list[BeamSearchOutput]:
        """Beam search inside the engine with HF `generate(num_beams=...)` semantics; all
        prompts run at once under continuous batching and beams share prefix blocks. Each
        token's logprob is the value the search ranked (the beam's processed log-probability);
        a logits `logprobs_mode` is refused. `concurrency_limit=k` (vLLM's) runs the prompts k
        at a time, in input order, each batch to its end before the next starts."""
        check_beam_mode(self.engine.sampler.logprobs_mode)
        if use_tqdm and concurrency_limit is not None:
            logger.warning("beam_search: no progress bar with concurrency_limit (as in vLLM)")
            use_tqdm = False
        cut = waves(prompts, params, priority, concurrency_limit, lora_request)
        return [o for p, bp, pr, lo in cut for o in self._run(p, bp, BEAMS, use_tqdm, pr, lo)]

    def chat(self, messages: Conversation | Seq[Conversation],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, lora_request: Any = None,
             priority: int | Seq[int] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `chat` (its parameters in its order): each conversation (or the one given)
        through the chat template (`chat_template`, else the LLM's, else its tokenizer's: an
        adapter's own under `lora_request`), then `generate` (content passed as given)."""
        check_call_args("chat", mm_processor_kwargs=mm_processor_kwargs,
                        tokenization_kwargs=tokenization_kwargs)
        tokenizers = self._lora.chat_tokenizers(lora_request, self.tokenizer)
        prompts = self.requests.render_chat(messages, chat_template or self.chat_template,
                                            add_generation_prompt, continue_final_message, tools,
                                            chat_template_kwargs, tokenizers)
        return self.generate(prompts, sampling_params, use_tqdm, priority=priority,
                             lora_request=lora_request)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config.json (the sampling fields it sets
        away from their defaults, as vLLM reads them), else vLLM's defaults (always, with
        `LLM(generation_config="vllm")`)."""
        return SamplingParams.from_generation_config(
            self.generation_config if self._use_generation_config else None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     lora_request: Any = None) -> set[str]:
        """New values for the model's parameters by HF names (wrappers' prefixes stripped, cast
        to the model's dtype), or with `lora_request` for that loaded adapter's A and B by PEFT
        names, copied in place; the prefix cache is reset. Returns the names loaded."""
        self._check_idle("load_weights", 1 if lora_request is None else None)  # adapters: any TP
        self._sleep.check_awake(weights_only=True)
        loaded = (load_weights(self.model, weights) if lora_request is None
                  else self._lora.load_weights(lora_request, weights))
        self.reset_prefix_cache()
        return loaded

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (needs enable_sleep_mode=True): free the KV pool; level 1 offloads
        the weights batchgen loaded to CPU RAM, level 2 discards them (a shared model's are
        never touched). The prefix cache is reset."""
        self._check_idle("sleep", 1)
        if not self._sleep_mode:
            raise ValueError("sleep needs LLM(..., enable_sleep_mode=True)")
        self.reset_prefix_cache()
        self._sleep.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: `tags` from ("weights", "kv_cache"), all when None."""
        self._sleep.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether anything is asleep."""
        return bool(self._sleep.asleep)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (False, doing nothing, while a call runs)."""
        return self.engine.kv.reset_prefix_cache()

    def kv_stats(self) -> KVStats:
        """KV figures of the last call (pool, peak blocks, COW copies, preemptions, swaps)."""
        return self._last_stats

    def get_metrics(self) -> list[Metric]:
        """vLLM's aggregate metrics since the LLM was built (`LLM(disable_log_stats=False)`;
        batchgen/stats.py lists them) as Counter / Gauge / Histogram records."""
        if self._stats is None:
            raise ValueError("get_metrics needs LLM(..., disable_log_stats=False)")
        return self._stats.metrics()

    def get_tokenizer(self, lora_request: Any = None):
        """The HF tokenizer (None if none, or skip_tokenizer_init); an adapter's own, if any."""
        return self._lora.tokenizer(lora_request, self.tokenizer)

    def __repr__(self) -> str:
        c = self.cache_config
        return (f"LLM(model={str(self.model_path)!r}, dtype={self.dtype}, device="
                f"{str(self.device)!r}, attention_backend={self.attention_backend!r}, kv_cache="
                f"{c.num_blocks} blocks x {c.block_size} tokens ({self.cache.dtype}), "
                f"max_model_len={self.max_model_len})")

    # ---- running a call -----------------------------------------------------------------------
    def _run(self, prompts: Any, params: Any, kind: RequestKind,
             use_tqdm: bool | Callable[..., tqdm], priority: Any = None,
             lora_request: Any = None) -> list[Any]:
        """A batch call: every prompt validated first, all run, outputs in input order; under
        the priority policy queued lower `priority` first (ties in input order), as vLLM's."""
        groups = self._lora.build(self.requests, prompts, params, kind, lora_request)
        order = queue_order(groups, priority, self.engine.scheduler.by_priority)
        for _ in self._stream(order, len(groups), use_tqdm):
            pass
        return [kind.output(self.results, g) for g in groups]

    def _run_stream(self, prompts: Any, params: Any, kind: RequestKind,
                    use_tqdm: bool | Callable[..., tqdm], lora_request: Any = None
                    ) -> Iterator[tuple[int, Any]]:
        """A stream call: groups built lazily; (input index, output) as each finishes."""
        groups = self._lora.build_stream(self.requests, prompts, params, kind,
                                         self.engine.scheduler.max_num_seqs, lora_request)
        for g in self._stream(groups, length(prompts), use_tqdm):
            yield g.index, kind.output(self.results, g)

    def _stream(self, groups: Iterable[SequenceGroup], total: int | None,
                use_tqdm: bool | Callable[..., tqdm]) -> Iterator[SequenceGroup]:
        """Run groups (validated, or built lazily) and yield each as it finishes; the call's
        KV figures are recorded when it ends. One call at a time: a second one while a stream
        is open would mix their requests. An error or a Ctrl-C aborts the call and leaves the
        pool whole (see Engine.stream)."""
        self._check_idle("a call", None)
        self._sleep.check_awake()
        if (version := weights_version(self.model)) != self._weights_version:
            self.reset_prefix_cache()  # the weights changed (a trainer's step): stale K/V
            self._weights_version = version
        self._busy = True
        meter, stats = CallMeter(self.engine, total, use_tqdm), self._stats
        on_step = meter.on_step
        if stats is not None:  # disable_log_stats=False: metrics per request and in all
            groups, on_step = stats.attach(self.engine, groups, on_step)
        try:
            yield from self.engine.stream(groups, STREAM_WINDOW * self.engine.scheduler.max_num_seqs,
                                          on_step)
        finally:
            self._busy, self._last_stats = False, meter.close()
            if stats is not None:
                stats.end_call(self._last_stats)

    def _check_idle(self, what: str, tp_limit: int | None) -> None:
        """RuntimeError while a call runs; ValueError above `tp_limit` ranks."""
        if self._busy:
            raise RuntimeError(f"this LLM is already running a call (an open generate_stream "
                               f"or beam_search_stream): finish or close it before {what}")
        if tp_limit is not None and self._tp_size > tp_limit:
            raise ValueError(f"{what} needs tensor_parallel_size=1 or distributed_executor_"
                             f"backend='external_launcher' (got {self._tp_size} ranks that "
                             "batchgen started)")

"""LLM: the user-facing entry point (vLLM's offline API over batchgen's paged engine).

Building is the factory's (factory.py: plan before the weights, load, size, assemble) through an
executor (this process, or a tensor-parallel group: distributed/executor.py); this class is the
user's API and one call at a time over the assembled engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm.auto import tqdm

from batchgen.config import EngineConfig
from batchgen.distributed.executor import start_executor
from batchgen.engine.sequence import SequenceGroup
from batchgen.factory import assemble, log_capacity, plan_engine
from batchgen.kinds import BEAMS, SAMPLES, RequestKind
from batchgen.log import configure_logging
from batchgen.model.shared import weights_version
from batchgen.model.sleep import SleepState
from batchgen.model.weights import load_weights
from batchgen.outputs import BeamSearchOutput, KVStats, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams
from batchgen.progress import CallMeter
from batchgen.prompts import Conversation, PromptType
from batchgen.sampling.logprobs_mode import check_beam_mode

# A stream holds this many times max_num_seqs sequences waiting: enough to refill the batch as
# requests finish, few enough that a dataset of any size needs bounded memory.
STREAM_WINDOW = 2


class LLM:
    """A local HF model folder (or a loaded transformers model, used as it is) served from one
    paged KV pool.

    >>> llm = LLM("path/to/model")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str | os.PathLike | torch.nn.Module, *,
                 tokenizer: str | os.PathLike | None = None, block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 kv_cache_dtype: str = "auto", gpu_memory_utilization: float = 0.90,
                 kv_cache_memory: int | None = None, kv_cache_memory_bytes: int | None = None,
                 num_kv_blocks: int | None = None, dtype: str | torch.dtype = "auto",
                 device: str | torch.device | None = None, attention_backend: str | None = None,
                 seed: int | None = 0, enforce_eager: bool = True, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, swap_space: float = 0,
                 preemption_mode: str | None = None, logprobs_mode: str = "raw_logprobs",
                 enable_sleep_mode: bool = False, model_impl: str = "auto",
                 distributed_executor_backend: str | None = None, quantization: str | None = None,
                 async_scheduling: bool | None = None,
                 limit_mm_per_prompt: dict[str, int] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> None:
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
            preemption_mode=preemption_mode, logprobs_mode=logprobs_mode,
            enable_sleep_mode=enable_sleep_mode, model_impl=model_impl,
            distributed_executor_backend=distributed_executor_backend, quantization=quantization,
            async_scheduling=async_scheduling, limit_mm_per_prompt=limit_mm_per_prompt,
            mm_processor_kwargs=mm_processor_kwargs)
        plan = plan_engine(model, tokenizer, dtype, device, cfg)  # every check before weights
        self.model_path, self.device, self.dtype = plan.path, plan.device, plan.dtype
        self.config = plan.config
        self._executor = start_executor(self, plan, cfg)
        try:
            built = assemble(plan, cfg, self._executor)
        except BaseException as e:
            failure = self._executor.start_failed(e)  # stops the executor
            if failure is e:
                raise
            raise failure from e
        parts = built.parts
        self.model, self.tokenizer = parts.model, parts.tokenizer
        self.generation_config, self.eos_token_ids = parts.generation_config, parts.eos_token_ids
        self.vocab_size = parts.vocab_size
        self.cache, self.cache_config = built.cache, built.cache_config
        self.max_model_len = built.max_model_len
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.attention_backend = built.attention_backend
        self.engine, self.requests, self.results = built.engine, built.requests, built.results
        c, self._busy = self.cache_config, False
        self._last_stats = KVStats(c.num_blocks, c.block_size, 0, 0, 0, 0, 0, c.num_host_blocks)
        k, spmd = self._executor.tp_size, cfg.distributed_executor_backend == "external_launcher"
        # load_weights and sleep reach every rank only when each runs this code itself
        # (external_launcher; each frees its own shards), else they are refused under TP
        self._sleep = SleepState(self.cache, self.model, plan.module is None, built.state_pool)
        self._sleep_mode, self._tp_size = cfg.enable_sleep_mode, 1 if spmd else k
        self._weights_version = weights_version(self.model)
        log_capacity(built, self._executor.tp_size)

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
        check_beam_mode(self.engine.sampler.logprobs_mode)
        return self._run_stream(prompts, params, BEAMS, use_tqdm)

    def beam_search(self, prompts: PromptType | Iterable[PromptType],
                    params: BeamSearchParams | Seq[BeamSearchParams],
                    use_tqdm: bool | Callable[..., tqdm] = True) -> list[BeamSearchOutput]:
        """Beam search inside the engine with HF `generate(num_beams=...)` semantics; all
        prompts run at once under continuous batching and beams share prefix blocks. Each
        token's logprob is the value the search ranked (the beam's processed log-probability);
        a logits `logprobs_mode` is refused."""
        check_beam_mode(self.engine.sampler.logprobs_mode)
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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """New values for the model's parameters, by their HF names (trainer wrappers' prefixes
        stripped, cast to the model's dtype), copied in place; then the prefix cache is reset
        (its K/V came from the old weights). Returns the names loaded."""
        self._check_idle("load_weights", 1)
        self._sleep.check_awake(weights_only=True)
        loaded = load_weights(self.model, weights)
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
        """Restore what sleep freed: `tags` from ("weights", "kv_cache"), both when None."""
        self._sleep.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether anything is asleep."""
        return bool(self._sleep.asleep)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (False, doing nothing, while a call is running)."""
        return self.engine.kv.reset_prefix_cache()

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
        groups = self.requests.stream(prompts, params, kind, self.engine.scheduler.max_num_seqs)
        for g in self._stream(groups, _length(prompts), use_tqdm):
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
        meter = CallMeter(self.engine, total, use_tqdm)
        try:
            yield from self.engine.stream(groups, STREAM_WINDOW * self.engine.scheduler.max_num_seqs,
                                          meter.on_step)
        finally:
            self._busy = False
            self._last_stats = meter.close()

    def _check_idle(self, what: str, tp_limit: int | None) -> None:
        """RuntimeError while a call runs; ValueError above `tp_limit` ranks."""
        if self._busy:
            raise RuntimeError(f"this LLM is already running a call (an open generate_stream "
                               f"or beam_search_stream): finish or close it before {what}")
        if tp_limit is not None and self._tp_size > tp_limit:
            raise ValueError(f"{what} needs tensor_parallel_size=1 or distributed_executor_"
                             f"backend='external_launcher' (got {self._tp_size} ranks that "
                             "batchgen started)")


def _length(prompts: object) -> int | None:
    """How many prompts, when the iterable knows (for the progress bar's total)."""
    if isinstance(prompts, (str, dict)):
        return 1
    try:
        return len(prompts)  # type: ignore[arg-type]
    except TypeError:
        return None


def _kv_cache_memory(kv_cache_memory: int | None, kv_cache_memory_bytes: int | None
                     ) -> int | None:
    """The KV byte budget, given under either name (kv_cache_memory_bytes is vLLM's)."""
    if kv_cache_memory is not None and kv_cache_memory_bytes is not None:
        raise ValueError("pass kv_cache_memory or kv_cache_memory_bytes (vLLM's name for "
                         "it), not both")
    return kv_cache_memory if kv_cache_memory is not None else kv_cache_memory_bytes

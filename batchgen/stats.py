"""Request metrics and aggregate stats, vLLM's `disable_log_stats=False`: each request's
RequestMetrics (arrival, queued, scheduled, first and last token, token counts, preemptions)
and the LLM's running totals, read as vLLM's metric records by `LLM.get_metrics()`.

Nothing here runs unless the LLM was built with `disable_log_stats=False` (the default is
True, as in vLLM's `LLM`): the call path then only tests one attribute per call. When on,
the recorder reads the running groups once per step (first tokens), the finished ones (their
last token), and the pool's use."""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from batchgen.engine.engine import Engine
from batchgen.engine.output_processor import StepStats
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import SequenceGroup
from batchgen.outputs import KVStats, RequestMetrics

# Bucket bounds (seconds) of the latency histograms, a subset of vLLM's.
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class Metric:
    """One metric record, as vLLM's `vllm.v1.metrics.reader.Metric`: a name and labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A total that only grows."""

    value: int


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations by bucket (upper bound -> cumulative count, "+Inf" holds all)."""

    count: int
    sum: float
    buckets: dict[str, int]


@dataclass
class _Latencies:
    """One latency's observations, kept as the histogram's counts."""

    count: int = 0
    total: float = 0.0
    below: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.below[i] += 1

    def record(self, name: str, labels: dict[str, str]) -> Histogram:
        buckets = {str(b): n for b, n in zip(LATENCY_BUCKETS, self.below)}
        buckets["+Inf"] = self.count
        return Histogram(name, labels, self.count, self.total, buckets)


class StatsRecorder:
    """The LLM's stats while `disable_log_stats=False`: attaches a RequestMetrics to each
    request as it enters a call, stamps its first and last token from the steps, and sums
    the calls into totals (vLLM's counters and gauges)."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.prompt_tokens = self.generation_tokens = self.preemptions = 0
        self.prefix_queries = self.prefix_hits = self.prompt_tokens_computed = 0
        self.spec = [0, 0, 0]  # speculative drafts, draft tokens, accepted tokens
        self.finished: Tally[str] = Tally()
        self.kv_usage = self.peak_kv_usage = 0.0
        self.seconds = 0.0  # wall time of the calls
        self.running = self.waiting = 0
        self.ttft, self.e2e, self.queue = _Latencies(), _Latencies(), _Latencies()
        self._start = 0.0  # the running call's perf_counter at its start

    def attach(self, engine: Engine, groups: Iterable[SequenceGroup],
               on_step: Callable[[StepStats], None]
               ) -> tuple[Iterator[SequenceGroup], Callable[[StepStats], None]]:
        """A call starts: its groups get metrics as they are pulled, its steps are read."""
        self._start = time.perf_counter()
        bm = engine.kv.block_manager
        return (self.arrive(groups),
                self.stepper(engine.scheduler, bm.num_blocks, bm.num_blocks_in_use, on_step))

    def arrive(self, groups: Iterable[SequenceGroup]) -> Iterator[SequenceGroup]:
        """The call's groups, each with a fresh RequestMetrics as it is pulled."""
        for g in groups:  # pulled by the engine right as it queues them
            g.metrics = RequestMetrics(num_prompt_tokens=g.num_prompt_tokens)
            g.metrics.queued()
            yield g

    def stepper(self, scheduler: Scheduler, num_blocks: int, blocks_in_use: Callable[[], int],
                on_step: Callable[[StepStats], None]) -> Callable[[StepStats], None]:
        """`on_step` preceded by this recorder's look at the step."""

        planned = [time.monotonic()]  # when the step was planned: the last one's end

        def step(stats: StepStats) -> None:
            now = time.monotonic()
            for g in scheduler.running:
                m = g.metrics
                if m is not None and not m.first_token_ts:
                    m.scheduled(planned[0])
                    if _generated(g):
                        m.first_token(now)
            for g in stats.finished:
                self._finish(g, now)
            self.kv_usage = blocks_in_use() / max(num_blocks, 1)
            self.peak_kv_usage = max(self.peak_kv_usage, self.kv_usage)
            self.running, self.waiting = len(scheduler.running), len(scheduler.waiting)
            planned[0] = now
            on_step(stats)

        return step

    def _finish(self, g: SequenceGroup, now: float) -> None:
        """A finished request: its metrics completed and counted."""
        m = g.metrics
        if m is None:
            return
        m.scheduled(now)  # a request that finished in the step that admitted it
        m.first_token(now)  # (its first token was its last)
        m.last_token_ts = now
        m.num_generation_tokens = sum(len(s.token_ids) - g.num_prompt_tokens for s in g.seqs)
        m.num_preemptions = g.num_preemptions
        m.num_cached_tokens = g.num_cached_tokens or 0
        self.prompt_tokens += m.num_prompt_tokens
        self.prefix_queries += m.num_prompt_tokens
        self.generation_tokens += m.num_generation_tokens
        reasons = [s.finish_reason for s in g.seqs if getattr(s, "finish_reason", None)]
        self.finished[reasons[0] if reasons else "stop"] += 1
        self.ttft.add(m.first_token_latency)
        self.e2e.add(m.e2e_latency)
        self.queue.add(m.queued_time)

    def end_call(self, kv: KVStats) -> None:
        """Add a finished (or aborted) call's pool figures and wall time."""
        seconds = time.perf_counter() - self._start
        self.preemptions += kv.preemptions
        self.prefix_hits += kv.prefix_hit_tokens
        self.prompt_tokens_computed += kv.prompt_tokens_computed
        self.spec = [a + b for a, b in zip(self.spec, (kv.spec_drafts, kv.spec_draft_tokens,
                                                          kv.spec_accepted_tokens))]
        self.seconds += seconds

    def metrics(self) -> list[Metric]:
        """The totals as vLLM's metric records (its names; batchgen's own under batchgen:)."""
        lab = self.labels
        out: list[Metric] = [
            Counter("vllm:prompt_tokens", lab, self.prompt_tokens),
            Counter("vllm:generation_tokens", lab, self.generation_tokens),
            Counter("vllm:num_preemptions", lab, self.preemptions),
            Counter("vllm:prefix_cache_queries", lab, self.prefix_queries),
            Counter("vllm:prefix_cache_hits", lab, self.prefix_hits),
            Gauge("vllm:kv_cache_usage_perc", lab, self.kv_usage),
            Gauge("vllm:num_requests_running", lab, self.running),
            Gauge("vllm:num_requests_waiting", lab, self.waiting),
            Counter("batchgen:prompt_tokens_computed", lab, self.prompt_tokens_computed),
            Gauge("batchgen:peak_kv_cache_usage_perc", lab, self.peak_kv_usage),
            Gauge("batchgen:generation_tokens_per_second", lab,
                  self.generation_tokens / self.seconds if self.seconds else 0.0),
            self.ttft.record("vllm:time_to_first_token_seconds", lab),
            self.e2e.record("vllm:e2e_request_latency_seconds", lab),
            self.queue.record("vllm:request_queue_time_seconds", lab),
        ]
        out += [Counter(f"vllm:spec_decode_num_{name}", lab, v) for name, v in
                zip(("drafts", "draft_tokens", "accepted_tokens"), self.spec)]
        for reason in ("stop", "length", "abort"):
            out.append(Counter("vllm:request_success", {**lab, "finished_reason": reason},
                               self.finished[reason]))
        return out


def _generated(g: SequenceGroup) -> bool:
    """Whether any of the group's sequences has a generated token."""
    n = g.num_prompt_tokens
    return any(len(s.token_ids) > n for s in g.seqs)

"""One call's figures: the progress bar (finished prompts, token rates, the host pool in use)
and the call's KVStats, from the engine's counters and the steps' StepStats.

The bar's rates are what they say: "input" is prompt tokens computed per second of the steps
that computed them (prefill throughput; absent until a step has), "output" is generated tokens
per second of the call; small rates keep two significant digits (a slow model's 0.4 tok/s is
not shown as 0)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from batchgen.engine.engine import Engine
from batchgen.engine.output_processor import StepStats
from batchgen.outputs import KVStats


class CallMeter:
    """Opened when a call starts (a new measurement window), fed every step, closed when the
    call ends (finished or not) with the call's KVStats."""

    def __init__(self, engine: Engine, total: int | None, use_tqdm: bool | Callable[..., Any],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """`clock`: seconds (the tests' fake clock times steps exactly)."""
        self.engine = engine
        self.bm = engine.kv.block_manager
        engine.kv.reset_stats()
        self._first = self._counters()
        self.prompt_tokens = self.output_tokens = 0
        self.prefill_seconds = 0.0  # wall time of the steps that computed prompt tokens
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        self.bar = make_bar(total=total, desc="Processed prompts", dynamic_ncols=True,
                            disable=not use_tqdm)
        self.shows = bool(use_tqdm)
        self.clock = clock
        self._start = self._shown = self._stepped = clock()

    def _counters(self) -> tuple[int, ...]:
        s, spec = self.engine.scheduler, getattr(self.engine, "spec", None)
        return (s.num_preemptions, s.num_swap_outs, s.num_swap_ins, s.num_lora_loads,
                *(spec.counters() if spec is not None else (0, 0, 0)))

    def on_step(self, stats: StepStats) -> None:
        """Count the step's tokens (and, when it computed prompt tokens, its time); advance
        the bar by finished prompts and, at most five times a second, show the rates (and,
        with a swap pool, the host blocks in use)."""
        now = self.clock()
        if stats.prompt_tokens:
            self.prefill_seconds += now - self._stepped
        self._stepped = now
        self.prompt_tokens += stats.prompt_tokens
        self.output_tokens += stats.output_tokens
        if not self.shows:
            return
        bar = self.bar
        if stats.finished:
            bar.update(len(stats.finished))
        if now - self._shown > 0.2 or bar.n == bar.total:
            bar.set_postfix_str(self.postfix(now), refresh=False)
            self._shown = now

    def postfix(self, now: float) -> str:
        """The rates known so far ("input" once a step computed prompt tokens), and the host
        pool in use when there is one."""
        parts = []
        if self.prompt_tokens and self.prefill_seconds > 0:
            parts.append(f"input: {format_rate(self.prompt_tokens / self.prefill_seconds)} "
                         "tok/s")
        parts.append(f"output: {format_rate(self.output_tokens / max(now - self._start, 1e-9))}"
                     " tok/s")
        bm = self.bm
        if bm.num_host_blocks:
            parts.append(f"host KV: {bm.host_blocks_in_use()}/{bm.num_host_blocks} blocks")
        return ", ".join(parts)

    def close(self) -> KVStats:
        """The call's KV figures (the bar closed)."""
        self.bar.close()
        bm = self.bm
        preempts, outs, ins, loras, *spec = (b - a for a, b in zip(self._first,
                                                                   self._counters()))
        state = self.engine.kv.state
        return KVStats(bm.num_blocks, bm.block_size, bm.peak_blocks_in_use, bm.cow_copies,
                       preempts, bm.prefix_hit_tokens, self.prompt_tokens, bm.num_host_blocks,
                       outs, ins, bm.blocks_swapped_out, bm.blocks_swapped_in,
                       state.bytes_per_seq if state else 0, state.peak if state else 0, loras,
                       *spec)


def format_rate(rate: float) -> str:
    """A rate for the bar: whole numbers (thousands separated) from 10 up, else two
    significant digits."""
    return f"{rate:,.0f}" if rate >= 9.95 else f"{rate:.2g}"

"""One call's figures: the progress bar (finished prompts, token rates, the host pool in use)
and the call's KVStats, from the engine's counters and the steps' StepStats."""

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

    def __init__(self, engine: Engine, total: int | None, use_tqdm: bool | Callable[..., Any]
                 ) -> None:
        self.engine = engine
        self.bm = engine.kv.block_manager
        engine.kv.reset_stats()
        self._first = self._counters()
        self.prompt_tokens = self.output_tokens = 0
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        self.bar = make_bar(total=total, desc="Processed prompts", dynamic_ncols=True,
                            disable=not use_tqdm)
        self.shows = bool(use_tqdm)
        self._start = self._shown = time.perf_counter()

    def _counters(self) -> tuple[int, int, int]:
        s = self.engine.scheduler
        return s.num_preemptions, s.num_swap_outs, s.num_swap_ins

    def on_step(self, stats: StepStats) -> None:
        """Count the step's tokens; advance the bar by finished prompts and, at most five
        times a second, show token rates (and, with a swap pool, the host blocks in use)."""
        self.prompt_tokens += stats.prompt_tokens
        self.output_tokens += stats.output_tokens
        if not self.shows:
            return
        bar = self.bar
        if stats.finished:
            bar.update(len(stats.finished))
        now = time.perf_counter()
        if now - self._shown > 0.2 or bar.n == bar.total:
            el = max(now - self._start, 1e-9)
            bm = self.bm
            host = (f", host KV: {bm.host_blocks_in_use()}/{bm.num_host_blocks} blocks"
                    if bm.num_host_blocks else "")
            bar.set_postfix_str(f"input: {self.prompt_tokens / el:,.0f} tok/s, "
                                f"output: {self.output_tokens / el:,.0f} tok/s{host}",
                                refresh=False)
            self._shown = now

    def close(self) -> KVStats:
        """The call's KV figures (the bar closed)."""
        self.bar.close()
        bm = self.bm
        preempts, outs, ins = (b - a for a, b in zip(self._first, self._counters()))
        return KVStats(bm.num_blocks, bm.block_size, bm.peak_blocks_in_use, bm.cow_copies,
                       preempts, bm.prefix_hit_tokens, self.prompt_tokens, bm.num_host_blocks,
                       outs, ins, bm.blocks_swapped_out, bm.blocks_swapped_in)

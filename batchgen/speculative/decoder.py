"""Verification of ngram drafts in one forward (Engine.spec's step).

A pure decode step (every row one plain sampled sequence's next token) becomes one forward of
[last token, drafts...] per row, its K/V written for every drafted position. The rows' tokens
are then drawn position by position from those logits exactly as plain decode steps would draw
them (the same sampler, columns and output processor, so each draw's randomness is keyed by
its sequence and position): a row goes on to its next position while its drawn token equals
its draft there and it has not finished. The positions of rejected drafts are given back
(KVManager.truncate). Outputs equal those without speculation, greedy and seeded."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from batchgen.attention.metadata import StepRows
from batchgen.engine.layout import LogitsLayout
from batchgen.engine.output_processor import StepStats
from batchgen.engine.scheduler import StepPlan
from batchgen.kv.block_manager import PoolExhausted
from batchgen.speculative.config import SpecConfig
from batchgen.speculative.ngram import TokenArrays, propose


def _pure_decode(engine: Any, plan: StepPlan) -> bool:
    """Whether every row of the plan decodes a plain sampled sequence's next generated token
    with no state, adapter or M-RoPE offset (rows of other kinds do not draft here)."""
    c, s = engine.kv.batch.cols, plan.slots
    return (plan.decode_rows == len(plan.seqs) > 0 and plan.state_ops is None
            and not c["lora"][s].any() and not c["rope_delta"][s].any()
            and bool((plan.starts >= c["num_prompt"][s]).all()))


class SpecDecoder:
    """Drafts, verifies and counts (vLLM's spec_decode counters, over the LLM's life)."""

    def __init__(self, cfg: SpecConfig, max_num_batched_tokens: int) -> None:
        self.cfg = cfg
        self.max_tokens = max_num_batched_tokens
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.tokens = TokenArrays()  # the rows' tokens, grown step by step

    def counters(self) -> tuple[int, int, int]:
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens

    def step(self, engine: Any, plan: StepPlan) -> StepStats | None:
        """Run `plan` with drafts when it is a pure decode step with any (None otherwise: the
        engine runs it plainly)."""
        if not _pure_decode(engine, plan):
            return None
        drafts = self._drafts(engine, plan)
        if drafts is None:
            return None
        num_new = 1 + np.array([len(d) for d in drafts], np.int64)
        c = engine.kv.batch.cols
        tokens = np.concatenate([np.concatenate(([t], d)) for t, d in
                                 zip(c["last_token"][plan.slots].tolist(), drafts)])
        rows = StepRows(plan.slots, plan.starts, num_new, num_new, tokens.astype(np.int64),
                        engine.kv.batch.block_table, rope_delta=c["rope_delta"][plan.slots])
        logits = engine.runner.execute(rows)
        stats = self._verify(engine, plan, drafts, logits, np.cumsum(num_new) - num_new)
        for seq in plan.seqs:
            if seq.slot >= 0:
                engine.kv.truncate(seq)
        return stats

    def _drafts(self, engine: Any, plan: StepPlan) -> list[np.ndarray] | None:
        """Each row's drafts (capped by its tokens left and the step's token budget), their
        positions reserved and copies made; None when no row drafts or the pool is short."""
        c, kv = engine.kv.batch.cols, engine.kv
        s = plan.slots
        left = c["max_tokens"][s] - (c["num_tokens"][s] - c["num_prompt"][s]) - 1
        budget = self.max_tokens - len(s)
        out: list[np.ndarray] = []
        for tokens, limit in zip(self.tokens.of(plan.seqs), left.tolist()):
            d = propose(tokens, self.cfg, min(limit, budget))
            budget -= len(d)
            out.append(d)
        drafting = [j for j, d in enumerate(out) if len(d)]
        if not drafting:
            return None
        try:
            copies = kv.reserve([plan.seqs[j] for j in drafting],
                                [1 + len(out[j]) for j in drafting])
        except PoolExhausted:
            return None
        engine.block_ops(plan)
        engine.runner.copy_blocks(copies)
        self.num_drafts += len(drafting)
        self.num_draft_tokens += sum(len(out[j]) for j in drafting)
        return out

    def _verify(self, engine: Any, plan: StepPlan, drafts: list[np.ndarray],
                logits: torch.Tensor, first: np.ndarray) -> StepStats:
        """Draw each row's tokens position by position as plain decode steps would, while
        its draws equal its drafts; the sub-steps' stats summed."""
        alive = np.arange(len(plan.seqs))
        width = np.array([len(d) for d in drafts], np.int64)
        out, finished = 0, []
        for i in range(int(width.max()) + 1):
            seqs = tuple(plan.seqs[j] for j in alive.tolist())  # slots move as rows finish
            sub = StepPlan(seqs, np.array([s.slot for s in seqs], np.int64),
                           plan.starts[alive] + i, np.ones(len(alive), np.int64), len(alive))
            layout = LogitsLayout(sub.seqs)
            at = engine.outputs.advance(sub, layout)
            picked = logits[torch.from_numpy(first[alive] + i).to(logits.device)]
            sampled = engine.sample(picked, layout, engine.columns(layout, at))
            stats = engine.finish(layout, at, picked, sampled)
            out += stats.output_tokens
            finished += stats.finished
            alive = self._accepted(plan, drafts, alive, width, sampled.token_ids, i)
            if not len(alive):
                break
        return StepStats(0, out, finished)

    def _accepted(self, plan: StepPlan, drafts: list[np.ndarray], alive: np.ndarray,
                  width: np.ndarray, tokens: np.ndarray, i: int) -> np.ndarray:
        """The rows whose draw at position i equals their draft there (counted as accepted)
        and that go on: still running, with drafts left after it."""
        has = width[alive] > i
        hit = np.zeros(len(alive), bool)
        hit[has] = [drafts[j][i] == t for j, t in zip(alive[has].tolist(),
                                                       tokens[has].tolist())]
        self.num_accepted_tokens += int(hit.sum())
        going = alive[hit]
        return going[[plan.seqs[j].slot >= 0 and not plan.seqs[j].group.finished
                      for j in going.tolist()]] if len(going) else going

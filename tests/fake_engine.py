"""An engine without model weights, for scheduler and block-manager tests.

`FakeRunner` stands in for the model runner: it packs the step with the real StepInputs, then
"writes the KV" of every token (its id) into a pool of slots through the slot mapping, copies
blocks for copy-on-write, and computes each logits row from the context it reads back through
the sequence's block table. So any bookkeeping error (a wrong slot, a stale or shared block
written, a missed copy, a wrong position) changes the context and hence the tokens, which the
tests compare with an unpaged reference that computes the same logits from the token lists.
"""

from __future__ import annotations

import bisect
import random

import torch

from batchgen.attention.metadata import StepRows
from batchgen.config import EngineConfig
from batchgen.engine.beam import BeamSearchState
from batchgen.engine.sequence import sample_seed
from batchgen.factory import EngineShape, build_engine, build_frontend
from batchgen.kinds import BEAMS, SAMPLES
from batchgen.kv import blocks_for
from batchgen.model.inputs import StepInputs
from batchgen.params import BeamSearchParams, SamplingParams
from batchgen.progress import CallMeter
from batchgen.sampling.sampler import Sampler
from batchgen.sampling.stop import StopFactory
from tests.helpers import check_batch
from tests.sampling_rows import Row, columns

VOCAB = 48
EOS = 2


def fake_logits(context: list[int]) -> torch.Tensor:
    """Deterministic logits of a whole context: any change in it changes them. EOS is likely
    after some contexts, so sequences end at different lengths."""
    rng = random.Random(hash(tuple(context)))
    logits = torch.tensor([rng.gauss(0.0, 2.0) for _ in range(VOCAB)])
    if rng.random() < 0.15:
        logits[EOS] += 6.0
    return logits


class FakeRunner:
    """Implements the engine's Runner protocol over a pool of token ids (one per slot)."""

    def __init__(self, num_blocks: int, block_size: int, max_tokens: int, max_seqs: int,
                 max_model_len: int, min_rows: int = 0, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = torch.full(((num_blocks + 1) * block_size,), -1, dtype=torch.long)
        self.host = torch.full((num_host_blocks * block_size,), -1, dtype=torch.long)
        self.inputs = StepInputs(max_tokens, max_seqs,
                                 max_seqs * blocks_for(max_model_len, block_size), block_size,
                                 num_blocks, min_rows, torch.device("cpu"))
        self.step_tokens: list[int] = []  # query tokens of each step
        self.copies = 0
        self.swaps = 0

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        b = self.block_size
        for src, dst in copies:
            self.pool[dst * b:(dst + 1) * b] = self.pool[src * b:(src + 1) * b]
        self.copies += len(copies)

    def swap_blocks(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]
                    ) -> None:
        """Swaps in, then out; a swapped-in block's host copy is overwritten with -2, so a
        block read back twice (or a host block read after reuse) changes the context."""
        b = self.block_size
        for src, dst in swap_in:
            self.pool[dst * b:(dst + 1) * b] = self.host[src * b:(src + 1) * b]
            self.host[src * b:(src + 1) * b] = -2
        for src, dst in swap_out:
            self.host[dst * b:(dst + 1) * b] = self.pool[src * b:(src + 1) * b]
        self.swaps += len(swap_in) + len(swap_out)

    def execute(self, rows: StepRows) -> torch.Tensor:
        self.step_tokens.append(int(rows.num_new.sum()))
        batch = self.inputs.prepare(rows)
        self.pool[batch.slot_mapping] = batch.input_ids
        qo, kv_lens, pages = batch.meta.as_lists()
        b = self.block_size
        rows = []
        for row in batch.logits_indices[:batch.num_logits].tolist():
            i = bisect.bisect_right(qo, row) - 1
            n = kv_lens[i] - (qo[i + 1] - 1 - row)  # context of this query row
            slots = [pages[i][p // b] * b + p % b for p in range(n)]
            rows.append(fake_logits(self.pool[slots].tolist()))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


class FakeLLM:
    """The engine's real parts (scheduler, KV and block managers, request builder, sampler,
    output processor), built by the same factory as `LLM`, around a FakeRunner."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 256, enable_prefix_caching: bool = True,
                 max_model_len: int = 256, min_rows: int = 0, num_host_blocks: int = 0,
                 preemption_mode: str = "recompute", overlap: bool | None = None) -> None:
        """`overlap`: async scheduling (None: as EngineConfig resolves it, from
        $BATCHGEN_ASYNC_SCHEDULING)."""
        if overlap is None:
            overlap = bool(EngineConfig(num_kv_blocks=num_blocks).async_scheduling)
        shape = EngineShape(num_blocks, block_size, max_model_len, max_num_seqs,
                            max_num_batched_tokens, VOCAB, [EOS], enable_prefix_caching,
                            num_host_blocks, preemption_mode)
        self.runner = FakeRunner(num_blocks, block_size, max_num_batched_tokens, max_num_seqs,
                                 max_model_len, min_rows, num_host_blocks)
        self.engine = build_engine(shape, self.runner, overlap)
        step = self.engine.step

        def checked_step(plan):  # the persistent batch mirrors the sequences after every
            # serial step (an overlapped engine's steps do not go through here)
            stats = step(plan)
            check_batch(self.engine)
            return stats

        self.engine.step = checked_step
        self.requests, self.results = build_frontend(shape, None)

    def generate(self, prompts: list[list[int]], params):
        return self._run(prompts, params, SAMPLES)

    def beam_search(self, prompts: list[list[int]], params):
        return self._run(prompts, params, BEAMS)

    def _run(self, prompts, params, kind):
        groups = self.requests.build([{"prompt_token_ids": p} for p in prompts], params, kind)
        meter = CallMeter(self.engine, len(groups), False)
        try:
            self.engine.run(groups, meter.on_step)
        finally:
            self.stats = meter.close()
        return [kind.output(self.results, g) for g in groups]

    def kv_stats(self):
        """The last call's KV figures, as LLM.kv_stats()."""
        return self.stats


def reference_samples(prompt: list[int], p: SamplingParams, max_tokens: int
                      ) -> list[list[int]]:
    """Each sample generated alone over its plain token list (seeded or greedy params)."""
    stops = StopFactory(None, [EOS])
    outs = []
    for k in range(p.n):
        seed = sample_seed(p.seed, k) if p.seed is not None else 0
        tokens, checker = list(prompt), stops(p, prompt, max_tokens)
        while True:
            cols = columns([Row(p, tokens, len(prompt), seed)], VOCAB, [EOS])
            tok = int(Sampler()(fake_logits(tokens)[None], cols).token_ids[0])
            tokens.append(tok)
            if checker.append(tok, len(tokens) - len(prompt))[0] is not None:
                break
        outs.append(tokens[len(prompt):])
    return outs


def reference_beams(prompt: list[int], p: BeamSearchParams, max_tokens: int
                    ) -> list[list[int]]:
    """HF beam selection over full recomputes of every live beam."""
    state = BeamSearchState(p.beam_width, max_tokens, p.length_penalty,
                            True if p.beam_width == 1 else p.early_stopping,
                            [] if p.ignore_eos else [EOS], p.num_return_sequences, VOCAB,
                            p.stop_ids)
    live: list[list[int]] = [[]]
    while not state.done:
        logits = torch.stack([fake_logits(prompt + b) for b in live])
        step = state.step(torch.log_softmax(logits, dim=-1))
        live = [live[q] + [t] for q, t in zip(step.parents, step.tokens)]
    return [h.token_ids for h in state.finalize()]

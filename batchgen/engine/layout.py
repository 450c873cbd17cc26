"""From a step plan to what the runner computes and who reads which logits row.

`step_layout` is the engine side's one function for it: the runner's rows (`StepRows`: slots,
starts, query lengths and tokens, how many logits each row keeps) and the `LogitsLayout`: which
sequences sample which row (an n > 1 leader's last prompt row serves every sample that waits
for it), which rows each beam group scores, and which rows score prompt tokens for prompt
logprobs. The leading decode rows are described by vector ops over the batch's columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchgen.attention.metadata import StepRows
from batchgen.engine.batch import PersistentBatch
from batchgen.engine.scheduler import StepPlan
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.multimodal.items import MMPrompt


@dataclass(frozen=True)
class PromptRows:
    """A prompt-scoring request's rows in one step (prompt logprobs, or the ids of vLLM's
    prompt_logprob_token_ids): positions `first`.. of its prompt are scored by logits rows
    `row`.. (`count` of them)."""

    group: SequenceGroup
    first: int
    row: int
    count: int


@dataclass(frozen=True)
class LogitsLayout:
    """Who reads each logits row of a step."""

    samplers: tuple[Sequence, ...] = ()  # sequences that draw a token...
    sample_rows: np.ndarray | None = None  # ...from these logits rows (None: row i <-> i)
    beam_rows: dict[SequenceGroup, tuple[int, int]] = field(default_factory=dict)  # first, n
    prompt_rows: tuple[PromptRows, ...] = ()
    num_prompt_tokens: int = 0  # prompt positions computed (recomputes too)


def step_layout(plan: StepPlan, batch: PersistentBatch) -> tuple[StepRows, LogitsLayout]:
    """The runner's rows and the logits layout of a step: the leading decode rows by vector
    ops (each samples its own row); for the others, samplers draw from a row's last logits,
    beams hand theirs to their group's policy, and a request with prompt logprobs keeps the
    rows of its prompt chunks that score the prompt tokens it asked for."""
    k, c = plan.decode_rows, batch.cols
    head = plan.slots[:k]
    num_logits, tokens = [np.ones(k, np.int64)], [c["last_token"][head]]
    num_prompt = int(np.count_nonzero(plan.starts[:k] < c["num_prompt"][head]))
    samplers, sample_rows, prompt_rows = list(plan.seqs[:k]), [], []
    beam_rows, row = _beam_decodes(plan, batch)  # the beams' decode rows that lead the rest
    num_logits.append(np.ones(row - k, np.int64))
    tokens.append(c["last_token"][plan.slots[k:row]])
    images = _decode_images(plan, batch, row)
    for i, (seq, start, n) in enumerate(zip(plan.seqs[row:], plan.starts[row:].tolist(),
                                            plan.num_new[row:].tolist()), row):
        group, end = seq.group, start + n
        if group.mm is not None and start < group.num_prompt_tokens:
            images[i] = group.mm
        want = end == len(seq.token_ids)
        rows = int(want)
        if group.scores_prompt:
            rows = _prompt_rows(prompt_rows, group, start, end, row) or rows
        num_logits.append([rows])
        tokens.append(seq.token_ids[start:end])
        num_prompt += max(min(end, group.num_prompt_tokens) - start, 0)
        row += rows
        if want:
            drawing = group.policy.samples_from(group, seq)
            if drawing:
                samplers += drawing
                sample_rows += [row - 1] * len(drawing)
            else:  # a beam group's rows follow each other, in its beam order
                first, count = beam_rows.get(group, (row - 1, 0))
                beam_rows[group] = (first, count + 1)
    runner_rows = StepRows(plan.slots, plan.starts, plan.num_new,
                           np.concatenate(num_logits).astype(np.int64, copy=False),
                           np.concatenate(tokens).astype(np.int64, copy=False),
                           batch.block_table, _state_slots(plan, batch), plan.state_ops,
                           images or None, c["rope_delta"][plan.slots],
                           _adapters(c["lora"][plan.slots]))
    identity = row == k and not sample_rows
    layout = LogitsLayout(tuple(samplers), None if identity else np.concatenate(
        (np.arange(k), np.array(sample_rows, np.int64))), beam_rows, tuple(prompt_rows),
        num_prompt)
    return runner_rows, layout


def _adapters(slots: np.ndarray) -> np.ndarray | None:
    """The rows' LoRA adapter slots (batchgen/lora), None when all run the base model."""
    return slots if slots.any() else None


def _beam_decodes(plan: StepPlan, batch: PersistentBatch
                  ) -> tuple[dict[SequenceGroup, tuple[int, int]], int]:
    """The decode rows of beams right after the samplers' (one generated token each: they
    come a group at a time, its beams in order): each group's (first row, count), by vector
    ops over the columns and Python per group; and the row after them."""
    k, c = plan.decode_rows, batch.cols
    slots = plan.slots[k:]
    beam = (c["beam"][slots] & (plan.num_new[k:] == 1)
            & (plan.starts[k:] == c["num_tokens"][slots] - 1)
            & (plan.starts[k:] >= c["num_prompt"][slots]))
    end = k + (int(np.argmin(beam)) if not beam.all() else len(beam))
    spans: dict[SequenceGroup, tuple[int, int]] = {}
    row = k
    while row < end:
        group = plan.seqs[row].group
        spans[group] = (row, len(group.seqs))
        row += len(group.seqs)
    return spans, end


def _prompt_rows(out: list[PromptRows], group: SequenceGroup, start: int, end: int, row: int
                 ) -> int:
    """The logits rows a chunk [start, end) of a prompt-scoring leader keeps: its tail from
    the first position that scores a wanted prompt token (position i scores token i + 1;
    tokens before `prompt_logprobs_start` are not wanted) to its end; 0 if none is."""
    first = max(start, group.params.prompt_logprobs_start - 1)
    last = min(end, group.num_prompt_tokens - 1)  # positions [first, last) score tokens
    if first >= last:
        return 0
    out.append(PromptRows(group, first + 1, row, last - first))
    return end - first


def first_scored(group: SequenceGroup) -> int:
    """The first prompt position a prompt-scoring request scores (position 0 has no context):
    row 0 of its prompt_logprob_token_ids scores this position."""
    return max(group.params.prompt_logprobs_start, 1)


def _decode_images(plan: StepPlan, batch: PersistentBatch, end: int) -> dict[int, MMPrompt]:
    """The one-token rows before `end` that compute a prompt token of a request with images
    (by vector ops: a prompt's last token alone, rarely), by row."""
    head = plan.slots[:end]
    rows = np.flatnonzero(plan.starts[:end] < batch.cols["num_prompt"][head]).tolist()
    return {i: plan.seqs[i].group.mm for i in rows if plan.seqs[i].group.mm is not None}


def _state_slots(plan: StepPlan, batch: PersistentBatch) -> np.ndarray | None:
    """Each row's state slot (models with state mixers; None otherwise)."""
    if plan.state_ops is None:
        return None
    return batch.cols["state_slot"][plan.slots]

"""Sampler inputs for tests: rows described one by one (params, token history, seed) and
turned into SamplingColumns through a real PersistentBatch, the way the engine's rows are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.batch import PersistentBatch
from batchgen.engine.policy import SamplePolicy
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.kinds import sample_spec
from batchgen.params import SamplingParams
from batchgen.sampling.sampler import SamplingColumns


@dataclass
class Row:
    """One row: its params, prompt + generated ids, how many are prompt, its seed."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt: int
    seed: int = 0
    bad_word_ids: list[list[int]] | None = None


def columns(rows: list[Row], vocab: int, eos_ids: list[int]) -> SamplingColumns:
    """The rows' SamplingColumns, as a batch holding exactly these sequences gives them."""
    batch = PersistentBatch(len(rows), vocab, 1, eos_ids, torch.device("cpu"))
    for r in rows:
        spec = sample_spec(r.params, 1 << 30, bool(r.bad_word_ids))
        group = SequenceGroup(0, None, r.token_ids[:r.num_prompt], r.params, 1 << 30,
                              SamplePolicy(), spec, bad_word_ids=r.bad_word_ids)
        batch.enter(Sequence(group, 0, list(r.token_ids), None, r.seed), [0], 0)
    return batch.sampling_columns(np.arange(len(rows)))

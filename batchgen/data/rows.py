"""Output rows of a dataset job: the input row's columns, its id, and its completions, under
one fixed Arrow schema so every shard reads back as one table."""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa

from batchgen.kinds import BEAMS, SAMPLES, RequestKind, kind_of
from batchgen.outputs import BeamSearchOutput, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams

ROW_ID = "row_id"
OUTPUTS = "outputs"
NUM_PROMPT_TOKENS = "num_prompt_tokens"
ADDED_COLUMNS = (ROW_ID, NUM_PROMPT_TOKENS, OUTPUTS)

_LOGPROB = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32()),
                      ("rank", pa.int32()), ("decoded_token", pa.string())])


def row_seed(seed: int, row_id: int) -> int:
    """The seed of row `row_id` in a job seeded with `seed`: (seed, row id) mixed by SHA-256,
    so a row's samples do not depend on which rows ran with it, or on a resume."""
    digest = hashlib.sha256(f"row:{seed}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def job_seed(params: SamplingParams | BeamSearchParams, seed: int | None) -> int:
    """A job's seed: params.seed (samples), else `seed`, else 0 (never random: a resume, or
    another machine, must redo the same draws)."""
    return kind_of(params).job_seed(params, seed)


def row_params(params: SamplingParams | BeamSearchParams, seed: int, row_id: int
               ) -> SamplingParams | BeamSearchParams:
    """The row's copy of `params`: samples seeded from (seed, row id); beams unchanged."""
    return kind_of(params).row_params(params, row_seed(seed, row_id))


_COMPLETION = [("index", pa.int32()), ("text", pa.string()), ("token_ids", pa.list_(pa.int32())),
               ("cumulative_logprob", pa.float64()), ("finish_reason", pa.string()),
               ("stop_reason", pa.string())]
_BEAM = [("text", pa.string()), ("token_ids", pa.list_(pa.int32())),
         ("cumulative_logprob", pa.float64()), ("score", pa.float64()),
         ("finish_reason", pa.string())]
_FIELDS = {SAMPLES.name: _COMPLETION, BEAMS.name: _BEAM}  # one list item of `outputs`


def output_type(params: SamplingParams | BeamSearchParams) -> pa.DataType:
    """The Arrow type of the `outputs` column: a list of completions (or beam hypotheses)."""
    fields = list(_FIELDS[kind_of(params).name])
    if params.logprobs is not None:
        fields.append(("logprobs", pa.list_(pa.list_(_LOGPROB))))
    return pa.list_(pa.struct(fields))


def output_schema(input_schema: pa.Schema | None, params: SamplingParams | BeamSearchParams
                  ) -> pa.Schema | None:
    """Input columns, then row_id, num_prompt_tokens and outputs (None while the input's
    columns are unknown: they are inferred from the first rows)."""
    if input_schema is None:
        return None
    clash = [c for c in ADDED_COLUMNS if c in input_schema.names]
    if clash:
        raise ValueError(f"data already has column(s) {clash}: batchgen adds {list(ADDED_COLUMNS)}"
                         "; rename them first")
    added = [pa.field(ROW_ID, pa.int64()), pa.field(NUM_PROMPT_TOKENS, pa.int32()),
             pa.field(OUTPUTS, output_type(params))]
    return pa.schema(list(input_schema.remove_metadata()) + added)


def output_row(row: dict[str, Any], row_id: int, out: RequestOutput | BeamSearchOutput,
               kind: RequestKind) -> dict[str, Any]:
    """The input row plus its id and completions (the kind's records of `out`)."""
    return {**row, ROW_ID: row_id, NUM_PROMPT_TOKENS: len(out.prompt_token_ids),
            OUTPUTS: kind.records(out)}

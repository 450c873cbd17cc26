"""Output rows of a dataset job: the input row's columns, its id, and its completions, under
one fixed Arrow schema so every shard reads back as one table."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pyarrow as pa

from batchgen.outputs import BeamSearchOutput, RequestOutput, TokenLogprobs
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
    """A job's seed: params.seed, else `seed`, else 0 (never random: a resume, or another
    machine, must redo the same draws)."""
    if isinstance(params, SamplingParams) and params.seed is not None:
        return params.seed
    return 0 if seed is None else int(seed)


def row_params(params: SamplingParams, seed: int, row_id: int) -> SamplingParams:
    """The row's copy of `params`, seeded from (seed, row id)."""
    return dataclasses.replace(params, seed=row_seed(seed, row_id))


def output_type(params: SamplingParams | BeamSearchParams) -> pa.DataType:
    """The Arrow type of the `outputs` column: a list of completions (or beam hypotheses)."""
    if isinstance(params, BeamSearchParams):
        fields = [("text", pa.string()), ("token_ids", pa.list_(pa.int32())),
                  ("cumulative_logprob", pa.float64()), ("score", pa.float64()),
                  ("finish_reason", pa.string())]
    else:
        fields = [("index", pa.int32()), ("text", pa.string()),
                  ("token_ids", pa.list_(pa.int32())), ("cumulative_logprob", pa.float64()),
                  ("finish_reason", pa.string()), ("stop_reason", pa.string())]
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


def output_row(row: dict[str, Any], row_id: int, out: RequestOutput | BeamSearchOutput
               ) -> dict[str, Any]:
    """The input row plus its id and completions."""
    if isinstance(out, BeamSearchOutput):
        outputs = [{"text": s.text, "token_ids": s.token_ids,
                    "cumulative_logprob": s.cumulative_logprob, "score": s.score,
                    "finish_reason": s.finish_reason} for s in out.sequences]
    else:
        outputs = [_completion(c) for c in out.outputs]
    return {**row, ROW_ID: row_id, NUM_PROMPT_TOKENS: len(out.prompt_token_ids),
            OUTPUTS: outputs}


def _completion(c: Any) -> dict[str, Any]:
    d = {"index": c.index, "text": c.text, "token_ids": c.token_ids,
         "cumulative_logprob": c.cumulative_logprob, "finish_reason": c.finish_reason,
         "stop_reason": None if c.stop_reason is None else str(c.stop_reason)}
    if c.logprobs is not None:
        d["logprobs"] = [_position(e) for e in c.logprobs]
    return d


def _position(entry: TokenLogprobs) -> list[dict[str, Any]]:
    return [{"token_id": t, "logprob": v.logprob, "rank": v.rank,
             "decoded_token": v.decoded_token} for t, v in entry.items()]

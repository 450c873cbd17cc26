"""Output rows of a dataset job: the input row's columns, its id, and its completions, under
one fixed Arrow schema so every shard reads back as one table."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa

from batchgen.data.jobs import BeamJobs, JobKind, SampleJobs, job_kind
from batchgen.outputs import BeamSearchOutput, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams

ROW_ID = "row_id"
OUTPUTS = "outputs"
NUM_PROMPT_TOKENS = "num_prompt_tokens"
ERROR = "error"  # with on_error="skip": why a row has no outputs (None for the others)
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
    return job_kind(params).job_seed(params, seed)


def row_params(params: SamplingParams | BeamSearchParams, seed: int, row_id: int
               ) -> SamplingParams | BeamSearchParams:
    """The row's copy of `params`: samples seeded from (seed, row id); beams unchanged."""
    return job_kind(params).row_params(params, row_seed(seed, row_id))


_COMPLETION = [("index", pa.int32()), ("text", pa.string()), ("token_ids", pa.list_(pa.int32())),
               ("cumulative_logprob", pa.float64()), ("finish_reason", pa.string()),
               ("stop_reason", pa.string())]
_BEAM = [("text", pa.string()), ("token_ids", pa.list_(pa.int32())),
         ("cumulative_logprob", pa.float64()), ("score", pa.float64()),
         ("finish_reason", pa.string())]
_FIELDS = {SampleJobs.name: _COMPLETION, BeamJobs.name: _BEAM}  # one list item of `outputs`


def output_type(params: SamplingParams | BeamSearchParams, constraint: str | None = None
                ) -> pa.DataType:
    """The Arrow type of the `outputs` column: a list of completions (or beam hypotheses);
    under a constraint (its kind, see `constraint_of`) each also has a `valid` flag."""
    fields = list(_FIELDS[job_kind(params).name])
    if constraint is not None:
        fields.append(("valid", pa.bool_()))
    if job_kind(params).keeps_logprobs(params):
        fields.append(("logprobs", pa.list_(pa.list_(_LOGPROB))))
    return pa.list_(pa.struct(fields))


def constraint_of(params: SamplingParams | BeamSearchParams, schema_column: str | None = None
                  ) -> str | None:
    """The kind of the job's constraint (json, regex, ...; json for a schema column), or
    None: it decides whether outputs carry a `valid` flag."""
    if schema_column is not None:
        return "json"
    so = params.structured_outputs
    return None if so is None else so.kind


def mark_valid(records: list[dict[str, Any]], constraint: str | None) -> list[dict[str, Any]]:
    """Each output's `valid` flag under a constraint: it finished ("stop", so its grammar
    ended) and, for JSON, its raw text parses (the text itself is kept as generated)."""
    if constraint is None:
        return records
    for r in records:
        ok = r["finish_reason"] == "stop"
        if ok and constraint in ("json", "json_object"):
            try:
                json.loads(r["text"])
            except ValueError:
                ok = False
        r["valid"] = ok
    return records


def output_schema(input_schema: pa.Schema | None, params: SamplingParams | BeamSearchParams,
                  constraint: str | None = None, errors: bool = False) -> pa.Schema | None:
    """Input columns, then row_id, num_prompt_tokens and outputs, and with `errors`
    (on_error="skip") an `error` column (None while the input's columns are unknown: they are
    inferred from the first rows)."""
    if input_schema is None:
        return None
    adds = ADDED_COLUMNS + ((ERROR,) if errors else ())
    clash = [c for c in adds if c in input_schema.names]
    if clash:
        raise ValueError(f"data already has column(s) {clash}: batchgen adds {list(adds)}"
                         "; rename them first")
    added = [pa.field(ROW_ID, pa.int64()), pa.field(NUM_PROMPT_TOKENS, pa.int32()),
             pa.field(OUTPUTS, output_type(params, constraint))]
    if errors:
        added.append(pa.field(ERROR, pa.string()))
    return pa.schema(list(input_schema.remove_metadata()) + added)


def input_part(row: dict[str, Any], errors: bool) -> dict[str, Any]:
    """An output row's input columns: without what batchgen added (the `error` column too,
    with `errors`)."""
    return {k: v for k, v in row.items()
            if k not in ADDED_COLUMNS and not (errors and k == ERROR)}


def error_row(row: dict[str, Any], row_id: int, message: str) -> dict[str, Any]:
    """A row skipped under on_error="skip": its input, its id, no outputs, and why."""
    return {**row, ROW_ID: row_id, NUM_PROMPT_TOKENS: None, OUTPUTS: [], ERROR: message}


def output_row(row: dict[str, Any], row_id: int, out: RequestOutput | BeamSearchOutput,
               kind: JobKind, constraint: str | None = None) -> dict[str, Any]:
    """The input row plus its id and completions (the kind's records of `out`, flagged
    valid or not under a constraint)."""
    return {**row, ROW_ID: row_id, NUM_PROMPT_TOKENS: len(out.prompt_token_ids),
            OUTPUTS: mark_valid(kind.records(out), constraint)}

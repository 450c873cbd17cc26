"""`generate_dataset`: n samples (or beams) for every row of a dataset, streamed through one
`LLM`, optionally into crash-safe Parquet or JSONL shards that a rerun resumes."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from itertools import tee
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from tqdm.auto import tqdm

from batchgen.checks import check_flag, check_int, check_seed, check_type
from batchgen.data.jobs import job_kind
from batchgen.data.prompts import PromptSpec
from batchgen.data.rows import (
    ROW_ID,
    constraint_of,
    job_seed,
    output_row,
    output_schema,
    row_params,
)
from batchgen.data.shards import ShardStore
from batchgen.data.source import Source, open_source, quiet_datasets
from batchgen.data.writers import ShardWriter, writer_for
from batchgen.outputs import BeamSearchOutput, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    import datasets

    from batchgen.llm import LLM

DEFAULT_ROWS_PER_SHARD = 256


def generate_dataset(llm: LLM, data: Any, params: SamplingParams | BeamSearchParams | None = None,
                     *, prompt_column: str = "prompt", messages_column: str | None = None,
                     output_dir: str | os.PathLike | None = None, resume: bool = False,
                     seed: int | None = None, rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
                     chat_template: str | None = None, add_generation_prompt: bool = True,
                     chat_template_kwargs: dict[str, Any] | None = None,
                     schema_column: str | None = None, output_format: str = "parquet",
                     use_tqdm: bool = True) -> datasets.Dataset:
    """Generate for every row of `data` (a Dataset, an IterableDataset, or a JSONL / JSON /
    Parquet / CSV path or `save_to_disk` folder) and return a Dataset of the input columns plus
    `row_id`, `num_prompt_tokens` and `outputs` (the n completions, or the beams for
    BeamSearchParams), ordered by `row_id`.

    `params` defaults to `llm.get_default_sampling_params()`, as in `LLM.generate`. Prompts come
    from `prompt_column` (text or token ids) or, with `messages_column`, from chat messages
    through the chat template. Sample seeds derive from (seed, row id, sample index),
    `seed` being `params.seed`, else this argument, else 0: a row's samples are the same
    whatever ran with it. With `output_dir`, finished rows go to shards of `rows_per_shard`
    rows in `output_format` ("parquet" or "jsonl"; written atomically, listed in a
    manifest); `resume=True` skips the
    rows of whole shards and redoes the rest, so a resumed run's data equal an uninterrupted
    run's. Rows finished when an error or Ctrl-C stops the job are written first.

    Under `params.structured_outputs`, or with `schema_column` (a column holding each row's
    own JSON schema, a dict or its JSON text), every output also gets a `valid` flag: it
    finished and, for JSON, its raw text (kept as generated) parses."""
    params = llm.get_default_sampling_params() if params is None else params
    spec = PromptSpec(None if messages_column else prompt_column, messages_column,
                      chat_template, add_generation_prompt, chat_template_kwargs)
    _check_args(params, rows_per_shard, resume, output_dir, seed)
    writer = writer_for(output_format)
    _check_schema_column(params, schema_column)
    source = open_source(data)
    names = source.column_names
    if names is not None and spec.column not in names:
        raise ValueError(f"{'messages_column' if messages_column else 'prompt_column'} "
                         f"{spec.column!r} is not a column of data (columns: {names})")
    if names is not None and schema_column is not None and schema_column not in names:
        raise ValueError(f"schema_column {schema_column!r} is not a column of data (columns: "
                         f"{names})")
    seed = job_seed(params, seed)
    schema = output_schema(source.schema, params, constraint_of(params, schema_column))
    store = None
    if output_dir is not None:
        fingerprint = _job(llm, params, seed, spec, source, schema_column, writer)
        store = ShardStore(Path(output_dir).expanduser(), fingerprint, resume, writer)
    job = _Job(llm, source, params, spec, seed, schema, store, rows_per_shard, schema_column)
    job.run(use_tqdm)
    return job.result()


class _Job:
    """One run of generate_dataset: pulls rows, streams them through the LLM, collects or
    shards the finished ones."""

    def __init__(self, llm: LLM, source: Source, params: SamplingParams | BeamSearchParams,
                 spec: PromptSpec, seed: int, schema: pa.Schema | None,
                 store: ShardStore | None, rows_per_shard: int,
                 schema_column: str | None = None) -> None:
        self.llm, self.source, self.params, self.spec = llm, source, params, spec
        self.seed, self.schema, self.store = seed, schema, store
        self.rows_per_shard = rows_per_shard
        self.kind = job_kind(params)
        self.inflight: dict[int, tuple[int, dict[str, Any]]] = {}  # stream index -> row
        self.buffer: list[dict[str, Any]] = []  # finished rows not yet in a shard
        self.kept: list[dict[str, Any]] = []  # every finished row, without output_dir
        self.schema_column = schema_column  # a column of per-row JSON schemas
        self.constraint = constraint_of(params, schema_column)  # outputs get a valid flag

    def run(self, use_tqdm: bool) -> None:
        """Stream every row not done yet; on any error or Ctrl-C, write what finished first."""
        done = self.store.done_ids if self.store is not None else set()
        todo = None if self.source.num_rows is None else self.source.num_rows - len(done)
        bar = tqdm(total=todo, desc="Rows", unit="row", dynamic_ncols=True, disable=not use_tqdm)
        rate = _Rate(bar)
        try:
            for index, out in self._stream(done):
                self._finished(index, out)
                rate.update(out)
            self._flush()
            if self.store is not None:
                self.store.finish()
        except BaseException:
            self._flush()
            raise
        finally:
            rate.show()
            bar.close()

    def _stream(self, done: set[int]) -> Iterator[tuple[int, Any]]:
        pairs_a, pairs_b = tee(self._requests(done))
        prompts = (p for p, _ in pairs_a)
        params = (q for _, q in pairs_b)
        return self.kind.stream(self.llm, prompts, params)

    def _requests(self, done: set[int]) -> Iterator[tuple[Any, Any]]:
        """(prompt, params) of every row not done, recording which stream index is which row."""
        index = 0
        for row_id, row in self.source.rows():
            if row_id in done:
                continue
            self.inflight[index] = (row_id, row)
            index += 1
            params = row_params(self.params, self.seed, row_id)
            if self.schema_column is not None:
                params = dataclasses.replace(params, structured_outputs=row_constraint(
                    self.llm, row_id, row, self.schema_column))
            yield self.spec.prompt(self.llm, row_id, row), params

    def _finished(self, index: int, out: RequestOutput | BeamSearchOutput) -> None:
        """File one finished request's row (and write a shard when one is full)."""
        row_id, row = self.inflight.pop(index)
        self.buffer.append(output_row(row, row_id, out, self.kind, self.constraint))
        if len(self.buffer) >= self.rows_per_shard:
            self._flush()

    def _flush(self) -> None:
        """Write the buffered finished rows as a shard (without output_dir: keep them). The
        buffer is emptied first: a Ctrl-C inside the write must not let the error path write
        the same rows again (the shard is listed or not; unlisted rows are redone on resume)."""
        rows, self.buffer = self.buffer, []
        if not rows:
            return
        if self.store is None:
            self.kept += rows
            return
        self.store.write(rows, self.schema)
        if self.schema is None:
            self.schema = self.store.schema

    def result(self) -> datasets.Dataset:
        """The job's rows, ordered by row_id (read back from the shards with output_dir:
        memory-mapped, not held in RAM)."""
        import datasets

        with quiet_datasets():
            if self.store is None:
                table = pa.Table.from_pylist(self.kept, schema=self.schema)
                return datasets.Dataset(table.sort_by(ROW_ID))
            files = self.store.files()
            if not files:
                raise ValueError("data has no rows")
            return self.store.writer.load(files, self.schema).sort(ROW_ID)


class _Rate:
    """The rows bar's postfix: samples/s and output tokens/s since the start."""

    def __init__(self, bar: tqdm) -> None:
        self.bar, self.start, self.samples, self.tokens, self.shown = bar, time.perf_counter(), 0, 0, 0.0

    def update(self, out: RequestOutput | BeamSearchOutput) -> None:
        seqs = out.sequences if isinstance(out, BeamSearchOutput) else out.outputs
        self.samples += len(seqs)
        self.tokens += sum(len(s.token_ids) for s in seqs)
        self.bar.update(1)
        if time.perf_counter() - self.shown > 0.5:
            self.show()

    def show(self) -> None:
        """Set the postfix from the totals so far (also once at the end)."""
        now = time.perf_counter()
        el = max(now - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.samples / el:,.1f} samples/s, "
                                 f"{self.tokens / el:,.0f} output tok/s", refresh=False)
        self.shown = now


def _check_args(params: Any, rows_per_shard: int, resume: bool, output_dir: Any, seed: Any
                ) -> None:
    """ValueErrors naming the argument (the prompt source checks itself: PromptSpec)."""
    check_type(params, "params", (SamplingParams, BeamSearchParams))
    job_kind(params).check_job(params)
    check_int(rows_per_shard, "rows_per_shard")
    check_flag(resume, "resume")
    if resume and output_dir is None:
        raise ValueError("resume=True needs output_dir (the shards to resume from)")
    check_seed(seed)  # the job seed: validated only (-1 stays -1, as the manifest has it)


def _check_schema_column(params: Any, schema_column: Any) -> None:
    """A column name, and not with params that carry their own constraint."""
    if schema_column is None:
        return
    check_type(schema_column, "schema_column", str, "None or a column name")
    if params.structured_outputs is not None:
        raise ValueError("pass schema_column (a schema per row) or params.structured_outputs "
                         "(one for every row), not both")


def row_constraint(llm: LLM, row_id: int, row: dict[str, Any], column: str
                   ) -> StructuredOutputsParams:
    """A row's own JSON schema as its constraint, compiled now (ValueError naming the row)."""
    try:
        so = StructuredOutputsParams(json=row.get(column))
        llm.requests.grammars.compile(so)
    except ValueError as e:
        raise ValueError(f"row {row_id}: schema_column {column!r}: {e}") from None
    return so


def _job(llm: LLM, params: Any, seed: int, spec: PromptSpec, source: Source,
         schema_column: str | None = None, writer: ShardWriter | None = None
         ) -> dict[str, Any]:
    """What identifies a job for resume: model, params, seed, prompt source, input, and the
    output format."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    if fields.get("logits_processors"):
        fields["logits_processors"] = [getattr(f, "__qualname__", repr(f))
                                       for f in fields["logits_processors"]]
    if fields.get("structured_outputs") is not None:
        fields["structured_outputs"] = dataclasses.asdict(fields["structured_outputs"])
    else:  # absent, as in manifests written before it existed (they stay resumable)
        fields.pop("structured_outputs", None)
    for name, default in _BEAM_CONTROLS.items():  # at their defaults: absent, as in
        if isinstance(params, BeamSearchParams) and fields[name] == default:  # manifests
            fields.pop(name)  # written before them (older beam jobs stay resumable)
    if not fields.get("prompt_logprobs_start"):  # absent when 0, as in older manifests
        fields.pop("prompt_logprobs_start", None)
    fields["seed"] = None  # the job seed below covers it
    job = {"model": str(llm.model_path), "kind": type(params).__name__,
           "params": json_safe(fields), "seed": seed, "prompt": json_safe(dataclasses.asdict(spec)),
           "input": source.fingerprint, "input_rows": source.num_rows}
    if schema_column is not None:  # (absent otherwise: older manifests stay resumable)
        job["schema_column"] = schema_column
    if writer is not None and writer.name != "parquet":  # (absent for Parquet, as before)
        job["output_format"] = writer.name
    return job


# BeamSearchParams fields newer than the manifest format, with their defaults
_BEAM_CONTROLS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words": None,
                  "bad_words_ids": None, "min_tokens": 0, "temperature": 1.0,
                  "num_beam_groups": 1, "diversity_penalty": 0.0, "logprobs": 0,
                  "return_trace": False}


def json_safe(value: Any) -> Any:
    """`value` with tuples as lists and dict keys as strings (what JSON gives back)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value

"""`generate_dataset`: n samples (or beams) for every row of a dataset, streamed through one
`LLM`, optionally into crash-safe Parquet or JSONL shards that a rerun resumes."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import tee
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from batchgen.checks import (
    check,
    check_choice,
    check_flag,
    check_int,
    check_seed,
    check_type,
    is_number,
)
from batchgen.data.identity import model_identity, row_fingerprint
from batchgen.data.jobs import job_kind
from batchgen.data.prompts import PromptSpec
from batchgen.data.rows import (
    ERROR,
    ROW_ID,
    constraint_of,
    error_row,
    input_part,
    job_seed,
    output_row,
    output_schema,
    row_params,
)
from batchgen.data.shards import ShardStore
from batchgen.data.source import Source, open_source, quiet_datasets, undecoded_images
from batchgen.data.writers import ShardWriter, writer_for
from batchgen.kinds import kind_of
from batchgen.log import logger
from batchgen.lora.dataset import LoRAColumn, RowAdapters
from batchgen.outputs import BeamSearchOutput, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    import datasets

    from batchgen.llm import LLM

DEFAULT_ROWS_PER_SHARD = 256
DEFAULT_SHARD_SECONDS = 60.0
ON_ERROR = ("fail", "skip")


def generate_dataset(llm: LLM, data: Any, params: SamplingParams | BeamSearchParams | None = None,
                     *, prompt_column: str = "prompt", messages_column: str | None = None,
                     output_dir: str | os.PathLike | None = None, resume: bool = False,
                     seed: int | None = None, rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
                     shard_seconds: float | None = DEFAULT_SHARD_SECONDS,
                     chat_template: str | None = None, add_generation_prompt: bool = True,
                     chat_template_kwargs: dict[str, Any] | None = None,
                     schema_column: str | None = None, output_format: str = "parquet",
                     on_error: str = "fail", use_tqdm: bool = True,
                     image_column: str | None = None, lora_column: str | None = None,
                     loras: dict[str, str] | None = None) -> datasets.Dataset:
    """Generate for every row of `data` (a Dataset, an IterableDataset, or a JSONL / JSON /
    Parquet / CSV path or `save_to_disk` folder) and return a Dataset of the input columns plus
    `row_id`, `num_prompt_tokens` and `outputs` (the n completions, or the beams for
    BeamSearchParams), ordered by `row_id`.

    `params` defaults to `llm.get_default_sampling_params()`, as in `LLM.generate`. Prompts come
    from `prompt_column` (text or token ids) or, with `messages_column`, from chat messages
    through the chat template. Sample seeds derive from (seed, row id, sample index),
    `seed` being `params.seed`, else this argument, else 0: a row's samples are the same
    whatever ran with it. With `output_dir`, finished rows go to shards in `output_format`
    ("parquet" or "jsonl"; atomic, listed in a manifest), shard k holding rows [k*R, (k+1)*R)
    (R = rows_per_shard) once they finished, and the shards not full yet every `shard_seconds`
    too (None: when full only); `resume=True` keeps the rows of whole shards whose input is
    unchanged and redoes the rest (rows edited or added since, rows that failed), so a resumed
    run's files equal an uninterrupted run's on the current input, byte for byte. Rows finished when an error or Ctrl-C stops the
    job are written first.

    A row that cannot run (its prompt too long, a bad chat or schema, ...) stops the job with
    a ValueError naming its row id (and its line, for JSON Lines) under `on_error="fail"`;
    under "skip" it is written with empty outputs and an `error` column saying why, and the
    job goes on (other rows' `error` is None).

    Under `params.structured_outputs`, or with `schema_column` (a column holding each row's
    own JSON schema, a dict or its JSON text), every output also gets a `valid` flag: it
    finished and, for JSON, its raw text (kept as generated) parses.

    `image_column` (a vision-language model): each row's image beside its text prompt, which
    holds the model's image placeholder: a path, an image file's bytes, or datasets' `Image`
    (kept encoded in the output; a row whose image is None runs as text). `lora_column`: each
    row's LoRA adapter, by name in `loras` ({name: PEFT folder}; docs/lora.md)."""
    params = llm.get_default_sampling_params() if params is None else params
    spec = PromptSpec(None if messages_column else prompt_column, messages_column,
                      chat_template, add_generation_prompt, chat_template_kwargs, image_column)
    _check_args(params, rows_per_shard, shard_seconds, on_error, resume, output_dir, seed)
    writer = _checked_writer(params, output_format, schema_column)
    source, adapters = _open(llm, data, spec, messages_column, schema_column,
                             LoRAColumn.of(lora_column, loras))
    seed, skip = job_seed(params, seed), on_error == "skip"
    schema = output_schema(source.schema, params, constraint_of(params, schema_column), skip)
    store = None
    if output_dir is not None:
        job = _job(llm, params, seed, spec, source, schema_column, writer, on_error, adapters)
        store = ShardStore(Path(output_dir).expanduser(), job, resume, writer, rows_per_shard)
        if resume:
            _reconcile(store, source, skip, spec.image_column, adapters)
    job = _Job(llm, source, params, spec, seed, schema, store,
               _Closing(rows_per_shard, shard_seconds), schema_column, skip, adapters)
    job.run(use_tqdm)
    return job.result()


def _check_columns(source: Source, spec: PromptSpec, messages_column: str | None,
                   schema_column: str | None) -> None:
    """The prompt (or messages) column and the schema column are columns of the data."""
    names = source.column_names
    if names is not None and spec.column not in names:
        raise ValueError(f"{'messages_column' if messages_column else 'prompt_column'} "
                         f"{spec.column!r} is not a column of data (columns: {names})")
    for name, column in (("schema_column", schema_column), ("image_column", spec.image_column)):
        if names is not None and column is not None and column not in names:
            raise ValueError(f"{name} {column!r} is not a column of data (columns: {names})")


def _checked_writer(params: Any, output_format: Any, schema_column: Any) -> ShardWriter:
    _check_schema_column(params, schema_column)
    return writer_for(output_format)


def _open(llm: LLM, data: Any, spec: PromptSpec, messages_column: str | None,
          schema_column: str | None, lora: LoRAColumn) -> tuple[Source, RowAdapters]:
    """The input, its columns checked; the job's adapters (each read and checked, then each
    row's name); the input's fingerprint then includes the adapters' bytes."""
    source = undecoded_images(open_source(data), spec.image_column)
    _check_columns(source, spec, messages_column, schema_column)
    adapters = RowAdapters(lora, llm)
    lora.check_rows(source)
    return adapters.source(source), adapters


def _fingerprinter(adapters: RowAdapters, image_column: str | None) -> Any:
    """A row's input fingerprint: its columns (an image path's file too) and its adapter's
    bytes (a row under one: RowAdapters)."""
    def fingerprint(row: dict[str, Any]) -> str:
        return adapters.fingerprint(row, row_fingerprint(row, image_column))
    return fingerprint


def _reconcile(store: ShardStore, source: Source, errors: bool,
               image_column: str | None, adapters: RowAdapters) -> None:
    """On resume: keep only the listed rows whose input is unchanged (error rows are retried).
    The rows are read and fingerprinted only when the input's fingerprint differs from the
    one the manifest lists, or says nothing of the rows (an iterable)."""
    stored = store.stored_input or {}
    # an image column of paths: the files may change under an unchanged input, so rows are read
    unchanged = source.content_fingerprint and stored.get("input") == source.fingerprint \
        and image_column is None
    current = None
    fingerprint = _fingerprinter(adapters, image_column)
    if not unchanged:  # (nothing to read when no row was kept)
        current = {i: fingerprint(row) for i, row in source.rows()
                   if i in store.done_ids} if store.done_ids else {}
    # an image path's file or a row's adapter may change under the same row: whole shards
    dropped = store.reconcile(current, errors, whole_shards=image_column is not None
                              or adapters.column is not None)
    if dropped:
        logger.info("resume: %d row(s) changed, left the input or failed: they are redone",
                    len(dropped))
    short = store.short_ids()  # shards written again whole once their rows are done
    if current is None and short:
        current = _fingerprints_of(source, short, fingerprint)
    store.remember(current or {})


def _fingerprints_of(source: Source, ids: set[int], fingerprint: Any) -> dict[int, str]:
    """The input fingerprints of the rows `ids` (read until the last of them)."""
    found: dict[int, str] = {}
    for i, row in source.rows():
        if i in ids:
            found[i] = fingerprint(row)
            if len(found) == len(ids):
                break
    return found


@dataclass(frozen=True)
class _Closing:
    """When a shard is written: once its `rows` row ids have all finished, and the shards
    not full yet every `seconds` (written again whole when they fill)."""

    rows: int
    seconds: float | None

    def due(self, since: float) -> bool:
        return self.seconds is not None and since >= self.seconds


class _Job:
    """One run of generate_dataset: pulls rows, streams them through the LLM, collects or
    shards the finished ones (and, under on_error="skip", the rows that cannot run)."""

    def __init__(self, llm: LLM, source: Source, params: SamplingParams | BeamSearchParams,
                 spec: PromptSpec, seed: int, schema: pa.Schema | None,
                 store: ShardStore | None, closing: _Closing,
                 schema_column: str | None = None, skip: bool = False,
                 adapters: RowAdapters | None = None) -> None:
        self.llm, self.source, self.params, self.spec = llm, source, params, spec
        self.seed, self.schema, self.store, self.closing = seed, schema, store, closing
        self.kind = job_kind(params)
        self.engine_kind = kind_of(params)
        self.inflight: dict[int, tuple[int, dict[str, Any], str]] = {}  # stream index -> row
        # finished rows not in a shard yet, by shard index (shard k: row ids [k*R, (k+1)*R))
        self.buckets: dict[int, list[tuple[dict[str, Any], str]]] = {}
        self.per_shard = closing.rows if store is None else store.rows_per_shard
        self.kept: list[dict[str, Any]] = []  # every finished row, without output_dir
        self.schema_column = schema_column  # a column of per-row JSON schemas
        self.constraint = constraint_of(params, schema_column)  # outputs get a valid flag
        self.skip = skip  # on_error="skip": rows that cannot run are written with an error
        self.opened = time.monotonic()  # when the shard being filled was opened
        self.rate: _Rate | None = None
        self.failure: ValueError | None = None  # on_error="fail": the row that stopped the job
        self.adapters = adapters or RowAdapters(LoRAColumn(), llm)  # each row's adapter
        self.fingerprint = _fingerprinter(self.adapters, spec.image_column)
        self.loras: list[Any] = []  # the stream's lora_request, by stream index

    def run(self, use_tqdm: bool) -> None:
        """Stream every row not done yet; on any error or Ctrl-C, write what finished first."""
        done = self.store.done_ids if self.store is not None else set()
        todo = None if self.source.num_rows is None else self.source.num_rows - len(done)
        bar = tqdm(total=todo, desc="Rows", unit="row", dynamic_ncols=True, disable=not use_tqdm)
        self.rate = _Rate(bar)
        try:
            for index, out in self._stream(done):
                self._finished(index, out)
            self._flush()
            if self.failure is not None:
                raise self.failure
            if self.store is not None:
                self.store.finish()
        except BaseException:
            self._flush()
            raise
        finally:
            self.rate.show()
            bar.close()

    def _stream(self, done: set[int]) -> Iterator[tuple[int, Any]]:
        pairs_a, pairs_b = tee(self._requests(done))
        prompts = (p for p, _ in pairs_a)
        params = (q for _, q in pairs_b)
        loras = self.loras if self.adapters.column is not None else None
        return self.kind.stream(self.llm, prompts, params, loras)

    def _requests(self, done: set[int]) -> Iterator[tuple[Any, Any]]:
        """(prompt, params) of every row not done, checked one by one, recording which stream
        index is which row. A row that cannot run is filed as an error row, or (on_error=
        "fail") ends the rows here: those already pulled finish and are written, then `run`
        raises."""
        index = 0
        for row_id, row in self.source.rows():
            if row_id in done:
                continue
            try:
                lora = self.adapters.request(row_id, row)
                prompt, params = self._prepare(row_id, row, lora)
            except Exception as e:  # the row's own problem: its prompt, template or schema
                if self._failed(row_id, row, e):
                    continue
                return
            self.inflight[index] = (row_id, row, self.fingerprint(row))
            self.loras.append(lora)
            index += 1
            yield prompt, params

    def _prepare(self, row_id: int, row: dict[str, Any], lora: Any = None) -> tuple[Any, Any]:
        """The row's prompt (tokenized) and params, checked as the engine would check them."""
        params = row_params(self.params, self.seed, row_id)
        if self.schema_column is not None:
            params = dataclasses.replace(params, structured_outputs=row_constraint(
                self.llm, row, self.schema_column))
        prompt = self.adapters.encode(self.spec.prompt(
            self.llm, row_id, row, self.adapters.chat_tokenizers(lora)), lora)
        return self.llm.requests.check_one(prompt, params, self.engine_kind), params

    def _failed(self, row_id: int, row: dict[str, Any], error: Exception) -> bool:
        """A row that cannot run: its error row filed with the finished ones ("skip": True,
        go on), or the ValueError naming it kept for `run` to raise ("fail": False, stop)."""
        reason = str(error).removeprefix(f"row {row_id}: ")
        if not isinstance(error, ValueError):
            reason = f"{type(error).__name__}: {reason}"
        message = f"{self.source.where(row_id)}: {reason}"
        if not self.skip:
            self.failure = ValueError(message)
            self.failure.__cause__ = error
            return False
        logger.warning("skipped %s", message)
        self._file(error_row(row, row_id, message), self.fingerprint(row))
        return True

    def _finished(self, index: int, out: RequestOutput | BeamSearchOutput) -> None:
        """File one finished request's row."""
        row_id, row, fingerprint = self.inflight.pop(index)
        record = output_row(row, row_id, out, self.kind, self.constraint)
        if self.skip:
            record[ERROR] = None
        self._file(record, fingerprint, out)

    def _file(self, record: dict[str, Any], fingerprint: str,
              out: RequestOutput | BeamSearchOutput | None = None) -> None:
        """Keep a row for its shard, written once all the shard's rows are done (and the
        shards not full yet every shard_seconds)."""
        if self.rate is not None:
            self.rate.update(out)
        if self.store is None:
            self.kept.append(record)
            return
        k = record[ROW_ID] // self.per_shard
        self.buckets.setdefault(k, []).append((record, fingerprint))
        if self._complete(k):
            self._write(k)
        elif self.closing.due(time.monotonic() - self.opened):
            self._flush()

    def _complete(self, k: int) -> bool:
        """Whether every row id of shard k in the input has finished (or was kept)."""
        have = {r[ROW_ID] for r, _ in self.buckets[k]} | set(self.store.ids_in(k))
        n = self.source.num_rows
        end = (k + 1) * self.per_shard if n is None else min((k + 1) * self.per_shard, n)
        return len(have) >= end - k * self.per_shard

    def _flush(self) -> None:
        """Write every shard holding finished rows, full or not (at the end, on an error or
        Ctrl-C, and every shard_seconds)."""
        self.opened = time.monotonic()
        for k in sorted(self.buckets):
            self._write(k)

    def _write(self, k: int) -> None:
        """Write shard k with its finished rows added. The bucket is emptied first: a Ctrl-C
        inside the write must not let the error path write the same rows again (the shard
        is listed or not; unlisted rows are redone on resume)."""
        buffered = self.buckets.pop(k, [])
        self.opened = time.monotonic()
        if not buffered or self.store is None:
            return
        rows = [r for r, _ in buffered]
        if self.schema is None:
            self.schema = self._inferred_schema(rows)
        fingerprints = {r[ROW_ID]: fp for r, fp in buffered}
        errors = tuple(r[ROW_ID] for r in rows if r.get(ERROR) is not None) if self.skip else ()
        self.store.put(k, rows, self.schema, fingerprints, errors, merge=True)

    def _inferred_schema(self, rows: list[dict[str, Any]]) -> pa.Schema:
        """The output schema when the input's columns were unknown (an iterable without
        features): the input columns as the first rows have them (a resume: the shards')."""
        if self.store is not None and self.store.schema is not None:
            return self.store.schema
        inputs = pa.Table.from_pylist([input_part(r, self.skip) for r in rows]).schema
        return output_schema(inputs, self.params, self.constraint, self.skip)

    def result(self) -> datasets.Dataset:
        """The job's rows, ordered by row_id (read back from the shards with output_dir:
        memory-mapped, not held in RAM)."""
        import datasets

        with quiet_datasets():
            if self.store is None:
                if self.schema is None and self.kept:
                    self.schema = self._inferred_schema(self.kept)
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

    def update(self, out: RequestOutput | BeamSearchOutput | None) -> None:
        """Count a filed row (`out`: its outputs; None for an error row)."""
        if out is not None:
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


def _check_args(params: Any, rows_per_shard: int, shard_seconds: Any, on_error: Any,
                resume: bool, output_dir: Any, seed: Any) -> None:
    """ValueErrors naming the argument (the prompt source checks itself: PromptSpec)."""
    check_type(params, "params", (SamplingParams, BeamSearchParams))
    job_kind(params).check_job(params)
    check_int(rows_per_shard, "rows_per_shard")
    check(shard_seconds is None or (is_number(shard_seconds) and shard_seconds > 0),
          "shard_seconds", "None or a number of seconds > 0", shard_seconds)
    check_choice(on_error, "on_error", ON_ERROR)
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


def row_constraint(llm: LLM, row: dict[str, Any], column: str) -> StructuredOutputsParams:
    """A row's own JSON schema as its constraint, compiled now (a ValueError naming the
    column; the job adds the row)."""
    try:
        so = StructuredOutputsParams(json=row.get(column))
        llm.requests.grammars.compile(so)
    except ValueError as e:
        raise ValueError(f"schema_column {column!r}: {e}") from None
    return so


def _prompt_identity(spec: PromptSpec) -> dict[str, Any]:
    """The prompt source as a manifest records it (no image column: absent, as in manifests
    written before it existed, which stay resumable)."""
    fields = dataclasses.asdict(spec)
    if fields.get("image_column") is None:
        fields.pop("image_column", None)
    return json_safe(fields)


def _job(llm: LLM, params: Any, seed: int, spec: PromptSpec, source: Source,
         schema_column: str | None = None, writer: ShardWriter | None = None,
         on_error: str = "fail", adapters: RowAdapters | None = None) -> dict[str, Any]:
    """What identifies a job for resume: model, params, seed, prompt source, the output format
    and what a failed row does; and the input it ran on (a resume checks the rows of an input
    that changed, see ShardStore.reconcile)."""
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
    drop_defaults(params, fields, VLLM_BEAM_FIELDS if isinstance(params, BeamSearchParams)
                   else VLLM_SAMPLING_FIELDS)  # likewise the fields added for vLLM's API
    fields["seed"] = None  # the job seed below covers it
    job = {**model_identity(llm), "kind": type(params).__name__,
           "params": json_safe(fields), "seed": seed, "prompt": _prompt_identity(spec),
           "input": source.fingerprint, "input_rows": source.num_rows}
    if schema_column is not None:  # (absent otherwise: older manifests stay resumable)
        job["schema_column"] = schema_column
    if writer is not None and writer.name != "parquet":  # (absent for Parquet, as before)
        job["output_format"] = writer.name
    if on_error != "fail":  # (absent for "fail", as before: the outputs have no error column)
        job["on_error"] = on_error
    if adapters is not None:  # lora_column and the adapters' names (absent without a column)
        job.update(adapters.spec.identity())
    return job


# BeamSearchParams fields newer than the manifest format, with their defaults
_BEAM_CONTROLS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words": None,
                  "bad_words_ids": None, "min_tokens": 0, "temperature": 1.0,
                  "num_beam_groups": 1, "diversity_penalty": 0.0, "logprobs": 0,
                  "return_trace": False}


# fields added for vLLM's API (issue 44): absent from a job's identity at their defaults, so
# jobs started before them stay resumable
VLLM_SAMPLING_FIELDS = (
    "best_of", "output_kind", "stream_interval", "skip_clone", "extra_args", "watermarking",
    "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "flat_logprobs",
    "spaces_between_special_tokens", "output_text_buffer_length", "skip_reading_prefix_cache",
    "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start",
    "trace_decode_token_ids")
VLLM_BEAM_FIELDS = ("include_stop_str_in_output", "skip_special_tokens", "watermarking",
                    "allowed_token_ids")


def drop_defaults(params: Any, fields: dict[str, Any], names: tuple[str, ...]) -> None:
    """Remove `names` from `fields` where they hold their dataclass defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(params)}
    for name in names:
        if name in fields and name in defaults and _same(fields[name], defaults[name]):
            fields.pop(name)


def _same(value: Any, default: Any) -> bool:
    """`value == default` for a field, False for an array (prompt_logprob_token_ids' table
    is never a default; numpy compares elementwise)."""
    return not isinstance(value, np.ndarray) and bool(value == default)


def json_safe(value: Any) -> Any:
    """`value` with tuples as lists and dict keys as strings (what JSON gives back)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):  # prompt_logprob_token_ids' table: its ids, in full
        return value.tolist()
    return value

"""A Ray Data processor shaped like `ray.data.llm`'s: a config, `build_processor(config,
preprocess, postprocess)`, and a processor that maps a Ray `Dataset` to one with the local dataset
runner's output columns (`row_id`, `num_prompt_tokens`, `outputs` with all n samples or beams).

The generation stage is `Dataset.map_batches` over an actor pool: each actor builds one `LLM`
and runs each batch through `LLM.generate` (or `beam_search`) with the per-row seeds of
`generate_dataset`, so a row's outputs do not depend on the actor or batch it landed in. Ray
Data restarts an actor that dies and retries its batch, so a killed actor loses and duplicates
no row. With `score`, the same pipeline goes on into a score stage (a second actor pool holding
the scorer) and a select stage (batchgen/ray/best_of_n.py): the local job's best-of-n columns.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchgen.checks import check, check_int, check_number, check_seed, check_type, is_int
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
from batchgen.lora.dataset import LoRAColumn, RowAdapters
from batchgen.params import BeamSearchParams, SamplingParams
from batchgen.ray.best_of_n import check_stages, score_and_select, with_prompt_texts

if TYPE_CHECKING:
    import ray.data

Row = dict[str, Any]
POOL_SIZES = ("kv_cache_memory", "kv_cache_memory_bytes", "num_kv_blocks")  # a KV pool's size


@dataclass(frozen=True)
class BatchgenProcessorConfig:
    """What `ray.data.llm.vLLMEngineProcessorConfig` holds, for batchgen: the model and its
    engine kwargs, the params of every row, where prompts come from, and the actor pool."""

    model_source: str  # a model folder every node can read (shared storage or a copy per node)
    sampling_params: SamplingParams | BeamSearchParams = field(default_factory=SamplingParams)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # LLM(model_source, **kwargs)
    prompt_column: str = "prompt"
    messages_column: str | None = None  # chat messages, rendered through the chat template
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    image_column: str | None = None  # a VLM's row image: a path, bytes, {"bytes", "path"}
    lora_column: str | None = None  # each row's adapter, by name in loras (None: the base)
    loras: dict[str, str] | None = None  # adapter name -> PEFT folder every node can read
    seed: int | None = None  # the job seed (params.seed first), as in generate_dataset
    batch_size: int = 64  # rows per map_batches call
    concurrency: int | tuple[int, int] = 1  # actors: a fixed number or (min, max)
    # per actor: 1 on a GPU cluster (one LLM per GPU), 0 on CPUs; with tensor_parallel_size k
    # in engine_kwargs, k: the LLM's k ranks are processes of the actor, so on its node
    num_gpus: float = 0.0
    num_cpus: float = 1.0  # per actor
    max_tasks_in_flight_per_actor: int | None = None
    runtime_env: dict[str, Any] | None = None
    # the score and select stages (docs/best_of_n.md): a reward / process reward model folder
    # every node can read, or a picklable callable (prompt, text) -> float; None: no scoring
    score: str | os.PathLike | Callable[[str, str], float] | None = None
    select: str | None = None  # best | top:k | threshold:X | pairs (None: scores only)
    score_engine_kwargs: dict[str, Any] = field(default_factory=dict)  # RewardModel(score, **)
    score_num_gpus: float = 0.0  # per score actor; 0.5 here and in num_gpus: one GPU shared
    score_num_cpus: float = 1.0  # per score actor
    score_concurrency: int | tuple[int, int] = 1  # score actors: a fixed number or (min, max)
    score_workers: int = 4  # a callable scorer's threads per score actor

    def __post_init__(self) -> None:
        _check(self)

    @property
    def prompt_spec(self) -> PromptSpec:
        return PromptSpec(None if self.messages_column else self.prompt_column,
                          self.messages_column, self.chat_template, True,
                          self.chat_template_kwargs, self.image_column)

    @property
    def lora_spec(self) -> LoRAColumn:
        return LoRAColumn.of(self.lora_column, self.loras)


def _check(c: BatchgenProcessorConfig) -> None:
    """ValueErrors naming the field, before Ray starts anything."""
    check(isinstance(c.model_source, (str, os.PathLike)) and bool(str(c.model_source)),
          "model_source", "a model folder (a non-empty path)", c.model_source)
    check_type(c.sampling_params, "sampling_params", (SamplingParams, BeamSearchParams))
    job_kind(c.sampling_params).check_job(c.sampling_params)
    check_type(c.engine_kwargs, "engine_kwargs", dict, "a dict of LLM arguments")
    _ = c.prompt_spec  # PromptSpec checks the prompt column and the chat fields
    check_seed(c.seed)  # the job seed: validated only, as in generate_dataset
    if c.lora_spec.column is not None and not c.engine_kwargs.get("enable_lora"):
        raise ValueError("lora_column needs engine_kwargs['enable_lora']=True")
    check_int(c.batch_size, "batch_size")
    for name in ("concurrency", "score_concurrency"):
        _check_pool_size(getattr(c, name), name)
    for name in ("num_gpus", "num_cpus", "score_num_gpus", "score_num_cpus"):
        check_number(getattr(c, name), name)
    _check_gpus_for_ranks(c.num_gpus, c.engine_kwargs.get("tensor_parallel_size", 1))
    _check_shared_gpu(c.num_gpus, c.engine_kwargs, "num_gpus", "engine_kwargs")
    check_int(c.max_tasks_in_flight_per_actor, "max_tasks_in_flight_per_actor",
              allow_none=True)
    if c.runtime_env is not None:
        check_type(c.runtime_env, "runtime_env", dict, "None or a Ray runtime_env dict")
    check_stages(c)
    if isinstance(c.score, (str, os.PathLike)):  # a scorer model's actors hold a pool too
        _check_shared_gpu(c.score_num_gpus, c.score_engine_kwargs, "score_num_gpus",
                          "score_engine_kwargs")


def _check_pool_size(value: Any, name: str) -> None:
    """An actor pool's size: an integer >= 1 or a (min, max) pair of them."""
    sizes = value if isinstance(value, tuple) else (value,)
    check(1 <= len(sizes) <= 2 and all(is_int(n) and n >= 1 for n in sizes)
          and sizes == tuple(sorted(sizes)), name,
          "an integer >= 1 or a (min, max) pair of them with min <= max", value)


def _check_shared_gpu(num_gpus: float, kwargs: dict[str, Any], name: str, kwargs_name: str
                      ) -> None:
    """An actor with a fraction of a GPU shares it (the generator and the scorer, or two
    actors of one pool): its KV pool needs a size of its own, since gpu_memory_utilization
    counts the other process's memory as used (the second actor to start would get none)."""
    if 0 < num_gpus < 1 and not any(kwargs.get(k) for k in POOL_SIZES):
        raise ValueError(
            f"{name}={num_gpus} shares a GPU with another actor: give this actor's KV pool "
            f"its own size in {kwargs_name} ('kv_cache_memory': bytes, or 'num_kv_blocks'), "
            f"so that the models' pools fit side by side")


def _check_gpus_for_ranks(num_gpus: float, tp: Any) -> None:
    """GPU actors hold a GPU per tensor-parallel rank: the ranks are the actor's own child
    processes, and each binds one of the GPUs Ray makes visible to the actor."""
    if num_gpus > 0 and is_int(tp) and tp > 1 and num_gpus < tp:
        raise ValueError(
            f"num_gpus must be >= engine_kwargs['tensor_parallel_size'] ({tp}) on GPU actors, "
            f"got {num_gpus}: each actor's LLM runs {tp} ranks, one GPU each, as processes "
            f"of the actor; set num_gpus={tp}")


class _Generate:
    """The actor: one LLM, built once; each call generates for a batch of rows."""

    def __init__(self, config: BatchgenProcessorConfig) -> None:
        from batchgen.llm import LLM

        self.config = config
        self.spec = config.prompt_spec
        self.llm = LLM(config.model_source, **config.engine_kwargs)
        self.adapters = RowAdapters(config.lora_spec, self.llm)  # each read and checked

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        ids = [int(r[ROW_ID]) for r in rows]
        prompts = [self.spec.prompt(self.llm, i, r) for i, r in zip(ids, rows)]
        p = self.config.sampling_params
        kind, seed = job_kind(p), job_seed(p, self.config.seed)
        loras = [self.adapters.request(i, r) for i, r in zip(ids, rows)]
        outs = kind.run(self.llm, prompts, [row_params(p, seed, i) for i in ids],
                        loras if self.adapters.column is not None else None)
        constraint = constraint_of(p)
        schema = output_schema(_without(batch.schema, ROW_ID), p, constraint)
        table = pa.Table.from_pylist([output_row(r, i, o, kind, constraint)
                                      for r, i, o in zip(rows, ids, outs)], schema=schema)
        if self.config.score is None:
            return table
        return with_prompt_texts(table, rows, self.llm.get_tokenizer(), self.config)


def _without(schema: pa.Schema, name: str) -> pa.Schema:
    return schema.remove(schema.get_field_index(name))


class Processor:
    """Callable on a Ray Dataset: preprocess (a row map), row ids if missing, the actor-pool
    generation stage, postprocess (a row map). Lazy, like any Ray Data transform."""

    def __init__(self, config: BatchgenProcessorConfig,
                 preprocess: Callable[[Row], Row] | None = None,
                 postprocess: Callable[[Row], Row] | None = None) -> None:
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        import ray.data

        c = self.config
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        if ROW_ID not in ds.columns():
            ds = with_row_ids(ds)
        if c.prompt_spec.column not in ds.columns():
            name = "messages_column" if c.messages_column else "prompt_column"
            raise ValueError(f"{name} {c.prompt_spec.column!r} is not a column of the dataset "
                             f"(columns: {ds.columns()})")
        for name, column in (("image_column", c.image_column), ("lora_column", c.lora_column)):
            if column is not None and column not in ds.columns():
                raise ValueError(f"{name} {column!r} is not a column of the dataset "
                                 f"(columns: {ds.columns()})")
        size = c.concurrency if isinstance(c.concurrency, tuple) else (c.concurrency,) * 2
        compute = ray.data.ActorPoolStrategy(
            min_size=size[0], max_size=size[1],
            max_tasks_in_flight_per_actor=c.max_tasks_in_flight_per_actor)
        remote: dict[str, Any] = {} if c.runtime_env is None else {"runtime_env": c.runtime_env}
        ds = ds.map_batches(_Generate, fn_constructor_args=(c,), batch_size=c.batch_size,
                            batch_format="pyarrow", compute=compute, num_gpus=c.num_gpus,
                            num_cpus=c.num_cpus, **remote)
        if c.score is not None:
            ds = score_and_select(ds, c, remote)
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def build_processor(config: BatchgenProcessorConfig,
                    preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None) -> Processor:
    """`ray.data.llm.build_processor` for batchgen: `build_processor(config)(ds)` is a Ray
    Dataset of the input columns plus `row_id`, `num_prompt_tokens` and `outputs`."""
    if not isinstance(config, BatchgenProcessorConfig):
        raise ValueError(f"config must be a BatchgenProcessorConfig, got {type(config).__name__}")
    try:
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError("batchgen.ray needs Ray Data: pip install 'batchgen[ray]'") from e
    return Processor(config, preprocess, postprocess)


def numbered_blocks(data: Any, size: int) -> list[pa.Table]:
    """A `datasets.Dataset` as Arrow blocks of `size` rows (one actor call each) with a
    `row_id` column of their positions, the ids a local job gives them; for
    `ray.data.from_arrow`."""
    arrow = data.with_format("arrow")
    blocks = []
    for start in range(0, len(data), size):
        block = arrow[start:start + size]
        ids = pa.array(range(start, start + block.num_rows), pa.int64())
        blocks.append(block.append_column(ROW_ID, ids))
    return blocks


def with_row_ids(ds: ray.data.Dataset) -> ray.data.Dataset:
    """`ds` with a `row_id` column: each row's position (what `generate_dataset` calls a row id,
    and what seeds its samples), zipped from `ray.data.range`. Positions need a deterministic
    order, so this turns on Ray Data's `preserve_order` for the run; a `row_id` column of
    your own (stable ids from your data) needs neither."""
    import warnings

    import ray.data

    if not hasattr(ds, "zip"):
        raise ValueError("the dataset has no 'row_id' column and this Ray has no Dataset.zip "
                         "to number rows: add a 'row_id' column of stable integer ids, e.g. "
                         "ray.data.from_huggingface(hf.add_column('row_id', range(len(hf))))")
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ids = ray.data.range(ds.count()).rename_columns({"id": ROW_ID})
    with warnings.catch_warnings():  # zip's deprecation note is about unordered execution
        warnings.simplefilter("ignore")
        return ds.zip(ids)


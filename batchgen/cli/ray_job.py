"""`batchgen generate|beam --ray`: the same dataset job on Ray Data. The input is read here
(the driver), numbered with its row ids (its positions, as in a local job) and handed to Ray as
Arrow blocks of `--batch-size` rows; the actors generate and Ray writes the output in
`--output-format` (the local job's shard writers: Parquet or JSON Lines)."""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

from batchgen.checks import check
from batchgen.cli.common import CliError
from batchgen.data.prompts import PromptSpec
from batchgen.data.rows import output_schema
from batchgen.data.source import Source
from batchgen.data.writers import ShardWriter, writer_for


def run_on_ray(args: argparse.Namespace, params: Any, template: str | None, source: Source,
               engine: dict[str, Any]) -> int:
    """Start (or join) Ray, run the processor over the input, write the output in
    `--output-format`, print a summary."""
    ray = _import_ray()
    from batchgen.ray import BatchgenProcessorConfig, build_processor, numbered_blocks
    from batchgen.ray.sinks import write_dataset

    _check_flags(args, engine)
    if source.num_rows is None:
        raise CliError("--ray needs an input of known length (a file, a folder or a saved "
                       "dataset)")
    output_schema(source.schema, params)  # a ValueError for a column batchgen would add
    writer = writer_for(args.output_format)
    spec = PromptSpec(None if args.messages_column else args.prompt_column or "prompt",
                      args.messages_column, template)
    try:
        config = BatchgenProcessorConfig(
            model_source=_path(args.model), **_score_fields(args, engine),
            sampling_params=params, engine_kwargs=engine,
            prompt_column=spec.prompt_column or "prompt", messages_column=spec.messages_column,
            chat_template=template, seed=args.seed, image_column=args.image_column,
            lora_column=args.lora_column, loras=args.loras or None, batch_size=args.batch_size,
            concurrency=args.actors, num_gpus=args.gpus_per_actor, num_cpus=args.cpus_per_actor)
    except ValueError as e:  # e.g. a shared GPU without a pool size for each model
        raise CliError(str(e)) from None
    started = not ray.is_initialized()
    if started:
        # a local Ray gets a CPU beyond its actors' (reading and writing tasks need one)
        scorers = args.score_actors if getattr(args, "score_model", None) is not None else 0
        cpus = None if args.ray_address else max(
            os.cpu_count() or 1, math.ceil(args.actors * args.cpus_per_actor) + scorers + 1)
        ray.init(address=args.ray_address, num_cpus=cpus, include_dashboard=False,
                 log_to_driver=not args.quiet)
    try:
        start = time.perf_counter()
        ds = ray.data.from_arrow(numbered_blocks(source.dataset, args.batch_size))
        write_dataset(build_processor(config)(ds), str(Path(args.output).expanduser()), writer)
        seconds = time.perf_counter() - start
    finally:
        if started:
            ray.shutdown()
    rows, samples = _count(Path(args.output).expanduser(), writer)
    print(f"batchgen: {rows} rows, {samples} samples in {args.output} (Ray, {args.actors} "
          f"actor{'s' if args.actors > 1 else ''}, {seconds:.1f} s)")
    return 0


def _check_flags(args: argparse.Namespace, engine: dict[str, Any]) -> None:
    """The actor flags, as CliErrors naming the flag."""
    check(args.actors >= 1, "--actors", ">= 1", args.actors)
    check(args.batch_size >= 1, "--batch-size", ">= 1", args.batch_size)
    check(args.gpus_per_actor >= 0, "--gpus-per-actor", ">= 0", args.gpus_per_actor)
    check(args.cpus_per_actor >= 0, "--cpus-per-actor", ">= 0", args.cpus_per_actor)
    tp = args.tensor_parallel_size
    check(tp == 1 or args.gpus_per_actor == 0 or args.gpus_per_actor >= tp, "--gpus-per-actor",
          f"0 (CPU actors) or >= --tensor-parallel-size ({tp}, a GPU per rank)",
          args.gpus_per_actor)
    check(args.score_actors >= 1, "--score-actors", ">= 1", args.score_actors)
    check(args.score_gpus_per_actor >= 0, "--score-gpus-per-actor", ">= 0",
          args.score_gpus_per_actor)
    _check_shared_gpus(args, engine)


def _check_shared_gpus(args: argparse.Namespace, engine: dict[str, Any]) -> None:
    """A fraction of a GPU per actor shares the GPU: each model's KV pool needs its own size
    (gpu_memory_utilization counts the other model's memory as used)."""
    if 0 < args.gpus_per_actor < 1 and not (engine.get("kv_cache_memory")
                                            or engine.get("num_kv_blocks")):
        raise CliError(f"--gpus-per-actor {args.gpus_per_actor} shares a GPU: give the "
                       f"generator's KV pool a size (--kv-cache-memory or --num-kv-blocks)")
    if (getattr(args, "score_model", None) is not None and 0 < args.score_gpus_per_actor < 1
            and args.score_kv_cache_memory is None):
        raise CliError(f"--score-gpus-per-actor {args.score_gpus_per_actor} shares a GPU: "
                       f"give the scorer's KV pool a size (--score-kv-cache-memory)")


def _path(model: str) -> str:
    """A local model folder as an absolute path (the actors' working directory differs)."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def _score_fields(args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    """The score and select stages' fields (--score-model, --select, the scorer's actors and
    pool); the scorer runs on the generator's --device."""
    if getattr(args, "score_model", None) is None:
        return {}
    from batchgen.cli.kv_plan import parse_memory

    kwargs = {"device": engine.get("device")} if engine.get("device") else {}
    if args.score_kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = parse_memory(args.score_kv_cache_memory,
                                                 "--score-kv-cache-memory")
    return {"score": _path(args.score_model), "select": args.select,
            "score_engine_kwargs": kwargs, "score_concurrency": args.score_actors,
            "score_num_gpus": args.score_gpus_per_actor}


def _import_ray() -> Any:
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise CliError("--ray needs Ray Data: pip install 'batchgen[ray]'") from e
    return ray


def _count(output: Path, writer: ShardWriter) -> tuple[int, int]:
    """Rows and samples in the written files (read a batch at a time)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    rows = samples = 0
    for batch in pads.dataset(output, format=writer.arrow_format).to_batches(columns=["outputs"]):
        rows += batch.num_rows
        samples += pc.sum(pc.list_value_length(batch.column("outputs"))).as_py() or 0
    return rows, samples

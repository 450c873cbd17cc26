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

    check(args.actors >= 1, "--actors", ">= 1", args.actors)
    check(args.batch_size >= 1, "--batch-size", ">= 1", args.batch_size)
    check(args.gpus_per_actor >= 0, "--gpus-per-actor", ">= 0", args.gpus_per_actor)
    check(args.cpus_per_actor >= 0, "--cpus-per-actor", ">= 0", args.cpus_per_actor)
    tp = args.tensor_parallel_size
    check(args.gpus_per_actor == 0 or args.gpus_per_actor >= tp, "--gpus-per-actor",
          f"0 (CPU actors) or >= --tensor-parallel-size ({tp}, a GPU per rank)",
          args.gpus_per_actor)
    if source.num_rows is None:
        raise CliError("--ray needs an input of known length (a file, a folder or a saved "
                       "dataset)")
    output_schema(source.schema, params)  # a ValueError for a column batchgen would add
    writer = writer_for(args.output_format)
    spec = PromptSpec(None if args.messages_column else args.prompt_column or "prompt",
                      args.messages_column, template)
    config = BatchgenProcessorConfig(
        model_source=str(Path(args.model).expanduser().resolve()) if Path(
            args.model).expanduser().exists() else args.model,
        sampling_params=params, engine_kwargs=engine, prompt_column=spec.prompt_column or "prompt",
        messages_column=spec.messages_column, chat_template=template, seed=args.seed,
        image_column=args.image_column, lora_column=args.lora_column,
        loras=args.loras or None,
        batch_size=args.batch_size, concurrency=args.actors, num_gpus=args.gpus_per_actor,
        num_cpus=args.cpus_per_actor)
    started = not ray.is_initialized()
    if started:
        # a local Ray gets a CPU beyond its actors' (reading and writing tasks need one)
        cpus = None if args.ray_address else max(
            os.cpu_count() or 1, math.ceil(args.actors * args.cpus_per_actor) + 1)
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

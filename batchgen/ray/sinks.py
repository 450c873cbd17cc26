"""Writing a Ray Data job's output in a dataset job's formats (data/writers.py): Parquet through
Ray's own writer, JSON Lines through a sink that writes exactly what the local JSONL shard
writer does (Ray's `write_json` goes through pandas, which rounds floats to 10 digits)."""

from __future__ import annotations

from typing import Any

from ray.data.datasource.file_datasink import BlockBasedFileDatasink

from batchgen.data.writers import ShardWriter, jsonl_text


class JsonlDatasink(BlockBasedFileDatasink):
    """One `.jsonl` file per block, a row per line, floats written in full (`json.dumps`)."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, file_format="jsonl", **kwargs)

    def write_block_to_file(self, block: Any, file: Any) -> None:
        file.write(jsonl_text(block.to_arrow().to_pylist()).encode())


def write_dataset(dataset: Any, folder: str, writer: ShardWriter) -> None:
    """Write a Ray Data `Dataset` to `folder` in `writer`'s format (the `--ray` job's output)."""
    if writer.name == "jsonl":
        dataset.write_datasink(JsonlDatasink(folder))
    elif writer.name == "parquet":
        dataset.write_parquet(folder)
    else:
        raise ValueError(f"output_format {writer.name!r} has no Ray writer; use parquet or jsonl")

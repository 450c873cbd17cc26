"""A Ray Data sink that writes JSON Lines exactly as the local JSONL shard writer does (Ray's
own `write_json` goes through pandas, which rounds floats to 10 digits)."""

from __future__ import annotations

from typing import Any

from ray.data.datasource.file_datasink import BlockBasedFileDatasink

from batchgen.data.writers import jsonl_text


class JsonlDatasink(BlockBasedFileDatasink):
    """One `.jsonl` file per block, a row per line, floats written in full (`json.dumps`)."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, file_format="jsonl", **kwargs)

    def write_block_to_file(self, block: Any, file: Any) -> None:
        file.write(jsonl_text(block.to_arrow().to_pylist()).encode())

"""The file formats a dataset job's shards are written in, behind one interface: a writer
writes a shard atomically (temporary file, fsync, rename) and reads it back for resume and for
the returned Dataset. `WRITERS` maps each `output_format` name to its writer."""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.checks import check_choice

if TYPE_CHECKING:
    import datasets


class ShardWriter(ABC):
    """One output format: its file suffix, an atomic write, and the reads a resume needs."""

    name: str  # the output_format value
    suffix: str  # a shard's file suffix, ".parquet"
    arrow_format: str  # pyarrow.dataset's name for it (reads a folder of shards)

    def write(self, table: pa.Table, path: Path) -> None:
        """Write `table` to `path` atomically: whole or absent after a crash at any point."""
        atomic_write(path, lambda tmp: self._write_file(table, tmp))

    @abstractmethod
    def _write_file(self, table: pa.Table, path: Path) -> None:
        """Write `table` to `path` (a temporary file: `write` renames it into place)."""

    @abstractmethod
    def read(self, path: Path, columns: list[str] | None = None) -> pa.Table:
        """The shard at `path` as a table (only `columns` when given)."""

    def schema(self, path: Path) -> pa.Schema:
        """The Arrow schema of the shard at `path` (a resume writes its next shards under it)."""
        return self.read(path).schema

    def rows(self, path: Path) -> list[dict[str, Any]]:
        """The shard's rows as written (a shard written again with more rows keeps them)."""
        return self.read(path).to_pylist()

    @abstractmethod
    def load(self, files: list[Path], schema: pa.Schema | None) -> datasets.Dataset:
        """The shards as one Dataset (memory-mapped through the datasets cache)."""


class ParquetWriter(ShardWriter):
    """Parquet shards: typed, compressed, read by pyarrow, pandas and polars as one folder."""

    name, suffix, arrow_format = "parquet", ".parquet", "parquet"

    def _write_file(self, table: pa.Table, path: Path) -> None:
        pq.write_table(table, path)

    def read(self, path: Path, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(path, columns=columns)

    def schema(self, path: Path) -> pa.Schema:
        return pq.read_schema(path)

    def load(self, files: list[Path], schema: pa.Schema | None) -> datasets.Dataset:
        import datasets

        return datasets.load_dataset("parquet", data_files=[str(f) for f in files],
                                     split="train")


class JsonlWriter(ShardWriter):
    """JSON Lines shards: one row per line, readable by any tool (no types beyond JSON's: the
    job's Arrow schema is applied again when read back)."""

    name, suffix, arrow_format = "jsonl", ".jsonl", "json"

    def _write_file(self, table: pa.Table, path: Path) -> None:
        path.write_text(jsonl_text(table.to_pylist()), encoding="utf-8")

    def read(self, path: Path, columns: list[str] | None = None) -> pa.Table:
        table = pa.Table.from_pylist(list(read_jsonl(path)))  # types as the first run inferred
        return table if columns is None else table.select(columns)

    def rows(self, path: Path) -> list[dict[str, Any]]:
        return list(read_jsonl(path))  # the JSON values themselves (no types inferred)

    def load(self, files: list[Path], schema: pa.Schema | None) -> datasets.Dataset:
        import datasets

        features = None if schema is None else datasets.Features.from_arrow_schema(schema)
        return datasets.load_dataset("json", data_files=[str(f) for f in files],
                                     features=features, split="train")


WRITERS: dict[str, ShardWriter] = {w.name: w for w in (ParquetWriter(), JsonlWriter())}


def writer_for(output_format: object) -> ShardWriter:
    """The writer of `output_format` (ValueError naming the argument and the formats)."""
    check_choice(output_format, "output_format", tuple(WRITERS))
    return WRITERS[output_format]  # type: ignore[index]


def read_jsonl(path: Path, skip_torn: bool = False) -> Iterator[Any]:
    """The JSON value of every non-blank line of `path`; with `skip_torn`, lines that do not
    parse (a line torn by a kill while appending) are skipped instead of raising."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                if not skip_torn:
                    raise


def jsonl_text(records: Iterable[Any]) -> str:
    """One JSON value per line (floats in full: they read back to the same value)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def write_jsonl(records: Iterable[Any], path: Path) -> None:
    """Write one JSON value per line to `path`, atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(jsonl_text(records), encoding="utf-8"))


def atomic_write(path: Path, fill: Callable[[Path], None]) -> None:
    """`fill` a temporary file beside `path` (`.NAME.tmp`), fsync it, rename it over `path`
    and fsync the folder, so `path` is the old file or the whole new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    fill(tmp)
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""The input of a dataset job: a `datasets` object or a path, read row by row, lazily."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import warnings
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

# File suffix -> the `datasets` packaged builder that reads it.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Source:
    """Rows of the input with their ids (the position in the input), the columns' Arrow schema
    when known, the row count when known, and a fingerprint that identifies the input for
    resume."""

    dataset: Any  # datasets.Dataset or IterableDataset
    schema: pa.Schema | None
    num_rows: int | None
    fingerprint: str
    json_lines: tuple[Path, ...] = ()  # the JSON Lines files read, in order (row ids by line)
    _lines: dict[Path, array] | None = field(default=None, repr=False)

    @property
    def column_names(self) -> list[str] | None:
        return None if self.schema is None else list(self.schema.names)

    @property
    def content_fingerprint(self) -> bool:
        """Whether `fingerprint` changes with the rows (files, a Dataset); an iterable's
        names only its columns, so a resume must look at its rows."""
        return not self.fingerprint.startswith("iterable:")

    def rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(row id, row) for every row, in input order, never all in memory."""
        return enumerate(iter(self.dataset))

    def where(self, row_id: int) -> str:
        """How a message names a row: "row 55", with "(line 56 of FILE)" for JSON Lines."""
        at = self._line_of(row_id)
        return f"row {row_id}" if at is None else f"row {row_id} (line {at[1]} of {at[0]})"

    def _line_of(self, row_id: int) -> tuple[Path, int] | None:
        """The file and 1-based line of a JSON Lines row (blank lines hold no row), indexed
        on the first call."""
        if not self.json_lines:
            return None
        if self._lines is None:
            self._lines = {f: array("L", (n for n, line in enumerate(f.open("rb"), 1)
                                          if line.strip())) for f in self.json_lines}
        for f, numbers in self._lines.items():
            if row_id < len(numbers):
                return f, numbers[row_id]
            row_id -= len(numbers)
        return None


def open_source(data: Any) -> Source:
    """A `datasets.Dataset`, an `IterableDataset`, or a path: a JSONL / JSON / Parquet / CSV
    file, a folder of such files, or a folder written by `save_to_disk`. ValueError (naming
    `data` and the accepted forms) for anything else, an unreadable file or no rows."""
    import datasets

    if isinstance(data, Source):
        return data
    if isinstance(data, datasets.DatasetDict):
        raise ValueError(f"data is a DatasetDict with splits {list(data)}: pass one split, "
                         "e.g. data['train']")
    if isinstance(data, datasets.Dataset):
        return _from_dataset(data, data._fingerprint)
    if isinstance(data, datasets.IterableDataset):
        # An iterable has no content hash: a resume recognises it by its columns only, so the
        # caller passes the same rows in the same order.
        schema = data.features.arrow_schema if data.features is not None else None
        columns = "?" if schema is None else ",".join(f"{f.name}:{f.type}" for f in schema)
        digest = hashlib.sha256(columns.encode()).hexdigest()[:16]
        return Source(data, schema, None, f"iterable:{digest}")
    if isinstance(data, (str, os.PathLike)):
        return _from_path(Path(os.path.expanduser(os.fspath(data))))
    raise ValueError("data must be a datasets.Dataset, an IterableDataset, or the path of a "
                     f"JSONL/JSON/Parquet/CSV file or dataset folder, got {type(data).__name__}")


def undecoded_images(source: Source, column: str | None) -> Source:
    """The source with datasets' `Image` feature in `column` left encoded ({"bytes", "path"}
    per row): rows stay writable to the output shards and fingerprinted by their bytes; the
    processor decodes each image when its request is built."""
    import datasets

    features = getattr(source.dataset, "features", None)
    if column is None or not features or not isinstance(features.get(column), datasets.Image):
        return source
    if not features[column].decode:
        return source
    ds = source.dataset.cast_column(column, datasets.Image(decode=False))
    return dataclasses.replace(source, dataset=ds, schema=ds.features.arrow_schema)


def _from_dataset(ds: Any, fingerprint: str) -> Source:
    if len(ds) == 0:
        raise ValueError("data has no rows")
    return Source(ds, ds.features.arrow_schema, len(ds), fingerprint)


def _from_path(path: Path) -> Source:
    """Read a file or folder with `datasets` (memory-mapped Arrow, built once per file)."""
    import datasets

    if not path.exists():
        raise ValueError(f"data path {str(path)!r} does not exist")
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise ValueError(f"data folder {str(path)!r} holds splits {list(ds)}: pass the "
                             "folder of one split")
        return _from_dataset(ds, ds._fingerprint)
    files = sorted(f for f in path.iterdir() if f.suffix in BUILDERS) if path.is_dir() else [path]
    kinds = {BUILDERS.get(f.suffix) for f in files}
    if not files or None in kinds or len(kinds) != 1:
        raise ValueError(f"data {str(path)!r} must be a .jsonl/.json/.parquet/.csv file, a "
                         "folder of files of one of those kinds, or a save_to_disk folder")
    kind = kinds.pop()
    try:
        with quiet_datasets():
            ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets raises many error types for a bad file
        if _no_rows(files, kind):
            raise ValueError("data has no rows") from e
        cause = (_bad_json_line(files) if kind == "json" else None) or _root_cause(e)
        raise ValueError(f"data {str(path)!r} cannot be read: {cause}") from e
    source = _from_dataset(ds, _files_fingerprint(files))
    if kind == "json" and all(_is_json_lines(f) for f in files):
        source.json_lines = tuple(files)
    return source


def _is_json_lines(path: Path) -> bool:
    """Whether a .json/.jsonl file holds one row per line (its first line is a whole object;
    a JSON array or a document over many lines is not)."""
    with path.open("rb") as f:
        first = next((line for line in f if line.strip()), b"")
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


def _bad_json_line(files: list[Path]) -> str | None:
    """"line N of FILE is not JSON (...)" for the first line of a JSON Lines file that does not
    parse (None when every line does, or a file is one JSON document over many lines)."""
    for f in files:
        if not _is_json_lines(f):
            continue
        with f.open("rb") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except ValueError as e:
                    why = f"{e.msg} at column {e.colno}" if isinstance(
                        e, json.JSONDecodeError) else str(e)
                    return f"line {number} of {f} is not JSON ({why})"
    return None


def _no_rows(files: list[Path], kind: str) -> bool:
    """Whether the files hold no rows (datasets fails on those rather than loading nothing)."""
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            return sum(pq.ParquetFile(f).metadata.num_rows for f in files) == 0
        header = 1 if kind == "csv" else 0
        return all(sum(1 for line in f.open() if line.strip()) <= header for f in files)
    except Exception:  # unreadable: not "empty"
        return False


def _root_cause(e: BaseException) -> str:
    """The innermost exception's type and message (datasets wraps the parser's error)."""
    while (inner := e.__cause__ or e.__context__) is not None:
        e = inner
    return f"{type(e).__name__}: {e}"


def _files_fingerprint(files: list[Path]) -> str:
    """Identifies input files by path, size and modification time (cheap, no full read)."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return "files:" + h.hexdigest()[:16]


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """`datasets` without its progress bars and pyarrow's sort deprecation warning: the rows
    bar of the job says everything."""
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)  # its own ERROR lines repeat our error
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if was_on:
            datasets.enable_progress_bars()

"""Crash-safe output of a dataset job: shards (Parquet or JSONL, see writers.py) written
atomically plus a manifest.

A shard is written to `.part-NNNNN.SUFFIX.tmp`, fsynced, renamed into place, and only then
listed (with its size and SHA-256) in `_manifest.json`, itself replaced atomically. So after a
crash at any point a shard is either listed and whole, or not listed: on resume, listed shards
are checked against their size and hash, and whatever is not a whole listed shard (a `.tmp`,
an unlisted shard, a truncated one) is deleted and its rows are computed again.

Each listed shard also carries a fingerprint of its rows' inputs (and the ids of rows skipped
with an error), so a resume after the input changed keeps the rows whose input did not: a shard
holding changed rows (or error rows, which are retried) is rewritten without them, as a new
shard listed in its place, and only those rows are computed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.data import writers
from batchgen.data.identity import row_fingerprint, rows_fingerprint
from batchgen.data.rows import ROW_ID, input_part
from batchgen.data.writers import WRITERS, ShardWriter

logger = logging.getLogger("batchgen")

MANIFEST = "_manifest.json"  # "_" and "." names: pyarrow, pandas, polars skip them
FORMAT = "batchgen-shards/1"
_SUFFIXES = "|".join(re.escape(w.suffix) for w in WRITERS.values())
_SHARD = re.compile(rf"^part-(\d{{5,}})(?:{_SUFFIXES})$")
_TMP = re.compile(rf"^\.part-(\d{{5,}})(?:{_SUFFIXES})\.tmp$")
# The job's input: checked row by row on resume (a changed row is redone), not refused.
INPUT_KEYS = ("input", "input_rows")
# Job keys newer than the manifest format: a manifest written before one existed is not
# refused for lacking it.
NEWER_KEYS = ("model_files",)


@dataclass(frozen=True)
class ShardInfo:
    """One whole shard as the manifest lists it: its file, size and hash, its rows' input
    fingerprint (None in manifests older than it) and the ids of its rows that hold an error."""

    file: str
    rows: int
    bytes: int
    sha256: str
    inputs: str | None = None
    errors: tuple[int, ...] = ()


class ShardStore:
    """Owns `output_dir`: writes shards and the manifest, and knows which rows are done."""

    def __init__(self, output_dir: Path, job: dict[str, Any], resume: bool,
                 writer: ShardWriter = WRITERS["parquet"]) -> None:
        self.dir = output_dir
        self.job = job
        self.writer = writer
        self.shards: list[ShardInfo] = []
        self.done_ids: set[int] = set()  # rows of the shards kept on resume (not updated)
        self.ids_of: dict[str, list[int]] = {}  # row ids of each shard kept on resume
        self.schema: pa.Schema | None = None  # of the shards already written, when resuming
        self.stored_input: dict[str, Any] | None = None  # the input the kept shards were of
        check_output_dir(self.dir, resume)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._load(resume)

    # ---- resume --------------------------------------------------------------------------------
    def _load(self, resume: bool) -> None:
        """Refuse to mix jobs or to overwrite without `resume`; on resume keep the whole listed
        shards and delete everything else of ours."""
        if not resume:
            return
        manifest = self._read_manifest()
        leftovers = _ours(self.dir)
        if manifest is not None:
            self._check_same_job(manifest.get("job", {}))
            self.shards = [s for s in (ShardInfo(**d) for d in manifest.get("shards", []))
                           if self._whole(s)]
        keep = {s.file for s in self.shards}
        for p in leftovers:
            if p.name not in keep:
                logger.info("resume: removing %s (not a whole listed shard; its rows are redone)",
                            p.name)
                p.unlink()
        for s in self.shards:
            table = self.writer.read(self.dir / s.file, columns=[ROW_ID])
            self.ids_of[s.file] = table.column(ROW_ID).to_pylist()
            self.done_ids.update(self.ids_of[s.file])
        if self.shards:
            self.schema = self.writer.schema(self.dir / self.shards[0].file)
        if manifest is not None:  # listed until reconcile has checked the rows against it
            self.stored_input = {k: manifest["job"].get(k) for k in INPUT_KEYS}
        self._write_manifest(complete=False)

    def _check_same_job(self, stored: dict[str, Any]) -> None:
        """Resume only the job that wrote the folder (model, params, seed, prompt source,
        columns, format); its input may have changed (see reconcile)."""
        keys = (set(stored) | set(self.job)) - set(INPUT_KEYS)
        differ = sorted(k for k in keys if stored.get(k) != self.job.get(k)
                        and not (k in NEWER_KEYS and k not in stored))
        if differ:
            raise ValueError(f"output_dir {str(self.dir)!r} holds a different job ({', '.join(differ)}"
                             " differ): resume it with the same settings, or use a new folder")

    def _whole(self, s: ShardInfo) -> bool:
        """Whether a listed shard is on disk, whole (size and SHA-256 as listed)."""
        path = self.dir / s.file
        if path.is_file() and path.stat().st_size == s.bytes and _sha256(path) == s.sha256:
            return True
        logger.warning("resume: shard %s is missing or torn; its rows are redone", s.file)
        return False

    def reconcile(self, current: Mapping[int, str] | None, errors: bool,
                  whole_shards: bool = False) -> set[int]:
        """After `_load`, against the input as it is now (`current`: row id -> input
        fingerprint of each kept row still in the input; None: the input is unchanged): drop
        from the shards the rows whose input changed or is gone, and the rows that hold an
        error (they are retried), each shard rewritten without them. Returns the dropped ids
        (they are no longer in `done_ids`). `errors`: the shards have an `error` column.
        `whole_shards` (an image column of paths: a row's stored input cannot tell which
        file changed): a shard whose fingerprint differs is redone whole."""
        dropped: set[int] = set()
        for info in list(self.shards):
            ids = self.ids_of[info.file]
            stale = set(info.errors)
            if current is not None:
                stale |= self._changed(info, ids, current, errors, whole_shards)
            if stale:
                self._rewrite(info, stale, current)
                dropped |= stale & set(ids)
        self.done_ids -= dropped
        self.stored_input = None
        self._write_manifest(complete=False)
        return dropped

    def _changed(self, info: ShardInfo, ids: list[int], current: Mapping[int, str],
                 errors: bool, whole_shards: bool = False) -> set[int]:
        """The rows of a shard whose input is gone or differs from the current one (found by
        the shard's fingerprint first: only a shard that differs is read row by row)."""
        gone = {i for i in ids if i not in current}
        if not gone and info.inputs == rows_fingerprint({i: current[i] for i in ids}):
            return set()
        if whole_shards:
            return set(ids)
        table = self.writer.read(self.dir / info.file)
        stored = {r[ROW_ID]: row_fingerprint(input_part(r, errors)) for r in table.to_pylist()}
        return gone | {i for i in ids if i not in gone and stored.get(i) != current[i]}

    def _rewrite(self, info: ShardInfo, stale: set[int], current: Mapping[int, str] | None
                 ) -> None:
        """Replace a listed shard by one without the `stale` rows (none left: unlist it),
        listed before the old file goes: a crash leaves the old shard listed, or the new one
        (the old then unlisted, deleted by the next resume)."""
        table = self.writer.read(self.dir / info.file)
        keep = pc.invert(pc.is_in(table.column(ROW_ID), pa.array(sorted(stale), pa.int64())))
        table = table.filter(keep)
        at = self.shards.index(info)
        if table.num_rows:
            ids = table.column(ROW_ID).to_pylist()
            inputs = None if current is None else rows_fingerprint({i: current[i] for i in ids})
            new = self._write_table(table, inputs, ())
            self.shards[at] = new
            self.ids_of[new.file] = ids
        else:
            del self.shards[at]
        self._write_manifest(complete=False)
        (self.dir / info.file).unlink()
        logger.info("resume: %s had %d changed or failed row(s): rewritten without them, which "
                    "are redone", info.file, info.rows - table.num_rows)

    # ---- writing -------------------------------------------------------------------------------
    def write(self, rows: list[dict[str, Any]], schema: pa.Schema | None,
              fingerprints: Mapping[int, str] | None = None, errors: tuple[int, ...] = ()
              ) -> ShardInfo:
        """Write `rows` as the next shard (atomically), then list it in the manifest with its
        rows' input fingerprint (from `fingerprints`: row id -> row_fingerprint) and the ids
        of its error rows."""
        table = pa.Table.from_pylist(rows, schema=schema or self.schema)
        if self.schema is None:
            self.schema = table.schema
        inputs = None if fingerprints is None else rows_fingerprint(fingerprints)
        info = self._write_table(table, inputs, tuple(errors))
        self.shards.append(info)
        self._write_manifest(complete=False)
        return info

    def _write_table(self, table: pa.Table, inputs: str | None, errors: tuple[int, ...]
                     ) -> ShardInfo:
        """Write `table` as the next shard file (atomically); its listing, not yet listed."""
        name = f"part-{self._next_index():05d}{self.writer.suffix}"
        self.writer.write(table, self.dir / name)
        return ShardInfo(name, table.num_rows, (self.dir / name).stat().st_size,
                         _sha256(self.dir / name), inputs, errors)

    def finish(self) -> None:
        """Mark the job complete in the manifest."""
        self._write_manifest(complete=True)

    def files(self) -> list[Path]:
        return [self.dir / s.file for s in self.shards]

    def _next_index(self) -> int:
        used = [int(_SHARD.match(s.file).group(1)) for s in self.shards]  # type: ignore[union-attr]
        return max(used, default=-1) + 1

    def _read_manifest(self) -> dict[str, Any] | None:
        path = self.dir / MANIFEST
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(path)!r} is not a readable batchgen manifest: {e}") from e
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is not a batchgen manifest ({FORMAT})")
        return manifest

    def _write_manifest(self, complete: bool) -> None:
        """List the job and the shards (the stored input until reconcile has run)."""
        job = self.job if self.stored_input is None else {**self.job, **self.stored_input}
        payload = {"format": FORMAT, "job": job, "complete": complete,
                   "rows": sum(s.rows for s in self.shards),
                   "shards": [asdict(s) for s in self.shards]}
        writers.atomic_write(self.dir / MANIFEST,
                             lambda tmp: tmp.write_text(json.dumps(payload, indent=1) + "\n"))


def check_output_dir(path: Path, resume: bool) -> None:
    """Without `resume`, refuse a folder that already holds a job's files (before any work:
    the CLI calls this before it loads the model)."""
    if not resume and path.is_dir() and ((path / MANIFEST).exists() or _ours(path)):
        raise ValueError(f"output_dir {str(path)!r} already holds shards of a job: pass "
                         "resume=True (--resume) to continue it, or use an empty folder")
    if path.exists() and not path.is_dir():
        raise ValueError(f"output_dir {str(path)!r} is a file, not a folder")


def _ours(path: Path) -> list[Path]:
    """The shard files (whole or not) in `path`."""
    return [p for p in path.iterdir() if _SHARD.match(p.name) or _TMP.match(p.name)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


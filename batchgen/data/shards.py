"""Crash-safe output of a dataset job: shards (Parquet or JSONL, see writers.py) written
atomically plus a manifest.

Shard k holds the rows with ids in [k*R, (k+1)*R), ordered by id (R: `rows_per_shard`, recorded
in the manifest: a resume keeps the layout it started with), so the files of an interrupted and
resumed job are the bytes an uninterrupted one writes. A shard is written to
`.part-NNNNN.SUFFIX.tmp`, fsynced, renamed into place, and only then listed (with its size and
SHA-256) in `_manifest.json`, itself replaced atomically. So after a crash at any point a shard
is either listed and whole, or not listed: on resume, listed shards are checked against their
size and hash, and whatever is not a whole listed shard (a `.tmp`, an unlisted shard, a
truncated one) is deleted and its rows are computed again. A shard written before all its rows
finished (closed by time, or by an interruption) is written again, whole, under its name once
they have.

Each listed shard also carries a fingerprint of its rows' inputs (and the ids of rows skipped
with an error), so a resume after the input changed keeps the rows whose input did not: a shard
holding changed rows (or error rows, which are retried) is rewritten without them under its
name, and only those rows are computed again (then it is written whole again).
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
    """Owns `output_dir`: writes shards by row-id range and the manifest, and knows which rows
    are done."""

    def __init__(self, output_dir: Path, job: dict[str, Any], resume: bool,
                 writer: ShardWriter = WRITERS["parquet"], rows_per_shard: int = 256) -> None:
        self.dir = output_dir
        self.job = job
        self.writer = writer
        self.rows_per_shard = rows_per_shard  # R: shard k holds row ids [k*R, (k+1)*R)
        self.shards: list[ShardInfo] = []  # ordered by shard index
        self.done_ids: set[int] = set()  # rows of the shards kept on resume (not updated)
        self.ids_of: dict[str, list[int]] = {}  # row ids of each listed shard
        self.known: dict[int, dict[int, str]] = {}  # shard index -> its rows' input
        # fingerprints, for the shards not full yet (written again whole when they fill)
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
            self.rows_per_shard = manifest.get("rows_per_shard", self.rows_per_shard)
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
        if any(i // self.rows_per_shard != shard_index(s) for s in self.shards
               for i in self.ids_of[s.file]):
            self._regroup()  # shards written before the row-id layout
        self._write_manifest(complete=False)

    def _regroup(self) -> None:
        """Move the kept rows of shards written in finishing order (before the row-id
        layout) into the layout's shards (their input fingerprints unknown: None, so a
        resume after the input changed reads them row by row)."""
        old, rows = list(self.shards), []
        errors = {i for s in old for i in s.errors}
        for s in old:
            rows += self.writer.rows(self.dir / s.file)
        self.shards, self.ids_of = [], {}
        groups: dict[int, list[dict[str, Any]]] = {}
        for r in rows:
            groups.setdefault(r[ROW_ID] // self.rows_per_shard, []).append(r)
        for k in sorted(groups):
            ids = {r[ROW_ID] for r in groups[k]}
            self._put(k, groups[k], self.schema, None, tuple(sorted(errors & ids)))
        for s in old:
            if s.file not in self.ids_of:
                (self.dir / s.file).unlink()
        logger.info("resume: %d shard(s) regrouped by row id (%d rows per shard)", len(old),
                    self.rows_per_shard)

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
        """Write a listed shard again without the `stale` rows, under its name (none left:
        unlist and delete it). A crash between the rename and the manifest leaves a listed
        name whose hash differs: the next resume redoes its rows."""
        rows = [r for r in self.writer.rows(self.dir / info.file) if r[ROW_ID] not in stale]
        if rows:
            ids = [r[ROW_ID] for r in rows]
            fps = None if current is None else {i: current[i] for i in ids}
            self._put(shard_index(info), rows, self.schema, fps,
                      tuple(i for i in info.errors if i not in stale))
        else:
            self.shards.remove(info)
            del self.ids_of[info.file]
            self._write_manifest(complete=False)
            (self.dir / info.file).unlink()
        logger.info("resume: %s had %d changed or failed row(s): rewritten without them, which "
                    "are redone", info.file, info.rows - len(rows))

    def remember(self, fingerprints: Mapping[int, str]) -> None:
        """The input fingerprints of kept rows in shards that are not full (the job gives
        them on resume: a shard written again with more rows lists all its rows')."""
        for s in self.shards:
            if s.rows < self.rows_per_shard:
                ids = self.ids_of[s.file]
                self.known[shard_index(s)] = {i: fingerprints[i] for i in ids
                                              if i in fingerprints}

    def short_ids(self) -> set[int]:
        """The row ids of the listed shards that are not full."""
        return {i for s in self.shards if s.rows < self.rows_per_shard
                for i in self.ids_of[s.file]}

    # ---- writing -------------------------------------------------------------------------------
    def ids_in(self, k: int) -> list[int]:
        """The row ids shard `k` holds now (none: not written yet)."""
        return self.ids_of.get(self._name(k), [])

    def put(self, k: int, rows: list[dict[str, Any]], schema: pa.Schema | None,
            fingerprints: Mapping[int, str] | None = None, errors: tuple[int, ...] = (),
            merge: bool = False) -> ShardInfo:
        """Write shard `k` (atomically) with `rows`, with `merge` also the rows it holds
        already, ordered by row id; then list it with its rows' input fingerprint (from
        `fingerprints`: row id -> row_fingerprint) and the ids of its error rows."""
        old = self._listed(k)
        if merge and old is not None:
            new = {r[ROW_ID] for r in rows}
            rows = [r for r in self.writer.rows(self.dir / old.file) if r[ROW_ID] not in new] + rows
            errors = tuple(i for i in old.errors if i not in new) + tuple(errors)
            if fingerprints is not None:
                fingerprints = {**self.known.get(k, {}), **fingerprints}
                if len(fingerprints) < len(rows):  # an old row's fingerprint is unknown
                    fingerprints = None
        return self._put(k, rows, schema, fingerprints, tuple(sorted(errors)))

    def _put(self, k: int, rows: list[dict[str, Any]], schema: pa.Schema | None,
             fingerprints: Mapping[int, str] | None, errors: tuple[int, ...]) -> ShardInfo:
        """Write and list shard `k`: `rows` ordered by id (replacing what it held)."""
        rows = sorted(rows, key=lambda r: r[ROW_ID])
        table = pa.Table.from_pylist(rows, schema=item_lists(schema or self.schema))
        if self.schema is None:
            self.schema = table.schema
        inputs = None if fingerprints is None else rows_fingerprint(fingerprints)
        name = self._name(k)
        self.writer.write(table, self.dir / name)
        info = ShardInfo(name, table.num_rows, (self.dir / name).stat().st_size,
                         _sha256(self.dir / name), inputs, errors)
        self.shards = sorted([s for s in self.shards if s.file != name] + [info],
                             key=shard_index)
        self.ids_of[name] = [r[ROW_ID] for r in rows]
        if fingerprints is not None and table.num_rows < self.rows_per_shard:
            self.known[k] = dict(fingerprints)
        else:
            self.known.pop(k, None)
        self._write_manifest(complete=False)
        return info

    def keep_only(self, indices: set[int]) -> None:
        """Unlist and delete the shards whose index is not in `indices` (their rows left)."""
        gone = [s for s in self.shards if shard_index(s) not in indices]
        if not gone:
            return
        self.shards = [s for s in self.shards if s not in gone]
        self._write_manifest(complete=False)
        for s in gone:
            del self.ids_of[s.file]
            (self.dir / s.file).unlink()

    def finish(self) -> None:
        """Mark the job complete in the manifest."""
        self._write_manifest(complete=True)

    def files(self) -> list[Path]:
        return [self.dir / s.file for s in self.shards]

    def _name(self, k: int) -> str:
        return f"part-{k:05d}{self.writer.suffix}"

    def _listed(self, k: int) -> ShardInfo | None:
        name = self._name(k)
        return next((s for s in self.shards if s.file == name), None)

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
                   "rows_per_shard": self.rows_per_shard,
                   "shards": [asdict(s) for s in self.shards]}
        writers.atomic_write(self.dir / MANIFEST,
                             lambda tmp: tmp.write_text(json.dumps(payload, indent=1) + "\n"))


def item_lists(schema: pa.Schema | None) -> pa.Schema | None:
    """`schema` with every list's value field named "item" (Arrow's default; a schema read back
    from Parquet names it "element"), so a shard written from either has the same bytes."""
    if schema is None:
        return None
    return pa.schema([f.with_type(_item_type(f.type)) for f in schema], schema.metadata)


def _item_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        value = t.value_field
        field = pa.field("item", _item_type(value.type), value.nullable, value.metadata)
        return pa.list_(field) if pa.types.is_list(t) else pa.large_list(field)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_item_type(f.type)) for f in t])
    return t


def shard_index(info: ShardInfo) -> int:
    """A shard's index k (it holds row ids [k*R, (k+1)*R)), from its file name."""
    return int(_SHARD.match(info.file).group(1))  # type: ignore[union-attr]


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


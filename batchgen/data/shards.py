"""Crash-safe output of a dataset job: shards (Parquet or JSONL, see writers.py) written
atomically plus a manifest.

A shard is written to `.part-NNNNN.SUFFIX.tmp`, fsynced, renamed into place, and only then
listed (with its size and SHA-256) in `_manifest.json`, itself replaced atomically. So after a
crash at any point a shard is either listed and whole, or not listed: on resume, listed shards
are checked against their size and hash, and whatever is not a whole listed shard (a `.tmp`,
an unlisted shard, a truncated one) is deleted and its rows are computed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.data import writers
from batchgen.data.rows import ROW_ID
from batchgen.data.writers import WRITERS, ShardWriter

logger = logging.getLogger("batchgen")

MANIFEST = "_manifest.json"  # "_" and "." names: pyarrow, pandas, polars skip them
FORMAT = "batchgen-shards/1"
_SUFFIXES = "|".join(re.escape(w.suffix) for w in WRITERS.values())
_SHARD = re.compile(rf"^part-(\d{{5,}})(?:{_SUFFIXES})$")
_TMP = re.compile(rf"^\.part-(\d{{5,}})(?:{_SUFFIXES})\.tmp$")


@dataclass(frozen=True)
class ShardInfo:
    """One whole shard as the manifest lists it."""

    file: str
    rows: int
    bytes: int
    sha256: str


class ShardStore:
    """Owns `output_dir`: writes shards and the manifest, and knows which rows are done."""

    def __init__(self, output_dir: Path, job: dict[str, Any], resume: bool,
                 writer: ShardWriter = WRITERS["parquet"]) -> None:
        self.dir = output_dir
        self.job = job
        self.writer = writer
        self.shards: list[ShardInfo] = []
        self.done_ids: set[int] = set()  # rows of the shards found on resume (not updated)
        self.schema: pa.Schema | None = None  # of the shards already written, when resuming
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
            self.done_ids.update(table.column(ROW_ID).to_pylist())
        if self.shards:
            self.schema = self.writer.schema(self.dir / self.shards[0].file)
        self._write_manifest(complete=False)

    def _check_same_job(self, stored: dict[str, Any]) -> None:
        """Resume only the job that wrote the folder (model, params, seed, input, columns)."""
        differ = sorted(k for k in set(stored) | set(self.job) if stored.get(k) != self.job.get(k))
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

    # ---- writing -------------------------------------------------------------------------------
    def write(self, rows: list[dict[str, Any]], schema: pa.Schema | None) -> ShardInfo:
        """Write `rows` as the next shard (atomically), then list it in the manifest."""
        table = pa.Table.from_pylist(rows, schema=schema or self.schema)
        if self.schema is None:
            self.schema = table.schema
        name = f"part-{self._next_index():05d}{self.writer.suffix}"
        self.writer.write(table, self.dir / name)
        info = ShardInfo(name, table.num_rows, (self.dir / name).stat().st_size,
                         _sha256(self.dir / name))
        self.shards.append(info)
        self._write_manifest(complete=False)
        return info

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
        payload = {"format": FORMAT, "job": self.job, "complete": complete,
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


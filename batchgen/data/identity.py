"""What identifies the work a resume may keep, in one place: the model an LLM serves (for a
dataset job's manifest and for run-batch's answers), a dataset row's input (a shard keeps only
rows whose input is unchanged) and a run-batch request.

Fingerprints are hex digests of canonical JSON (sorted keys, no spaces; a value JSON has no
form for is written as its `str`), so equal inputs give equal fingerprints in any process."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.llm import LLM

# Weight files are identified by name, size and modification time (reading gigabytes to hash
# them would cost more than many jobs); every other file of the folder by its content.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_CONTENT_LIMIT = 64 << 20  # larger files are identified like weights


def canonical_json(value: Any) -> str:
    """`value` as JSON with sorted keys and no spaces (what a fingerprint hashes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)


def digest(value: Any, size: int = 16) -> str:
    """A hex fingerprint (`size` bytes of BLAKE2b) of `value`'s canonical JSON."""
    return hashlib.blake2b(canonical_json(value).encode(), digest_size=size).hexdigest()


def model_identity(llm: LLM) -> dict[str, str]:
    """What identifies the model an LLM serves: its resolved folder and a fingerprint of the
    folder's files (config, generation config, tokenizer by content; weights by name, size and
    modification time), so another model, or the same folder rewritten, is another job."""
    return {"model": str(llm.model_path), "model_files": folder_fingerprint(llm.model_path)}


def folder_fingerprint(path: Path) -> str:
    """A fingerprint of the files directly in `path` (symlinks followed, as in the HF cache)."""
    entries = []
    for f in sorted(p for p in Path(path).iterdir() if p.is_file()):
        st = f.stat()
        if f.suffix in _WEIGHT_SUFFIXES or st.st_size > _CONTENT_LIMIT:
            entries.append([f.name, st.st_size, st.st_mtime_ns])
        else:
            entries.append([f.name, hashlib.sha256(f.read_bytes()).hexdigest()])
    return digest(entries)


def row_fingerprint(row: Mapping[str, Any], image_column: str | None = None) -> str:
    """A dataset row's input (every column, by name): equal rows, equal fingerprints. An
    image column's local path (a str, or a file:// URL) counts with its file's bytes, so a
    changed image under the same path is another input (bytes in the row count as they are)."""
    row = dict(row)
    path = row.get(image_column) if image_column is not None else None
    if isinstance(path, str) and not path.startswith("data:"):
        local = Path(path.removeprefix("file://"))
        try:
            row[image_column] = [path, hashlib.sha256(local.read_bytes()).hexdigest()]
        except OSError:
            pass  # unreadable: the row's own check reports it, by its path alone here
    return digest(row, size=8)


def rows_fingerprint(fingerprints: Mapping[int, str]) -> str:
    """A shard's fingerprint: its rows' ids and input fingerprints, in row-id order."""
    return digest(sorted(fingerprints.items()))

"""An adapter column for dataset jobs (`generate_dataset`, the Ray processor, `batchgen
generate --lora NAME=PATH --lora-column COL`): each row names its adapter in `lora_column`
(None or "" for the base model) among `loras` (name -> PEFT folder). Every adapter is read and
checked against the LLM before any row runs; a row's input fingerprint includes its adapter's
bytes (SHA-256 of adapter_config.json and adapter_model.safetensors), so a resume redoes the
rows of an adapter that changed and keeps the others."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.checks import check
from batchgen.lora.request import LoRARequest

# the adapters of a dataset job take lora_int_id ID_BASE + their position in sorted names
# (clear of the small ids a script gives its own LoRARequests on the same LLM)
ID_BASE = 1 << 20
FILES = ("adapter_config.json", "adapter_model.safetensors")


def _mix(*parts: str, size: int = 8) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=size).hexdigest()


def adapter_fingerprint(path: str) -> str:
    """SHA-256 of an adapter folder's config and weights (their names and bytes)."""
    h = hashlib.sha256()
    for name in FILES:
        h.update(name.encode() + b"\0")
        try:
            h.update((Path(path) / name).read_bytes())
        except OSError:
            h.update(b"missing")  # load_adapter's check names the missing file
    return h.hexdigest()


def parse_lora_flags(values: list[str] | None) -> dict[str, str]:
    """`--lora NAME=PATH` (repeated) as {name: path}; a ValueError naming the flag for a value
    without NAME= or PATH, or a name given twice."""
    loras: dict[str, str] = {}
    for value in values or ():
        name, sep, path = value.partition("=")
        check(bool(sep and name.strip() and path.strip()), "--lora",
              "NAME=PATH (an adapter name and its PEFT folder)", value)
        check(name.strip() not in loras, "--lora", "one NAME=PATH per adapter name", value)
        loras[name.strip()] = path.strip()
    return loras


def engine_kwargs(loras: Mapping[str, str]) -> dict[str, Any]:
    """LLM's LoRA arguments for a job's adapters (the CLI's): every adapter in a device slot,
    and a max_lora_rank of at least each one's rank (16 when a config cannot be read: the
    adapter's own check then names the problem)."""
    if not loras:
        return {}
    ranks = [16]
    for path in loras.values():
        try:
            ranks.append(int(json.loads((Path(path) / FILES[0]).read_text()).get("r", 8)))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    return {"enable_lora": True, "max_loras": len(loras), "max_lora_rank": max(ranks)}


@dataclass(frozen=True)
class LoRAColumn:
    """Which column names each row's adapter, and the adapters (name, path), sorted by name.
    Picklable: the Ray processor's config carries it to its actors."""

    column: str | None = None
    loras: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, column: Any, loras: Any) -> LoRAColumn:
        """Checked arguments: both or neither (ValueErrors naming them)."""
        if column is None:
            check(not loras, "loras", "None or empty without lora_column (the column naming "
                  "each row's adapter)", loras)
            return cls()
        check(isinstance(column, str) and bool(column), "lora_column",
              "None or a column name (a non-empty string)", column)
        check(isinstance(loras, Mapping) and bool(loras) and all(
            isinstance(k, str) and k and isinstance(v, (str, os.PathLike)) and str(v)
            for k, v in loras.items()), "loras",
              "a non-empty dict of adapter name -> PEFT adapter folder", loras)
        return cls(column, tuple(sorted((k, str(v)) for k, v in loras.items())))

    def requests(self) -> dict[str, LoRARequest]:
        return {name: LoRARequest(name, ID_BASE + i, path)
                for i, (name, path) in enumerate(self.loras)}

    def identity(self) -> dict[str, Any]:
        """What a job's manifest records (nothing without a column: older manifests stay
        resumable); the adapters' bytes are in each row's fingerprint instead."""
        if self.column is None:
            return {}
        return {"lora_column": self.column, "loras": [name for name, _ in self.loras]}


    def unknown(self, where: str, name: Any) -> ValueError:
        return ValueError(f"{where}: lora_column {self.column!r} holds {name!r}, not an "
                          f"adapter of loras ({[n for n, _ in self.loras]}; None or '' for the "
                          "base model)")

    def check_rows(self, source: Any) -> None:
        """A materialized input (a Dataset, files): every row's adapter name is one of loras,
        checked before any row runs (a ValueError naming the first row that is not); an
        iterable's rows are checked as they come."""
        names = source.column_names
        if self.column is None or names is None:
            return
        if self.column not in names:
            raise ValueError(f"lora_column {self.column!r} is not a column of data "
                             f"(columns: {names})")
        if not hasattr(source.dataset, "unique"):
            return
        known = {n for n, _ in self.loras}
        bad = [v for v in source.dataset.unique(self.column)
               if v not in known and v is not None and v != ""]
        if bad:
            raise self.unknown(source.where(list(source.dataset[self.column]).index(bad[0])),
                               bad[0])


class RowAdapters:
    """A job's adapters on its LLM: every one read and checked now (before any row); then
    each row's `LoRARequest`, and its input fingerprint with its adapter's bytes."""

    def __init__(self, spec: LoRAColumn, llm: Any) -> None:
        self.spec, self.column = spec, spec.column
        self.by_name = spec.requests()
        self.hashes = {n: adapter_fingerprint(r.lora_path) for n, r in self.by_name.items()}
        self.seam, self.base = getattr(llm, "_lora", None), getattr(llm, "tokenizer", None)
        if self.column is not None:
            if not llm._lora.enabled:
                raise ValueError(f"lora_column {self.column!r} needs LLM(..., enable_lora=True)")
            # each read and checked (a bad one: a ValueError naming it and its path); one that
            # changed on disk since this LLM loaded it is read again, its cached K/V dropped
            stale = [llm._lora.refresh(r, self.hashes[n]) for n, r in self.by_name.items()]
            if any(stale):
                llm.reset_prefix_cache()

    def request(self, row_id: int, row: Mapping[str, Any]) -> LoRARequest | None:
        """The row's adapter (None: the base model); a ValueError naming the row otherwise."""
        if self.column is None:
            return None
        name = row.get(self.column)
        if name is None or name == "":
            return None
        if not isinstance(name, str) or name not in self.by_name:
            raise self.spec.unknown(f"row {row_id}", name)
        return self.by_name[name]

    def chat_tokenizers(self, req: LoRARequest | None) -> Any:
        """A messages row's template renderer under `req` (`render_chat`'s tokenizer_of):
        None for the LLM's tokenizer."""
        return None if req is None else self.seam.chat_tokenizers(req, self.base)

    def encode(self, prompt: Any, req: LoRARequest | None) -> Any:
        """A row's text prompt tokenized by its adapter's own tokenizer, if it ships one."""
        return prompt if req is None else self.seam.tokenizers.encode(prompt, req)

    def fingerprint(self, row: Mapping[str, Any], fp: str) -> str:
        """A row's input fingerprint `fp`, with its adapter's bytes for a row under one."""
        name = row.get(self.column) if self.column is not None else None
        return _mix(fp, self.hashes[name]) if name in self.hashes else fp

    def source(self, source: Any) -> Any:
        """`source` whose input fingerprint includes every adapter's bytes (a resume then
        reads the rows and redoes those of a changed adapter); unchanged without a column."""
        if self.column is None or not source.content_fingerprint:
            return source
        return dataclasses.replace(source, fingerprint=_mix(
            source.fingerprint, *(f"{n}={h}" for n, h in sorted(self.hashes.items())), size=16))

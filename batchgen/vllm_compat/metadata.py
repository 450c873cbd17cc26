"""The installed-package metadata of the stand-in `vllm` while `install()` is in effect, so
`importlib.metadata.version("vllm")` (what TRL's and lm-eval's version checks read) answers
`VERSION` instead of raising PackageNotFoundError. Nothing is written to disk: a finder on
`sys.meta_path` that finds no modules, only this one distribution."""

from __future__ import annotations

import importlib.abc
import importlib.metadata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchgen.vllm_compat.modules import VERSION


class StandInDistribution(importlib.metadata.Distribution):
    """`vllm` at VERSION, summarised as batchgen's stand-in; no files, no entry points."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n"
                    "Summary: batchgen's stand-in for vLLM's offline API "
                    "(batchgen.vllm_compat.install())\n")
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).parent / str(path)


class StandInFinder(importlib.abc.MetaPathFinder):
    """Finds the stand-in's distribution by name ("vllm") or in a listing of all."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None  # the modules themselves are in sys.modules

    def find_distributions(self, context: Any = None) -> Iterator[StandInDistribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == "vllm":
            yield StandInDistribution()


FINDER = StandInFinder()

"""Where batchgen keeps what it makes once per machine (the compiled CPU kernel, demo models)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$BATCHGEN_CACHE_DIR/batchgen`, else `$XDG_CACHE_HOME/batchgen`, else `~/.cache/batchgen`."""
    root = os.environ.get("BATCHGEN_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME") or (
        Path.home() / ".cache")
    return Path(root) / "batchgen"


def models_dir() -> Path:
    """Where made model folders are kept (the demo's SmolLM2 and tiny models): next to the
    compiled CPU kernel, under `cache_root()`."""
    return cache_root() / "models"

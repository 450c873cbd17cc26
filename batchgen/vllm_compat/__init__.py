"""`import vllm` for code you do not own (TRL's colocated generator): an explicit switch that
registers batchgen's API under vLLM's module names.

    import batchgen.vllm_compat
    batchgen.vllm_compat.install()          # before `import trl`
    batchgen.vllm_compat.share(model)       # optional: generate from the trainer's own module

After `install()`, `importlib.util.find_spec("vllm")` finds it, `vllm.__version__` is one TRL
accepts (`VERSION`), and so is `importlib.metadata.version("vllm")` (metadata.py), and
`from vllm import LLM, SamplingParams, RequestOutput`, `vllm.sampling_params
.StructuredOutputsParams`, `from vllm.entrypoints.llm import LLM`,
`vllm.exceptions.VLLMValidationError` (batchgen's ValidationError, a ValueError),
`vllm.v1.metrics.reader`'s records, `llm.llm_engine.model_executor.driver_worker
.model_runner.model.load_weights(...)` and `llm.llm_engine.model_config.max_model_len` are
batchgen's (compat_llm.py). The server-mode names TRL imports at module load
(`vllm.utils.network_utils`, `vllm.distributed.weight_transfer...`) import cleanly; calling the
weight-transfer ones raises (server mode needs a real vLLM server). It refuses to install over
a real vLLM, and nothing happens without the call.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from batchgen.vllm_compat.compat_llm import SHARED, CompatLLM
from batchgen.vllm_compat.metadata import FINDER
from batchgen.vllm_compat.modules import VERSION, build_modules

__all__ = ["VERSION", "CompatLLM", "install", "installed", "share", "uninstall", "unshare"]

_MARK = "__batchgen_compat__"


def installed() -> bool:
    """Whether `vllm` in this process is batchgen's stand-in."""
    return getattr(sys.modules.get("vllm"), _MARK, False)


def install() -> None:
    """Register the stand-in `vllm` modules (idempotent). RuntimeError when a real vLLM is
    importable or already imported: batchgen never shadows it."""
    if installed():
        return
    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        origin = getattr(importlib.util.find_spec("vllm"), "origin", None)
        raise RuntimeError(f"a real vLLM is installed ({origin}): batchgen.vllm_compat.install() "
                           "does not shadow it; uninstall vllm to use batchgen in its place")
    modules = build_modules(CompatLLM)
    setattr(modules["vllm"], _MARK, True)
    sys.modules.update(modules)
    sys.meta_path.append(FINDER)  # importlib.metadata.version("vllm") == VERSION


def uninstall() -> None:
    """Remove the stand-in modules (and every shared model) from this process."""
    if installed():
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
    if FINDER in sys.meta_path:
        sys.meta_path.remove(FINDER)
    SHARED.clear()


def share(model: torch.nn.Module) -> None:
    """Make `vllm.LLM(model=<this model's name_or_path>)` generate from `model` itself (no
    weight copy; `load_weights` of its own tensors is then a no-op) instead of loading the
    folder again."""
    name = getattr(model, "name_or_path", None)
    if not isinstance(model, torch.nn.Module) or not name:
        raise ValueError("model must be a loaded transformers model with a name_or_path, got "
                         f"{type(model).__name__}")
    SHARED[str(name)] = model


def unshare(model: torch.nn.Module) -> None:
    """Undo `share(model)`: its folder loads as a folder again."""
    name = str(getattr(model, "name_or_path", ""))
    if SHARED.get(name) is model:
        del SHARED[name]

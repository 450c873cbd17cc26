"""A model the caller already holds (`LLM(model=<PreTrainedModel>)`): batchgen generates from that
very module, with no copy of its weights. Its own attention implementation (eager, SDPA, ...)
stays selected; batchgen's paged attention is switched on only for the duration of batchgen's
own forwards (`paged_forward`), in eval mode, so a trainer's forward and backward through the
same module run exactly as they would without batchgen."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchgen.attention.interface import register

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_module(module: object) -> PretrainedConfig:
    """The module's config, or a ValueError saying what a shared model must be: a
    transformers causal LM on one device in one floating dtype, not split by tensor
    parallelism."""
    config = getattr(module, "config", None)
    if not isinstance(module, torch.nn.Module) or config is None or not hasattr(
            module, "get_output_embeddings") or module.get_output_embeddings() is None:
        raise ValueError("model must be a model folder, a hub id, or a loaded transformers "
                         f"causal LM (a PreTrainedModel with an lm_head), got "
                         f"{type(module).__name__}")
    devices = {p.device for p in module.parameters()}
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(devices) != 1 or len(dtypes) != 1:
        raise ValueError("model must have every parameter on one device in one dtype (a "
                         f"shared module is used as it is), got devices {sorted(map(str, devices))}"
                         f" and dtypes {sorted(map(str, dtypes))}")
    if any(type(p).__name__ == "DTensor" for p in module.parameters()):
        raise ValueError("model must not be split by tensor parallelism (DTensor parameters): "
                         "pass its folder with tensor_parallel_size instead")
    return config


def module_device(module: torch.nn.Module) -> torch.device:
    """The one device the module's parameters are on."""
    return next(module.parameters()).device


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The one floating dtype of the module's parameters."""
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


def module_folder(module: torch.nn.Module) -> Path | None:
    """The folder the module was loaded from (its tokenizer and generation config), if any."""
    name = getattr(module, "name_or_path", None) or getattr(module.config, "_name_or_path", "")
    path = Path(str(name)).expanduser() if name else None
    return path if path is not None and path.is_dir() else None


def weights_version(model: torch.nn.Module) -> int:
    """A number that changes whenever any parameter is written in place (an optimizer step,
    load_weights) or replaced: torch's per-tensor version counters and data pointers. The
    prefix cache is reset when it changes, so cached K/V always comes from the current
    weights. Inference tensors (compressed-tensors decompresses its weights into them on the
    first forward, under inference mode) keep no version counter and cannot be written in
    place outside inference mode: their data pointer stands for them."""
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return hash(tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for t in local))


@contextmanager
def paged_forward(model: torch.nn.Module) -> Iterator[None]:
    """For one batchgen forward: batchgen's attention selected and the module in eval mode
    (no dropout); the module's own implementation and training flags are put back after,
    whatever happens."""
    config = model.config
    before = config._attn_implementation
    training = [m for m in model.modules() if m.training]
    config._attn_implementation = register()
    for m in training:
        m.training = False
    try:
        yield
    finally:
        config._attn_implementation = before
        for m in training:
            m.training = True

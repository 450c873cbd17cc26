"""`load_weights`: new values for the model's parameters, by the names the HF model has them
(what an RL trainer sends after each optimizer step, vLLM's `model.load_weights` form).

Under tensor parallelism each rank is sent the full tensor and keeps its own shard.
Names from wrapped trainers are unwrapped first: FSDP, activation checkpointing and
torch.compile wrappers (`_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`, `_orig_mod.`,
DDP's leading `module.`) and PEFT (`base_model.model.` in front, `.base_layer` inside,
`modules_to_save.default.`). Each tensor is cast to the parameter's dtype and device and copied
in place, so every view of the weights (tied embeddings, a shared module) sees it. A tensor that
already is the parameter's storage (a shared module's own) is skipped. A bitsandbytes 4-bit
weight is quantized anew from the values sent (batchgen/quantization/bnb_sync.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from batchgen.quantization.bnb_sync import is_4bit, load_4bit

_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.",
             "modules_to_save.default.")
_PREFIXES = ("base_model.model.", "module.")


def hf_name(name: str) -> str:
    """A parameter's name as the unwrapped HF model has it."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    name = name.replace(".base_layer.", ".")
    for p in _PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
    return name


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by name, tied ones under each of their names."""
    out = dict(model.named_parameters(remove_duplicate=False))
    non_persistent = {f"{n}.{b}" if n else b for n, m in model.named_modules()
                      for b in getattr(m, "_non_persistent_buffers_set", ())}
    for name, buf in model.named_buffers(remove_duplicate=False):
        if name not in non_persistent:
            out.setdefault(name, buf)
    return out


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each (name, tensor) into the model's parameter of that name (unwrapped; cast to its
    dtype and device). ValueError naming a name the model lacks or a shape that differs.
    Returns the names loaded (vLLM's `load_weights` return)."""
    targets = named_tensors(model)
    loaded: set[str] = set()
    for name, tensor in weights:
        key = hf_name(name)
        target = targets.get(key)
        if target is None:
            raise ValueError(f"weights must name the model's parameters; {name!r} (as {key!r}) "
                             f"is not one of its {len(targets)} (e.g. {next(iter(targets))!r})")
        if is_4bit(target):  # bitsandbytes 4-bit: requantized (TRL's QLoRA sync)
            load_4bit(model.get_submodule(key.rpartition(".")[0]), name, tensor)
        elif tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"weights: {name!r} must have shape {tuple(target.shape)}, got "
                             f"{tuple(tensor.shape)} (tensor-parallel shards are not loaded "
                             "here: send the full tensor)")
        elif hasattr(target, "to_local"):  # a tensor-parallel shard: this rank's part
            _copy_shard(target, tensor)
        elif not _same_memory(tensor, target):
            with torch.no_grad():
                target.copy_(tensor.detach())
        loaded.add(key)
    return loaded


def _copy_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of `full` into a DTensor parameter, cut locally by the
    parameter's own placements (no communication: every rank was sent the full tensor)."""
    from torch.distributed.tensor import distribute_tensor

    local = target.to_local()  # type: ignore[attr-defined]
    src = full.detach().to(device=local.device, dtype=local.dtype)
    shard = distribute_tensor(src, target.device_mesh, target.placements,  # type: ignore[attr-defined]
                              src_data_rank=None).to_local()
    with torch.no_grad():
        local.copy_(shard)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` is `b`'s own memory (a shared module's parameter sent back to it)."""
    return (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and a.stride() == b.stride())

"""New values for a bitsandbytes 4-bit layer of the generator, from what an RL trainer sends.

TRL's QLoRA sync (GRPO colocate over a 4-bit policy with a LoRA adapter) merges the adapter,
then sends each layer's `param.data`: the packed 4-bit bytes without the quant state (absmax)
that gives them values, so no generator can read them alone (vLLM's cannot: TRL #3466). In one
process (colocate) the bytes are still the storage of the trainer's own `Params4bit`, which
holds that state: it is found by its storage address (one scan of the live objects per sync, a
miss rescans) and its bytes and state are copied into the generator's layer in place (exact:
the generator computes with the trainer's merged weights). A layer quantized in another format,
or a full-precision tensor of the layer's logical shape (a trainer without 4-bit layers), is
quantized anew in the generator's format.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import torch

_OWNERS: dict[int, weakref.ref] = {}  # storage address -> the Params4bit holding it


def is_4bit(target: torch.Tensor) -> bool:
    """Whether a model's parameter is a bitsandbytes 4-bit weight (packed, with a state)."""
    return type(target).__name__ == "Params4bit" and getattr(target, "quant_state", None) \
        is not None


def load_4bit(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Set `module`'s 4-bit weight to the values `tensor` stands for: the trainer's own bytes
    and state where its format is the generator's (exact), else quantized anew in the
    generator's format. ValueError naming `name` when the values cannot be known."""
    weight = module.weight
    shape = tuple(weight.quant_state.shape)
    if tensor.is_floating_point():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"weights: {name!r} must have shape {shape}, got "
                             f"{tuple(tensor.shape)}")
        data, state = _quantize_like(weight, tensor.detach().to(weight.device))
    else:
        owner = _owner(tensor)
        if owner is None:
            raise ValueError(
                f"weights: {name!r} arrived as {tuple(tensor.shape)} packed 4-bit bytes "
                "without the quant state that gives them values (no live bitsandbytes "
                "Params4bit in this process holds them): send the dequantized weight instead")
        data, state = _unpacked(owner)
        if tuple(state.shape) != shape:
            raise ValueError(f"weights: {name!r} holds a {tuple(state.shape)} weight, the "
                             f"generator's is {shape}")
        data = data.to(weight.device)
        state.to(weight.device)  # QuantState.to moves its tensors in place
        if not _same_format(owner, weight):
            import bitsandbytes as bnb

            data, state = _quantize_like(weight, bnb.functional.dequantize_4bit(data, state))
    _write(module, data, state)


def _same_format(a: Any, b: Any) -> bool:
    """Whether two Params4bit quantize alike (blocksize, type, nested absmax, storage)."""
    return all(getattr(a, k) == getattr(b, k) for k in
               ("blocksize", "quant_type", "compress_statistics", "quant_storage"))


def _unpacked(owner: Any) -> tuple[torch.Tensor, Any]:
    """A copy of a Params4bit's bytes and state in bitsandbytes' portable layout (its CPU
    kernel's packing undone on the copy: the trainer's own layer is left as it is)."""
    data, state = owner.data.clone(), copy.deepcopy(owner.quant_state)
    if getattr(state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        nested = state.original_nested
        data, state = _convert_weight_packed_for_cpu_inverse(data, state)
        if not nested:  # bitsandbytes 0.50's inverse leaves this absmax as packed: [K/bs, N]
            state.absmax = state.absmax.T.contiguous().reshape(-1).float()
    return data, state


def _owner(tensor: torch.Tensor) -> Any:
    """The live Params4bit whose storage `tensor` is (cached by address; a miss rescans)."""
    ptr = tensor.data_ptr()
    for attempt in range(2):
        ref = _OWNERS.get(ptr)
        owner = ref() if ref is not None else None
        if owner is not None and owner.data_ptr() == ptr and owner.numel() == tensor.numel():
            return owner
        if attempt == 0:
            _index()
    return None


def _index() -> None:
    """Every live Params4bit by its storage address."""
    _OWNERS.clear()
    for obj in gc.get_objects():
        if type(obj).__name__ == "Params4bit" and getattr(obj, "quant_state", None) is not None:
            _OWNERS[obj.data_ptr()] = weakref.ref(obj)


def _quantize_like(weight: Any, values: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """`values` quantized in `weight`'s format (portable layout)."""
    import bitsandbytes as bnb

    return bnb.functional.quantize_4bit(
        values.contiguous(), blocksize=weight.blocksize,
        compress_statistics=weight.compress_statistics, quant_type=weight.quant_type,
        quant_storage=weight.quant_storage)


def _write(module: torch.nn.Module, data: torch.Tensor, fresh: Any) -> None:
    """Bytes and state into the module's weight, in its kernel's layout, in place (same storage
    where the shapes allow: captured CUDA graphs keep reading it)."""
    weight = module.weight
    state = weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):  # the generator's kernel layout
        from bitsandbytes.functional import _convert_weight_packed_for_cpu

        data, fresh = _convert_weight_packed_for_cpu(data, fresh)
    with torch.inference_mode():  # the CPU kernel's repacked state is made under it
        if weight.data.shape == data.shape and weight.data.dtype == data.dtype:
            weight.data.copy_(data)
        else:
            weight.data = data
        weight.quant_state = _copy_state(state, fresh)
    module.quant_state = weight.quant_state


def _copy_state(old: Any, new: Any) -> Any:
    """`new`'s values in `old`'s tensors where shapes agree (else `new`'s own): the state the
    layer's kernels read stays where it was."""
    for key, value in vars(new).items():
        mine = getattr(old, key, None)
        if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) \
                and mine.shape == value.shape and mine.dtype == value.dtype:
            mine.copy_(value)
        elif key == "state2" and value is not None and mine is not None:
            _copy_state(mine, value)
        else:
            setattr(old, key, value)
    return old

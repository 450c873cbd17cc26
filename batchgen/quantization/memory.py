"""What quantized weights really cost: bytes of a loaded model (packed and scale tensors as
stored, tensor subclasses through their inner tensors) and of a checkpoint on disk (its
safetensors headers or .gguf file, without reading a tensor)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a wrapper subclass (torchao's) through its inner tensors, a
    bitsandbytes parameter with its scales (SCB, the 4-bit quant_state's absmax)."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        try:
            names, _ = t.__tensor_flatten__()
        except (TypeError, NotImplementedError):
            names = []
        inner = [getattr(t, n, None) for n in names]
        if inner and all(isinstance(x, torch.Tensor) for x in inner):
            return sum(tensor_bytes(x) for x in inner)
    total = t.numel() * t.element_size()
    for extra in (getattr(t, "SCB", None), getattr(getattr(t, "quant_state", None), "absmax",
                                                   None)):
        if isinstance(extra, torch.Tensor):
            total += extra.numel() * extra.element_size()
    return total


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as loaded (tied tensors once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += tensor_bytes(t)
    return total


def gguf_parameters(path: Path) -> int:
    """How many weights a .gguf file holds (its tensor headers' shapes; no data read): what
    transformers dequantizes it into at load."""
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the weights a folder (its *.safetensors: each header's tensor extents) or a
    .gguf file holds: what quantized weights cost once loaded as stored."""
    path = Path(path)
    if path.suffix == ".gguf":
        return path.stat().st_size
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0]
                     for k, v in header.items() if k != "__metadata__")
    return total

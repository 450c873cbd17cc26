"""The quantization methods batchgen serves, under vLLM's names: which transformers quantizer
loads each, what it needs installed, whether it can quantize a full-precision folder at load
(online), and what a device must offer for its kernels. Only data and small predicates: no
transformers or torch import at module level (the checks run before any weight is read)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability, None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def _needs_capability(major: int, minor: int, what: str) -> Callable[[torch.device], str | None]:
    """A device check: None on a CUDA GPU of at least sm`major``minor`, else why not."""

    def check(device: torch.device) -> str | None:
        cap = _cuda_capability(device)
        if cap is not None and cap >= (major, minor):
            return None
        have = f"sm{cap[0]}{cap[1]}" if cap else device.type
        return f"{what} need a CUDA GPU of compute capability >= {major}.{minor}, this is {have}"

    return check


def _runs_anywhere(device: torch.device) -> str | None:
    return None


@dataclass(frozen=True)
class Method:
    """One served method."""

    name: str  # vLLM's name (what `quantization=` takes)
    hf_methods: tuple[str, ...]  # transformers' `quant_method` values of its checkpoints
    package: str | None  # the import it needs beyond batchgen's core (None: none)
    extra: str | None  # batchgen's extra that installs it
    checkpoint_check: Callable[[torch.device], str | None] = _runs_anywhere
    online_check: Callable[[torch.device], str | None] | None = None  # None: no online mode
    how: str = ""  # one line: how transformers loads it here


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("fp8", ("fp8",), None, None,
           online_check=_needs_capability(8, 9, "FP8 matmuls (online fp8 quantization)"),
           how="FineGrainedFP8 (block or per-tensor, `weight_scale_inv`); dequantized to the "
               "model dtype without an sm89+ GPU"),
    Method("compressed-tensors", ("compressed-tensors",), "compressed_tensors",
           "compressed-tensors",
           how="compressed-tensors' modules (INT8/FP8/INT4 W8A16, W8A8, W4A16), decompressed "
               "on the first forward; FP8 scaled_mm only with use_optimized_inference on sm89+"),
    Method("awq", ("awq",), "gptqmodel", "gptq", how="gptqmodel's AWQ kernels"),
    Method("gptq", ("gptq",), "gptqmodel", "gptq", how="gptqmodel's GPTQ kernels"),
    Method("bitsandbytes", ("bitsandbytes", "bitsandbytes_4bit", "bitsandbytes_8bit"),
           "bitsandbytes", "bitsandbytes", online_check=_runs_anywhere,
           how="bitsandbytes Linear8bitLt / Linear4bit (its CPU backend on a CPU); online: "
               "4-bit NF4"),
    Method("torchao", ("torchao",), "torchao", "torchao", online_check=_runs_anywhere,
           how="torchao tensor subclasses; online: int8 weight-only"),
    Method("gguf", ("gguf",), "gguf", "gguf",
           how="transformers' GGUF reader, dequantized to the model dtype at load"),
    Method("mxfp4", ("mxfp4",), None, None,
           how="gpt-oss MXFP4 experts: triton kernels on a GPU, dequantized elsewhere"),
    Method("modelopt_fp4", ("nvfp4",), "kernels", None,
           checkpoint_check=lambda d: "transformers 5.25 loads no pre-quantized NVFP4 "
                                      "checkpoint (its quantizer refuses them)",
           online_check=_needs_capability(10, 0, "NVFP4 kernels"),
           how="transformers' NVFP4 quantizer: online only, CUDA sm100+"),
)}

# vLLM's other spellings of a served method
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "nvfp4": "modelopt_fp4",
           "bitsandbytes_4bit": "bitsandbytes", "bitsandbytes_8bit": "bitsandbytes"}

NAMES: tuple[str, ...] = (*METHODS, *ALIASES)


def canonical(name: str) -> str:
    """A served name's method name (aliases resolved)."""
    return ALIASES.get(name, name)


def method_for_checkpoint(hf_method: str) -> Method | None:
    """The served method whose checkpoints carry this `quant_method`, or None."""
    for m in METHODS.values():
        if hf_method in m.hf_methods:
            return m
    return None

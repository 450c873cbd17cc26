"""`quantization=` against the checkpoint, before any weight is read: the method that will load
(the config's, an online one, or a GGUF file's), whether it is installed and can run on this
device, and the keyword arguments transformers' `from_pretrained` gets for it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchgen.quantization.methods import METHODS, Method, canonical, method_for_checkpoint

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class QuantPlan:
    """How the weights load: the method (vLLM's name), the checkpoint's own `quant_method`
    (None: quantized online at load), and the GGUF file inside the folder, if that is the
    source."""

    method: str
    hf_method: str | None
    gguf_file: str | None = None

    @property
    def online(self) -> bool:
        return self.hf_method is None and self.gguf_file is None

    def describe(self) -> str:
        """A few words for the capacity line."""
        how = "online" if self.online else "checkpoint"
        return f"{self.method} ({how})"


def checkpoint_method(config: PretrainedConfig) -> str | None:
    """The config's `quantization_config.quant_method` (bitsandbytes' own spelling kept), or
    None for a full-precision checkpoint."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    return str(method) if method is not None else None


def plan_quantization(config: PretrainedConfig, requested: str | None, device: torch.device,
                      gguf_file: str | None = None) -> QuantPlan | None:
    """The method that loads these weights, or None (full precision). ValueError naming
    `quantization` when the name disagrees with the checkpoint, the checkpoint's method is
    not served, an online method has no online mode, its package is missing, or its kernels
    cannot run on `device` (with the reason)."""
    asked = canonical(requested) if requested is not None else None
    found = "gguf" if gguf_file is not None else checkpoint_method(config)
    if found is not None:
        method = method_for_checkpoint(found)
        if method is None:
            raise ValueError(f"quantization: the checkpoint is quantized with {found!r}, which "
                             f"batchgen does not serve (served: {', '.join(METHODS)})")
        if asked is not None and asked != method.name:
            raise ValueError(f"quantization={requested!r} disagrees with the checkpoint, which "
                             f"is quantized with {found!r} (served as {method.name!r}); pass "
                             f"quantization=None or {method.name!r}")
        _check_runs(method, method.checkpoint_check, device, requested or method.name)
        return QuantPlan(method.name, None if gguf_file else found, gguf_file)
    if asked is None:
        return None
    method = METHODS[asked]
    if method.online_check is None:
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized with it (a "
                         "quantization_config in config.json); this model's config has none, "
                         "and only " + ", ".join(repr(m.name) for m in METHODS.values()
                                                 if m.online_check) + " quantize at load")
    _check_runs(method, method.online_check, device, requested)
    return QuantPlan(method.name, None)


def check_tensor_parallel(plan: QuantPlan | None, tensor_parallel_size: int) -> None:
    """ValueError for quantized weights under tensor parallelism: each rank would quantize or
    unpack only its shard (per-channel scales over half a row: other weights than one rank's,
    found on a tiny model with torchao int8), and no sharded quantized load is verified."""
    if plan is not None and tensor_parallel_size > 1:
        raise ValueError(
            f"quantization={plan.method!r} with tensor_parallel_size={tensor_parallel_size}: "
            "quantized weights are not verified under tensor parallelism in batchgen (each "
            "rank quantizes or unpacks its own shard, which gives other weights than one "
            "device); use tensor_parallel_size=1, or a full-precision checkpoint")


def _check_runs(method: Method, device_check: Any, device: torch.device, name: str) -> None:
    """ValueError when the method's package is missing or its kernels cannot run here."""
    if method.package and importlib.util.find_spec(method.package) is None:
        hint = (f"pip install 'batchgen[{method.extra}]'" if method.extra
                else f"pip install {method.package}")
        raise ValueError(f"quantization={name!r} needs the {method.package!r} package, which "
                         f"is not installed: {hint}")
    reason = device_check(device)
    if reason:
        raise ValueError(f"quantization={name!r} cannot run on {device}: {reason}")


def load_kwargs(plan: QuantPlan | None, dtype: torch.dtype, device: torch.device
                ) -> dict[str, Any]:
    """What `from_pretrained` gets for this plan: the GGUF file, an online method's config
    (fp8: FineGrainedFP8; bitsandbytes: 4-bit NF4 computing in the model dtype; torchao: int8
    weight-only), MXFP4 dequantized off CUDA (its CPU path fetches a kernel from the hub)."""
    if plan is None:
        return {}
    if plan.gguf_file is not None:
        return {"gguf_file": plan.gguf_file}
    if plan.method == "mxfp4" and device.type != "cuda":
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    if not plan.online:
        return {}
    return {"quantization_config": _online_config(plan.method, dtype)}


def _online_config(method: str, dtype: torch.dtype) -> Any:
    """transformers' config that quantizes a full-precision folder as it loads."""
    if method == "fp8":
        from transformers import FineGrainedFP8Config

        return FineGrainedFP8Config()
    if method == "bitsandbytes":
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_compute_dtype=dtype)
    if method == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    if method == "modelopt_fp4":
        from transformers import NVFP4Config

        return NVFP4Config()
    raise AssertionError(f"no online mode for {method!r}")  # plan_quantization refuses it

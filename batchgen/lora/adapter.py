"""A PEFT LoRA folder read and checked against the base model: what is not served is refused,
naming the adapter and the reason, before any work."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from batchgen.lora.request import LoRARequest

_PREFIX = "base_model.model."


@dataclass
class Adapter:
    """One adapter's weights in host memory: module name -> (A [r, in], B [out, r], scale)."""

    request: LoRARequest
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


def refuse(req: LoRARequest, why: str) -> ValueError:
    return ValueError(f"lora_request {req.lora_name!r} (lora_int_id={req.lora_int_id}, "
                      f"path {req.lora_path!r}): {why}")


def _config(req: LoRARequest, max_rank: int) -> dict:
    folder = Path(req.lora_path)
    if not req.lora_path or not (folder / "adapter_config.json").is_file():
        raise refuse(req, f"no adapter_config.json at {str(folder)!r} (the path is missing "
                           "or not a PEFT adapter folder)")
    if not (folder / "adapter_model.safetensors").is_file():
        raise refuse(req, f"no adapter_model.safetensors in {str(folder)!r}")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise refuse(req, f"peft_type must be 'LORA', got {cfg.get('peft_type')!r}")
    if cfg.get("use_dora"):
        raise refuse(req, "DoRA (use_dora=true) is not served")
    if cfg.get("modules_to_save"):
        raise refuse(req, f"modules_to_save {cfg['modules_to_save']!r} is not served "
                           "(only LoRA deltas on linear layers)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise refuse(req, f"{key} is not served (one rank and alpha per adapter)")
    if cfg.get("layers_to_transform") is not None or cfg.get("fan_in_fan_out"):
        raise refuse(req, "layers_to_transform and fan_in_fan_out are not served")
    if cfg.get("bias", "none") != "none":
        raise refuse(req, f"bias must be 'none', got {cfg.get('bias')!r}")
    rank = int(cfg.get("r", 8))
    if rank > max_rank:
        raise refuse(req, f"rank {rank} is above max_lora_rank={max_rank}")
    return cfg


def _targets(req: LoRARequest, cfg: dict, linears: dict[str, torch.nn.Linear]) -> set[str]:
    """The model's linear layers the config targets (PEFT's rule: a name equal to or ending in
    '.' + a listed one, or a full match of a regex string); a listed one matching none is
    refused."""
    want = cfg.get("target_modules")
    if isinstance(want, str):
        found = {n for n in linears if re.fullmatch(want, n)}
        missing = [] if found else [want]
    else:
        want = list(want or [])
        found = {n for n in linears for t in want if n == t or n.endswith("." + t)}
        missing = [t for t in want if not any(n == t or n.endswith("." + t) for n in linears)]
    if missing:
        raise refuse(req, f"target modules {missing} are not linear layers of the base model")
    return found


def load_adapter(req: LoRARequest, linears: dict[str, torch.nn.Linear], max_rank: int
                 ) -> Adapter:
    """Read and check `req`'s folder against the model's linear layers (name -> module); its
    weights stay in host memory as stored (a device slot takes a copy)."""
    cfg = _config(req, max_rank)
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = _targets(req, cfg, linears)
    tensors = load_file(str(Path(req.lora_path) / "adapter_model.safetensors"))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise refuse(req, f"tensor {key!r} is not a LoRA A or B weight")
            continue
        name = key[len(_PREFIX):-len(".lora_A.weight")] if key.startswith(_PREFIX) else key
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        mod = linears.get(name)
        if mod is None or name not in targets or b is None:
            raise refuse(req, f"tensor {key!r} names no targeted linear layer of the model")
        if a.shape != (rank, mod.in_features) or b.shape != (mod.out_features, rank):
            raise refuse(req, f"{name}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                               f"rank {rank} on a {mod.in_features}->{mod.out_features} layer")
        weights[name] = (a, b, scale)
    if not weights:
        raise refuse(req, "its safetensors file holds no LoRA weights")
    return Adapter(req, rank, weights)

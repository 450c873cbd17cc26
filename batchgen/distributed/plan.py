"""What tensor parallelism needs checked before any weights load, and how a rank loads its
shard: transformers' own tensor-parallel plan (DistributedConfig) splits the weights."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig


def check_tp(config: PretrainedConfig, tp_size: int, device: torch.device) -> None:
    """ValueError unless the model's heads split over `tp_size` ranks, transformers has a
    tensor-parallel plan for its family, and (on CUDA) that many GPUs are visible."""
    if tp_size == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's attention heads ({heads}) "
            f"and KV heads ({kv_heads}): each rank holds whole heads (transformers does not "
            "replicate KV heads); pick a tensor_parallel_size that divides both")
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(f"tensor_parallel_size={tp_size}: transformers has no tensor-parallel "
                         f"plan for {text.model_type!r} models; use tensor_parallel_size=1")
    if device.type == "cuda" and tp_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs, but "
                         f"{torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES)")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th visible GPU on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device

"""The attention function registered with transformers' AttentionInterface as "batchgen".

HF computes q/k/v (RoPE, qk-norm applied) and calls this per layer; we write the new K/V into
the paged pool by slot and run the planned backend. The step's state arrives as one keyword
argument, `batchgen_step`, passed through `model(...)` — no global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from batchgen.attention.backend import AttentionBackend
from batchgen.kv.cache import KVCache

ATTN_IMPLEMENTATION = "batchgen"


@dataclass
class StepContext:
    """Who owns what in one forward: the pool (engine-owned), the planned backend, and the
    step's int64 slot mapping on the model's device."""

    cache: KVCache
    backend: AttentionBackend
    slot_mapping: torch.Tensor


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: object) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] → ([1, T, Hq, Dv], None)."""
    ctx = kwargs.get("batchgen_step")
    if not isinstance(ctx, StepContext):
        raise RuntimeError("batchgen attention called outside a batchgen engine step")
    layer = module.layer_idx
    q = query[0].transpose(0, 1)
    ctx.cache.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.slot_mapping)
    window = kwargs.get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ctx.backend.run(layer, q, ctx.cache, float(scale), window or None,
                          kwargs.get("softcap"), kwargs.get("s_aux"))
    return out[None], None


def register() -> str:
    """Register the function (idempotent) and return the attn_implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION

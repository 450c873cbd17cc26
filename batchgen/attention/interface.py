"""The attention function registered with transformers' AttentionInterface as "batchgen".

HF computes q/k/v (RoPE, qk-norm applied) and calls this per layer. The step's state arrives as
one keyword argument, `batchgen_step`, passed through `model(...)`: a StepContext in a real
step (write the new K/V by slot, then run the planned backend), a SpecProbe at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.attention.backend import AttentionBackend
from batchgen.attention.mla import absorb_query, expand_output, is_latent
from batchgen.kv.cache import KVCache

ATTN_IMPLEMENTATION = "batchgen"


class NoStepContext(RuntimeError):
    """The attention function ran without the engine's step: the model's layers did not pass
    `batchgen_step` on to attention."""


@dataclass
class StepContext:
    """Who owns what in one forward: the pool (the LLM's), the planned backend, and the step's
    int64 slot mapping on the model's device (the runner's buffer)."""

    cache: KVCache
    backend: AttentionBackend
    slot_mapping: torch.Tensor

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None, kwargs: dict) -> torch.Tensor:
        """query [B, Hq, L, D], key/value [B, Hkv, L, D] → [B, L, Hq, Dv]: one packed row of
        T tokens (B = 1), or B rows of L tokens each, packed row after row (the [rows, 1]
        decode batches of models with state mixers)."""
        layer = module.layer_idx
        b, length = query.shape[0], query.shape[2]
        q, k, v = (x.transpose(1, 2).reshape(b * length, x.shape[1], x.shape[3])
                   for x in (query, key, value))
        self.cache.write(layer, k, v, self.slot_mapping)
        out = self.backend.run(layer, q)
        return out.reshape(b, length, *out.shape[1:])


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: object) -> tuple[torch.Tensor, None]:
    """HF's attention signature; the work is the step context's."""
    ctx = kwargs.get("batchgen_step")
    if ctx is None:
        raise NoStepContext("batchgen attention called outside a batchgen engine step")
    if is_latent(module):  # an MLA layer handing over its latent (attention/mla.py)
        out = ctx.attend(module, absorb_query(module, query), key, value, scaling, kwargs)
        return expand_output(module, out), None
    return ctx.attend(module, query, key, value, scaling, kwargs), None


def register() -> str:
    """Register the function (idempotent) and return the attn_implementation name."""
    from transformers import AttentionInterface  # its model code: imported when a model loads

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION

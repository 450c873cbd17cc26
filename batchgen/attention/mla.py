"""The latent MLA cache: DeepSeek-style layers keep their compressed latent in the pool.

An MLA layer (DeepSeek-V2/V3, Kimi-K2, ...) projects each token to a latent c (kv_lora_rank
values, normalised) and a shared rotary key part k_rot (qk_rope_head_dim), then `expand_kv`
decompresses them into per-head keys [k_nope; k_rot] and values through `kv_b_proj`. The seam
is that one method: `install_latent` replaces it so attention receives the latent itself as one
KV head (keys [c; k_rot], values c: a view of the keys' first kv_lora_rank), and the attention
function absorbs kv_b_proj into the query (q_nope · W_UK per head) before the backend runs and
applies W_UV to its output after. Scores and outputs equal the decompressed layer's (the same
sums, regrouped), while a token costs kv_lora_rank + qk_rope_head_dim values per layer (576 in
DeepSeek-V3) instead of heads x (k + v) (128 x 320). `BATCHGEN_MLA_CACHE=decompressed` keeps
the decompressed path (the tests' oracle).
"""

from __future__ import annotations

import os
from types import MethodType

import torch

LATENT_ATTR = "batchgen_latent"  # set on MLA modules whose pool holds the latent
MLA_CACHE_ENV = "BATCHGEN_MLA_CACHE"
MLA_CACHE_MODES = ("latent", "decompressed")


def mla_cache_mode() -> str:
    """"latent" (the default) or "decompressed", from BATCHGEN_MLA_CACHE; a ValueError names
    the variable and the allowed values otherwise."""
    mode = os.environ.get(MLA_CACHE_ENV, "latent")
    if mode not in MLA_CACHE_MODES:
        raise ValueError(f"{MLA_CACHE_ENV} must be one of {list(MLA_CACHE_MODES)}, got {mode!r}")
    return mode


def latent_expand_kv(self: torch.nn.Module, kv_nope: torch.Tensor, k_rot: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Replaces an MLA module's `expand_kv`: the latent as one KV head, keys [c; k_rot]
    [b, 1, T, lora + rope] and values c (a view of the keys)."""
    key = torch.cat((kv_nope, k_rot), dim=-1)
    return key, key[..., : self.kv_lora_rank]


def install_latent(model: torch.nn.Module) -> int:
    """Route every MLA module of `model` through the latent seam; returns how many."""
    count = 0
    for module in model.modules():
        if callable(getattr(module, "expand_kv", None)) and hasattr(module, "kv_b_proj"):
            module.expand_kv = MethodType(latent_expand_kv, module)
            setattr(module, LATENT_ATTR, True)
            count += 1
    return count


def is_latent(module: torch.nn.Module) -> bool:
    """Whether attention gets this module's latent (not per-head K/V)."""
    return bool(getattr(module, LATENT_ATTR, False))


def _kv_b(module: torch.nn.Module) -> torch.Tensor:
    """kv_b_proj's weight as [heads, qk_nope + v_head_dim, kv_lora_rank]."""
    w = module.kv_b_proj.weight
    return w.view(-1, module.qk_nope_head_dim + module.v_head_dim, module.kv_lora_rank)


def absorb_query(module: torch.nn.Module, query: torch.Tensor) -> torch.Tensor:
    """Query [b, H, T, nope + rope] → [b, H, T, lora + rope]: q_nope · W_UK per head, so that
    its dot product with the latent c is q_nope · k_nope (kv_b_proj's key bias, if any, adds
    the same to every key's score: softmax drops it)."""
    q_pass, q_rot = torch.split(query, [module.qk_nope_head_dim, module.qk_rope_head_dim], -1)
    w_uk = _kv_b(module)[:, : module.qk_nope_head_dim].to(query.dtype)
    return torch.cat((torch.einsum("bhtn,hnc->bhtc", q_pass, w_uk), q_rot), dim=-1)


def expand_output(module: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
    """Attention output over the latent [b, T, H, lora] → values' space [b, T, H, v_head_dim]
    (W_UV per head, plus kv_b_proj's value bias: the weights sum to one)."""
    w_uv = _kv_b(module)[:, module.qk_nope_head_dim:].to(out.dtype)
    res = torch.einsum("bthc,hvc->bthv", out, w_uv)
    bias = module.kv_b_proj.bias
    if bias is not None:
        heads = w_uv.shape[0]
        res = res + bias.view(heads, -1)[:, module.qk_nope_head_dim:].to(out.dtype)
    return res

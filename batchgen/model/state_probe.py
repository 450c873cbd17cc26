"""One probe forward at load (two tokens, so a conv window's shape is its kernel's): the
attention layers' specs (through the registered attention function) and the mixers' state
layout, read off the cache the model builds for itself."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from batchgen.attention.spec import AttentionSpec, SpecProbe
from batchgen.state.layout import (
    CACHE_API,
    CONV,
    LINEAR,
    MINIMAX_API,
    RECURRENT,
    StateEntry,
    StateLayout,
)


def state_layout(cache: Any, num_layers: int) -> StateLayout | None:
    """The per-sequence state tensors of a transformers cache after one forward."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    entries: list[StateEntry] = []
    linear = getattr(cache, "linear_cache", None)
    if isinstance(linear, list):  # MiniMax's own cache class
        entries = [StateEntry(i, LINEAR, 0, tuple(t.shape[1:]), t.dtype)
                   for i, t in enumerate(linear) if isinstance(t, torch.Tensor)]
        return StateLayout(tuple(entries), MINIMAX_API, num_layers) if entries else None
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        for kind, states in ((CONV, layer.conv_states), (RECURRENT, layer.recurrent_states)):
            entries += [StateEntry(i, kind, k, tuple(t.shape[1:]), t.dtype)
                        for k, t in states.items() if isinstance(t, torch.Tensor)]
    return StateLayout(tuple(entries), CACHE_API, num_layers) if entries else None


class UnsupportedLayers(ValueError):
    """A layer batchgen would run without its memory (the refusal, not a model's own error)."""


def _layer_kinds(model: torch.nn.Module, layers: list[int]) -> str:
    """The class names of these decoder layers (the model's list of num_layers blocks)."""
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > max(layers):
            return ", ".join(sorted({type(m[i]).__name__ for i in layers}))
    return "unknown kind"


@torch.inference_mode()
def probe_layers(model: torch.nn.Module, num_layers: int, device: torch.device,
                 check_chunks: bool = True
                 ) -> tuple[list[AttentionSpec | None], StateLayout | None]:
    """Every layer's attention spec (None for a layer without attention: `fill_specs` gives
    it the pool's geometry, its rows of the KV pool are never read) and the state layout. A layer that neither attends
    through batchgen's function nor keeps its memory in the cache (a mixer batchgen would run
    without its state) is refused."""
    from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

    probe = SpecProbe()
    ids = torch.ones(1, 2, dtype=torch.long, device=device)
    out = model(input_ids=ids, position_ids=torch.arange(2, device=device)[None],
                use_cache=True, logits_to_keep=1, batchgen_step=probe)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    layout = state_layout(cache, num_layers)
    layers = list(getattr(cache, "layers", []))
    served = {i for i, layer in enumerate(layers)
              if isinstance(layer, (LinearAttentionCacheLayerMixin, DummyLayer))}
    served |= set(layout.layers) if layout is not None else set()
    missing = [i for i in range(num_layers) if i not in probe.specs and i not in served]
    if missing:
        family = getattr(getattr(model, "config", None), "model_type", "?")
        raise UnsupportedLayers(
            f"model family {family!r}: layers {missing} ({_layer_kinds(model, missing)}) "
            "neither attend through batchgen's attention nor keep their state in "
            "transformers' cache: this architecture is not supported")
    if layout is not None:
        layout = replace(layout, attention_layers=tuple(sorted(probe.specs)))
    if layout is not None and check_chunks:
        layout = replace(layout, continues_chunks=_continues_chunks(model, layout, device))
    return [probe.specs.get(i) for i in range(num_layers)], layout


def fill_specs(specs: list[AttentionSpec | None], num_kv_heads: int, head_dim: int,
               head_dim_v: int, dtype: torch.dtype) -> list[AttentionSpec]:
    """Layers without attention (mixers, feed-forward blocks) get a spec of the pool's own
    geometry, so backends plan them like the rest; nothing ever runs them."""
    filler = AttentionSpec(num_kv_heads, num_kv_heads, head_dim, head_dim_v,
                           head_dim ** -0.5, None, None, dtype)
    return [filler if s is None else s for s in specs]


def _continues_chunks(model: torch.nn.Module, layout: StateLayout, device: torch.device
                      ) -> bool:
    """Whether the model's mixers carry state into a multi-token forward: 8 tokens at once
    against 4 + 4 through the seam (attention answers zeros in both), compared at the last
    4 positions. A mixer that restarts from zero differs by far more than rounding."""
    from batchgen.state.cache import StateCache
    from batchgen.state.pool import StatePool

    seam = StateCache(StatePool(layout, 1, device))
    slot = torch.zeros(1, dtype=torch.long, device=device)
    ids = (torch.arange(8, device=device)[None] * 7 + 3) % 50
    pos = torch.arange(8, device=device)[None]

    def run(lo: int, hi: int, fresh: bool) -> torch.Tensor:
        cache = seam.bind(slot, fresh)
        try:
            return model(input_ids=ids[:, lo:hi], position_ids=pos[:, lo:hi], cache=cache,
                         use_cache=True, batchgen_step=SpecProbe()).logits[0].float()
        finally:
            seam.release()

    whole = run(0, 8, True)[4:]
    run(0, 4, True)
    chunked = run(4, 8, False)
    return bool(torch.allclose(whole, chunked, rtol=1e-3, atol=1e-3 * whole.abs().max()))


def config_state(config: Any, dtype: torch.dtype, trust_remote_code: bool = False
                 ) -> StateLayout | None:
    """`plan_state` for a model whose config names state mixers (others skip the meta
    build), or None when the model cannot run on the meta device (a data-dependent op): the
    probe after the weights load then decides, and refuses, alone."""
    from batchgen.model.families import classify

    if not classify(config).mixer_kinds:
        return None
    try:
        return plan_state(config, dtype, trust_remote_code)
    except UnsupportedLayers:
        raise
    except Exception as e:  # any family's meta-device failure: not a verdict on the model
        from batchgen.log import logger

        logger.debug("state layout not planned from the config (%s): probed at load", e)
        return None


def plan_state(config: Any, dtype: torch.dtype, trust_remote_code: bool = False
               ) -> StateLayout | None:
    """The state layout from the config alone, before any weight loads: the model built on
    the meta device (no memory) in bfloat16 (the MoE kernels' meta path wants it) and probed
    as at load; a bfloat16 state is the model dtype's. Refuses what the loaded probe would
    (ValueError naming the family and layers)."""
    from transformers import AutoModelForCausalLM

    from batchgen.attention.interface import register

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation=register(),
            trust_remote_code=trust_remote_code).eval()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    _, layout = probe_layers(model, text.num_hidden_layers, torch.device("meta"),
                             check_chunks=False)
    if layout is None:
        return None
    entries = tuple(replace(e, dtype=dtype if e.dtype == torch.bfloat16 else e.dtype)
                    for e in layout.entries)
    return replace(layout, entries=entries)

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


@torch.inference_mode()
def probe_layers(model: torch.nn.Module, num_layers: int, device: torch.device
                 ) -> tuple[list[AttentionSpec], StateLayout | None]:
    """Every layer's attention spec (a layer without attention gets a placeholder: its rows
    of the KV pool are never read) and the state layout. A layer that neither attends
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
        raise ValueError(f"model family {family!r}: layers {missing} neither attend through "
                         "batchgen's attention nor keep their state in transformers' cache: "
                         "this architecture is not supported")
    if layout is not None:
        layout = replace(layout, continues_chunks=_continues_chunks(model, layout, device))
    some = next(iter(probe.specs.values()), None)
    filler = some or AttentionSpec(1, 1, 1, 1, 1.0, None, None, model.dtype)
    return [probe.specs.get(i, filler) for i in range(num_layers)], layout


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

"""The seam: a transformers `Cache` whose mixer layers are backed by the state pool for the
rows of one forward. HF's own mixer code (Mamba2, Gated DeltaNet, KDA, short convs, MiniMax's
lightning attention, ...) runs unchanged and reads/writes the gathered state of exactly the
sequences in the batch, one sequence per batch row. Attention layers pass K/V through
untouched: batchgen's attention function writes the paged KV pool itself."""

from __future__ import annotations

from typing import Any

import torch

from batchgen.state.layout import CONV, LINEAR, MINIMAX_API, StateLayout
from batchgen.state.pool import StatePool


def _passthrough(key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention layer's `update`: the paged pool is written by the attention function."""
    return key, value


class _AttentionLayer:
    """A layer without state: K/V pass through."""

    is_sliding = False
    is_compileable = False
    is_initialized = True

    def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return _passthrough(key, value)

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0


def _mixer_layer_class() -> type:
    """transformers' LinearAttentionLayer with K/V passed through (a layer may hold both, as
    falcon_h1's do): the state methods are transformers' own, on pool-backed tensors."""
    from transformers.cache_utils import LinearAttentionLayer

    class PoolMixerLayer(LinearAttentionLayer):
        is_sliding = False

        def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            return _passthrough(key, value)

        def get_seq_length(self) -> int:
            return 0

    return PoolMixerLayer


class StateCache:
    """Built once per runner; `bind` points it at a forward's rows, `release` writes the rows'
    new state back to the pool. `cache` is what the model receives as `cache=`."""

    def __init__(self, pool: StatePool) -> None:
        self.pool = pool
        layout = pool.layout
        self.cache = _seam_cache(layout)
        self._slots: torch.Tensor | None = None
        self._bound: dict[Any, torch.Tensor] = {}

    def bind(self, slots: torch.Tensor, fresh: bool) -> Any:
        """Gather the state of `slots` (one per batch row) for the next forward; `fresh`: the
        rows start their sequences (no previous state: the mixers start from zero, as HF's
        first forward does). A single row is bound as a view: written in place.

        A fresh row's state is zeroed, not merely flagged absent: its slot may still hold a
        finished sequence's state, and a mixer may read the state whatever the flags say
        (transformers 5.25's Mamba-2 and Jamba scans ask for the recurrent state after the conv
        update has set `has_previous_state`; zeros are what HF's reset cache gives them)."""
        self._slots = slots
        single = len(slots) == 1
        s = int(slots[0]) if single else 0
        cache = self.cache
        for e, t in self.pool.tensors.items():
            view = t[s:s + 1] if single else t[slots]
            if fresh:
                view.zero_()
            self._bound[e] = view
            if e.kind == LINEAR:
                cache.linear_states[e.layer] = view
                continue
            layer = cache.layers[e.layer]
            states = layer.conv_states if e.kind == CONV else layer.recurrent_states
            states[e.index] = view
            if e.kind == CONV:
                layer.conv_kernel_size[e.index] = e.shape[-1]
                layer.is_conv_states_initialized[e.index] = True
            else:
                layer.is_recurrent_states_initialized[e.index] = True
            layer.has_previous_state[e.index] = not fresh
            layer.device, layer.dtype = t.device, t.dtype
        cache.fresh = fresh
        return cache

    def release(self) -> None:
        """Write the forward's new state back to the rows' slots (gathered rows only: a single
        row's view was written in place) and drop the references."""
        slots, cache = self._slots, self.cache
        if slots is not None and len(slots) > 1:
            for e, t in self.pool.tensors.items():
                if e.kind == LINEAR:
                    new = cache.linear_states[e.layer]
                else:
                    layer = cache.layers[e.layer]
                    new = (layer.conv_states if e.kind == CONV else layer.recurrent_states)[
                        e.index]
                t[slots] = new
        elif slots is not None:
            for e, t in self.pool.tensors.items():  # a state the mixer re-assigned
                new = (cache.linear_states[e.layer] if e.kind == LINEAR else
                       (cache.layers[e.layer].conv_states if e.kind == CONV
                        else cache.layers[e.layer].recurrent_states)[e.index])
                if new.data_ptr() != self._bound[e].data_ptr():
                    t[slots] = new
        self._slots = None
        self._bound.clear()


def _seam_cache(layout: StateLayout) -> Any:
    """An instance of the cache class the model expects (transformers' `Cache`, or MiniMax's
    own), with pool-backed mixer layers and pass-through attention layers."""
    from transformers.cache_utils import Cache

    base: type = Cache
    if layout.api == MINIMAX_API:
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        base = MiniMaxCache
    mixer = _mixer_layer_class()
    state_layers = set(layout.layers) if layout.api != MINIMAX_API else set()
    layers = [mixer() if i in state_layers else _AttentionLayer()
              for i in range(layout.num_layers)]
    cls = type(f"Pool{base.__name__}", (_SeamMixin, base), {})
    cache = cls.__new__(cls)
    Cache.__init__(cache, layers=layers)
    cache.linear_states = {}
    cache.fresh = True
    return cache


class _SeamMixin:
    """What the model's forward asks of its cache beyond the layers' own methods."""

    layers: list[Any]
    linear_states: dict[int, torch.Tensor]
    fresh: bool

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """MiniMax: the layer's state, or None at a sequence's first forward."""
        if self.fresh:
            return None
        return self.linear_states.get(layer_idx)

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        if layer_idx in self.linear_states:
            self.linear_states[layer_idx] = state

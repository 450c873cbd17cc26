"""StateLayout: which layers keep per-sequence state, in which tensors, of which shape; read
off the cache transformers itself builds (state/probe.py), never from per-family rules."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CONV, RECURRENT, LINEAR = "conv", "recurrent", "linear"
# how the model's mixers reach their state: transformers' LinearAttention cache API
# (get_conv_state / get_recurrent_state / update_*), or MiniMax's own cache class
# (get_linear_cache / set_linear_cache)
CACHE_API, MINIMAX_API = "linear_attention", "minimax"


@dataclass(frozen=True)
class StateEntry:
    """One state tensor of one layer, per sequence: `shape` without the batch dimension."""

    layer: int
    kind: str  # CONV, RECURRENT or LINEAR
    index: int  # transformers' state_idx
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes per sequence."""
        return torch.Size(self.shape).numel() * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateLayout:
    """Every state entry of the model, the API its mixers use and the model's layer count."""

    entries: tuple[StateEntry, ...]
    api: str
    num_layers: int
    # HF's mixers continue a sequence from its state over several tokens at once (a prompt's
    # later chunks); False (Mamba-1's selective scan restarts from zero): such chunks run one
    # token per forward, HF's decode path
    continues_chunks: bool = True
    attention_layers: tuple[int, ...] = ()  # the layers that attend (the pool's K/V rows)

    @property
    def bytes_per_seq(self) -> int:
        """State bytes one sequence holds, whatever its length."""
        return sum(e.nbytes for e in self.entries)

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers holding state, ascending."""
        return tuple(sorted({e.layer for e in self.entries}))

    def of_layer(self, layer: int) -> tuple[StateEntry, ...]:
        return tuple(e for e in self.entries if e.layer == layer)

"""The KV pool: one preallocated tensor [layers, 2, blocks + 1, block_size, kv_heads, head_dim].

KVCache owns the bytes; the BlockManager decides which block holds which tokens. Layer `l` is
handed to attention as (pool[l, 0], pool[l, 1]), FlashInfer's NHD paged layout. The shape comes
from `kv_pool_shape` alone; backends declare the layout they read (registry `kv_layout`).
Keys and values of different widths (MLA decompressed: 192-wide keys, 128-wide values) get
one tensor each, [layers, 1, blocks + 1, block_size, kv_heads, width]: `tensors` lists what
holds the bytes (block axis 2 in every one), `layer_kv(l)` hands out a layer's K and V.
"""

from __future__ import annotations

import numpy as np
import torch

from batchgen.transfer import to_device


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, seq_len: int,
                   bytes_per_elem: int = 2, batch: int = 1, head_dim_v: int | None = None
                   ) -> int:
    """Exact KV-cache size in bytes (the chapter's formula: 2 · L · H_kv · d_h · b per token,
    K and V; with values `head_dim_v` wide, L · H_kv · (d_k + d_v) · b)."""
    widths = head_dim + (head_dim if head_dim_v is None else head_dim_v)
    per_token = num_layers * num_kv_heads * widths * bytes_per_elem
    return per_token * seq_len * batch


def num_blocks_for_memory(memory_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks of `block_size` tokens fit in `memory_bytes`."""
    return int(memory_bytes) // (block_size * bytes_per_token)


NHD = "NHD"  # per block: [block_size, kv_heads, head_dim], K and V in separate halves


def kv_pool_shape(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int) -> tuple[int, ...]:
    """The pool's shape in the NHD layout (vLLM's `get_kv_cache_shape`, FlashInfer's paged
    layout per layer): [layers, 2 (K, V), blocks + 1 (the scratch block), block, heads, dim]."""
    return num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVCache:
    """The paged K/V pool shared by all sequences; written by flat slot, read via block ids.
    Blocks 0..num_blocks-1 belong to the BlockManager; one more, `scratch_block`, takes the K/V
    of the runner's padding tokens and is never handed out. An fp8 pool stores K / k_scale and
    V / v_scale per layer (scales 1.0 without calibration, as vLLM); readers multiply back."""

    layout = NHD  # the layout kv_pool_shape lays out; a backend must declare the same

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 head_dim_v: int | None = None, v_in_k: bool = False,
                 kv_layers: tuple[int, ...] | None = None) -> None:
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        self.quantized = dtype in FP8_DTYPES
        self.fp8_max = torch.finfo(dtype).max if self.quantized else None  # saturation bound
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.dtype = dtype
        self.device = torch.device(device)
        # a hybrid's mixer layers hold no K/V: the pool has rows for `kv_layers` only
        self.kv_layers = tuple(range(num_layers)) if kv_layers is None else tuple(kv_layers)
        shape = kv_pool_shape(len(self.kv_layers), num_blocks, block_size, num_kv_heads,
                              head_dim)
        self.v_in_k = v_in_k
        if v_in_k:  # an MLA latent: the values are the keys' first head_dim_v (no V tensor)
            self.pool = None
            k_all = torch.zeros((*shape[:1], 1, *shape[2:]), dtype=dtype, device=device)
            self.tensors = (k_all,)
            k_pool, v_pool = k_all[:, 0], k_all[:, 0, ..., : self.head_dim_v]
        elif self.head_dim_v == head_dim:
            self.pool: torch.Tensor | None = torch.zeros(shape, dtype=dtype, device=device)
            self.tensors = (self.pool,)
            k_pool, v_pool = self.pool[:, 0], self.pool[:, 1]
        else:  # no single [layers, 2, ...] tensor: K and V apart, each its own width
            self.pool = None
            k_all = torch.zeros((*shape[:1], 1, *shape[2:]), dtype=dtype, device=device)
            v_all = torch.zeros((*shape[:1], 1, *shape[2:-1], self.head_dim_v), dtype=dtype,
                                device=device)
            self.tensors = (k_all, v_all)
            k_pool, v_pool = k_all[:, 0], v_all[:, 0]
        # per model layer [blocks + 1, block_size, kv_heads, width]: what attention reads
        # (None for a layer without K/V: reading it is a bug, never a wrong layer's bytes)
        self.k_blocks = self._by_layer(list(k_pool.unbind(0)))
        self.v_blocks = self._by_layer(list(v_pool.unbind(0)))
        slots = (num_blocks + 1) * block_size
        # Flat per-layer views [slots, kv_heads, width]: writes index these.
        self.k_flat = [None if k is None else k.view(slots, num_kv_heads, head_dim)
                       for k in self.k_blocks]
        self.v_flat = ([] if v_in_k else
                       [None if v is None else v.view(slots, num_kv_heads, self.head_dim_v)
                        for v in self.v_blocks])

    def _by_layer(self, rows: list[torch.Tensor]) -> list:
        """The pool's per-layer rows placed at their model layers (None where none)."""
        out: list[torch.Tensor | None] = [None] * self.num_layers
        for layer, row in zip(self.kv_layers, rows):
            out[layer] = row
        return out

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V blocks, each [blocks + 1, block_size, kv_heads, width]."""
        return self.k_blocks[layer], self.v_blocks[layer]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (the scratch block included)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def bytes_per_token(self) -> int:
        """β = L · H_kv · (d_k + d_v) · b (2 · L · H_kv · d_h · b when the widths agree), L
        the layers holding K/V."""
        return kv_cache_bytes(len(self.kv_layers), self.num_kv_heads, self.head_dim, 1,
                              self.tensors[0].element_size(),
                              head_dim_v=0 if self.v_in_k else self.head_dim_v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Scatter this step's new K/V [T, kv_heads, head_dim] into their slots (int64 [T])."""
        if self.quantized:
            k = self._quantize(k, self.k_scales[layer])
            v = self._quantize(v, self.v_scales[layer])
        self._write(self.k_flat[layer], k, slot_mapping)
        if not self.v_in_k:  # a latent's values are its keys' first columns, written above
            self._write(self.v_flat[layer], v, slot_mapping)

    def _write(self, flat: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        x = x.to(self.dtype)
        if self.quantized:  # index_copy_ has no float8 kernel on every device: copy the bytes
            flat, x = flat.view(torch.uint8), x.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, x)

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x / scale, saturated to the fp8 type's range (448 for e4m3fn, 57344 for e5m2: a
        plain cast would turn outliers into NaN or inf)."""
        if scale != 1.0:
            x = x / scale
        return x.clamp(-self.fp8_max, self.fp8_max)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src → dst for every (src, dst), in every layer, K and V, in one
        gather and one indexed copy (float8 as bytes: not every device has its kernels)."""
        if copies:
            src, dst = to_device(np.array(copies, np.int64), self.device).unbind(1)
            for t in self.tensors:
                raw = t.view(torch.uint8) if self.quantized else t
                # [layers * 2, blocks, block bytes]: a flat block dimension copies faster
                raw = raw.view(raw.shape[0] * raw.shape[1], raw.shape[2], -1)
                raw.index_copy_(1, dst, raw.index_select(1, src))

"""Reference paged attention in plain PyTorch: any device, GQA/MQA, bottom-right causal chunks,
sliding windows, logit softcap and attention sinks.

plan() turns the step's FlashInfer-format metadata into padded gather indices and masks once per
step; run() per layer gathers K/V through those indices and calls SDPA (or an explicit softmax
when softcap or sinks need it). Long prefill chunks are cut into query tiles that see only the keys up
to their last query (the causal upper triangle is skipped), and tiles are bucketed by query and
KV length to bound padding; there is no Python loop over tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen.attention.metadata import StepMetadata
from batchgen.kv.cache import KVCache


@dataclass
class _Group:
    """Sequences of similar query and KV length, padded to [S, max_q] queries and [S, max_kv]
    keys (max_kv = max_pages * block_size: whole blocks are gathered)."""

    rows: slice | torch.Tensor  # packed rows of its queries: a slice when contiguous, unpadded
    q_valid: torch.Tensor | None  # [S, max_q] bool when queries are padded, else None
    num_seqs: int
    max_q: int
    width: int  # keys per query row (whole gathered blocks are cut to this)
    pages: torch.Tensor  # [S * max_pages] physical block of each logical block; pads → 0
    q_pos: torch.Tensor  # [S, max_q, 1] position of each query (bottom-right aligned)
    base_mask: torch.Tensor  # [S, max_q, max_kv] causal & in-range
    masks: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """[S, 1, groups*max_q, max_kv] additive mask (0 / -inf), built once per step for each
        window size and shared by the layers (SDPA would otherwise convert a bool mask per call)."""
        key = (window, groups, dtype)
        if key not in self.masks:
            m = self.base_mask
            if window is not None:
                kv_pos = torch.arange(m.shape[-1], device=m.device)
                m = m & (kv_pos > self.q_pos - window)
            if self.q_valid is not None:  # padded query rows see key 0: no all -inf row (NaN)
                m = m.clone()
                m[..., 0] |= ~self.q_valid
            s, q, k = m.shape
            add = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(
                ~m, float("-inf"))
            self.masks[key] = add[:, None, None].expand(s, 1, groups, q, k).reshape(
                s, 1, groups * q, k)
        return self.masks[key]


# Prefill chunks longer than this are split into query tiles that each attend only to the keys
# up to their last query (bottom-right causal), skipping the upper triangle: ~0.6x the work.
QUERY_TILE = 32
# CPU SDPA reduces over keys in blocks of min(512, keys): a decode row padded to a multiple of
# 512 keys gets the same bits whatever else shares its call.
KV_SPLIT = 512


def _shape(q_len: int, kv_len: int) -> tuple[int, int]:
    """The canonical (queries, keys) of the SDPA call a tile joins. It depends on the tile
    alone, so a sequence's result never depends on the batch (batch invariance): prefill
    tiles group by exact shape, decode rows by keys rounded up to KV_SPLIT."""
    if q_len == 1:
        return 1, KV_SPLIT * math.ceil(kv_len / KV_SPLIT)
    return q_len, kv_len


def _tiles(q_start: int, q_len: int, kv_len: int) -> list[tuple[int, int, int]]:
    """(q_start, q_len, kv_len) tiles of one sequence's queries: one for a decode row or short
    chunk, else tiles cut at multiples of QUERY_TILE positions (so a query lands in the same
    tile whatever chunk it came in), each seeing the keys up to its own last query."""
    if q_len <= QUERY_TILE:
        return [(q_start, q_len, kv_len)]
    first = kv_len - q_len  # position of the first query
    cuts = [first, *range((first // QUERY_TILE + 1) * QUERY_TILE, kv_len, QUERY_TILE), kv_len]
    return [(q_start + a - first, b - a, b) for a, b in zip(cuts, cuts[1:])]


class TorchPagedAttention:
    """Vectorised paged attention in PyTorch; the CPU path and the GPU reference."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.groups: list[_Group] = []
        self.num_tokens = 0

    def plan(self, meta: StepMetadata) -> None:
        """Build the padded gather indices and masks shared by every layer of this step."""
        bs = meta.block_size
        qo = meta.qo_indptr.tolist()
        kv_ptr = meta.kv_indptr.tolist()
        last = meta.kv_last_page_len.tolist()
        indices = meta.kv_indices.tolist()
        buckets: dict[tuple[int, int], list[tuple[int, int, int, list[int]]]] = {}
        for i in range(len(last)):
            kv = (kv_ptr[i + 1] - kv_ptr[i] - 1) * bs + last[i]
            pages = indices[kv_ptr[i]:kv_ptr[i + 1]]
            for q0, qn, kvn in _tiles(qo[i], qo[i + 1] - qo[i], kv):
                buckets.setdefault(_shape(qn, kvn), []).append((q0, qn, kvn, pages))
        self.groups = [self._group(tiles, width, bs)
                       for (_, width), tiles in sorted(buckets.items())]

    def _group(self, tiles: list[tuple[int, int, int, list[int]]], width: int, bs: int
               ) -> _Group:
        """Index tensors and the causal mask of one group of query tiles, `width` keys each."""
        dev = self.device
        q_len = [t[1] for t in tiles]
        kv_len = [t[2] for t in tiles]
        max_q = max(q_len)
        max_pages = (width + bs - 1) // bs
        pages: list[int] = []
        for _, _, kvn, own in tiles:  # page table rows, right-padded with block 0 (masked)
            n = (kvn + bs - 1) // bs
            pages.extend(own[:n])
            pages.extend([0] * (max_pages - n))
        q_len_t = torch.tensor(q_len)
        kv_len_t = torch.tensor(kv_len)
        ar_q = torch.arange(max_q)
        ar_kv = torch.arange(width)
        q_pos = (kv_len_t - q_len_t)[:, None] + ar_q[None]  # bottom-right causal alignment
        base = (ar_kv[None, None, :] < kv_len_t[:, None, None]) & (
            ar_kv[None, None, :] <= q_pos[:, :, None])
        contiguous = all(a[0] + a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
        if min(q_len) == max_q and contiguous:
            sel: slice | torch.Tensor = slice(tiles[0][0], tiles[-1][0] + tiles[-1][1])
            q_valid = None
        else:
            q_valid = ar_q[None] < q_len_t[:, None]
            starts = torch.tensor([t[0] for t in tiles])
            sel = torch.where(q_valid, starts[:, None] + ar_q[None], 0).to(dev)
            q_valid = q_valid.to(dev)
        return _Group(rows=sel, q_valid=q_valid, num_seqs=len(tiles), max_q=max_q, width=width,
                      pages=torch.tensor(pages, device=dev), q_pos=q_pos[:, :, None].to(dev),
                      base_mask=base.to(dev))

    def run(self, layer: int, q: torch.Tensor, cache: KVCache, scale: float,
            window: int | None, softcap: float | None, sinks: torch.Tensor | None
            ) -> torch.Tensor:
        """Attention for all packed queries q [T, Hq, D] of this layer → [T, Hq, Dv]."""
        kv_blocks = cache.pool[layer]  # [2, P, B, Hkv, D]
        t, hq, _ = q.shape
        hkv = kv_blocks.shape[3]
        g = hq // hkv
        out = q.new_empty(t, hq, kv_blocks.shape[-1])
        for grp in self.groups:
            s, mq = grp.num_seqs, grp.max_q
            qg = q[grp.rows].view(s, mq, hkv, g, -1)  # [S, mq, Hkv, G, D]
            qg = qg.permute(0, 2, 3, 1, 4).reshape(s, hkv, g * mq, -1)
            kg, vg = _gather(kv_blocks, grp.pages, s, grp.width, q.dtype)  # [S, Hkv, W, D]
            mask = grp.mask(window, g, q.dtype)
            if softcap is None and sinks is None:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
            else:
                og = _explicit_attention(qg, kg, vg, mask, scale, softcap, sinks, hkv, g, mq)
            og = og.view(s, hkv, g, mq, -1).permute(0, 3, 1, 2, 4)  # [S, mq, Hkv, G, Dv]
            if grp.q_valid is None:
                out[grp.rows] = og.reshape(s * mq, hq, -1)
            else:
                out[grp.rows[grp.q_valid]] = og.reshape(s, mq, hq, -1)[grp.q_valid]
        return out


def _gather(kv_blocks: torch.Tensor, pages: torch.Tensor, s: int, width: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks of each sequence (contiguous block_size x Hkv x D rows, cheaper than
    per-slot gathers), cut to `width` keys: K and V as [S, Hkv, width, D] in the compute dtype."""
    _, _, bs, hkv, d = kv_blocks.shape
    k = kv_blocks[0].index_select(0, pages).view(s, -1, hkv, d)[:, :width].transpose(1, 2)
    v = kv_blocks[1].index_select(0, pages).view(s, -1, hkv, d)[:, :width].transpose(1, 2)
    return k.to(dtype), v.to(dtype)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float, softcap: float | None, sinks: torch.Tensor | None,
                        hkv: int, g: int, mq: int) -> torch.Tensor:
    """Softmax attention with Gemma-2 logit softcap and GPT-OSS sinks, as HF's eager path;
    `mask` is additive (0 / -inf)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is not None:
        s = scores.shape[0]
        sink = sinks.to(scores.dtype).view(1, hkv, g, 1, 1).expand(s, hkv, g, mq, 1)
        scores = torch.cat([scores, sink.reshape(s, hkv, g * mq, 1)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(v.dtype), v)

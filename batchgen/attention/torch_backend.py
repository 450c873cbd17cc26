"""Reference paged attention in plain PyTorch: any device, GQA/MQA, bottom-right causal chunks,
sliding windows, logit softcap and attention sinks.

plan() turns the step's FlashInfer-format metadata into padded gather indices and masks once per
step; run() per layer gathers K/V through those indices and calls SDPA (or an explicit softmax
when softcap or sinks need it). Sequences are bucketed by query and KV length (decode rows apart
from prefill chunks, powers of two) to bound padding; there is no Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen.attention.metadata import StepMetadata
from batchgen.kv.cache import KVCache


@dataclass
class _Group:
    """Sequences of similar query length, padded to [S, max_q] queries and [S, max_kv] keys
    (max_kv = max_pages * block_size: whole blocks are gathered)."""

    q_rows: torch.Tensor  # [S, max_q] row of the packed batch for each (seq, query); pads → 0
    out_rows: torch.Tensor  # [n_valid] packed rows that receive outputs
    q_valid: torch.Tensor | None  # [S, max_q] bool, None when no query padding
    pages: torch.Tensor  # [S * max_pages] physical block of each logical block; pads → 0
    q_pos: torch.Tensor  # [S, max_q, 1] position of each query (bottom-right aligned)
    base_mask: torch.Tensor  # [S, max_q, max_kv] causal & in-range
    pad_fix: torch.Tensor | None  # [S, max_q, max_kv] lets padded query rows see key 0 (no NaN)
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
            if self.pad_fix is not None:
                m = m | self.pad_fix
            s, q, k = m.shape
            add = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(
                ~m, float("-inf"))
            self.masks[key] = add[:, None, None].expand(s, 1, groups, q, k).reshape(
                s, 1, groups * q, k)
        return self.masks[key]


def _bucket(q_len: int, kv_len: int, max_kv_bits: int) -> tuple[int, int]:
    """Group key: decode rows (q_len 1) apart from prefill chunks, query lengths by power of two,
    and KV lengths by power of two within the top three octaves, so padding stays under ~2x
    while a step makes few kernel calls."""
    q_key = 0 if q_len == 1 else (q_len - 1).bit_length()
    return q_key, max(kv_len.bit_length(), max_kv_bits - 2)


class TorchPagedAttention:
    """Vectorised paged attention in PyTorch; the CPU path and the GPU reference."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.groups: list[_Group] = []
        self.num_tokens = 0

    def plan(self, meta: StepMetadata) -> None:
        """Build the padded gather indices and masks shared by every layer of this step."""
        kv_lens = meta.kv_lens()
        max_kv_bits = meta.max_kv_len.bit_length()
        buckets: dict[tuple[int, int], list[int]] = {}
        for i, (q, kv) in enumerate(zip(meta.q_lens().tolist(), kv_lens.tolist())):
            buckets.setdefault(_bucket(q, kv, max_kv_bits), []).append(i)
        self.num_tokens = meta.num_tokens
        self.groups = [self._group(meta, torch.tensor(rows), kv_lens)
                       for _, rows in sorted(buckets.items())]

    def _group(self, meta: StepMetadata, rows: torch.Tensor, kv_lens_all: torch.Tensor
               ) -> _Group:
        dev, bs = self.device, meta.block_size
        q_start = meta.qo_indptr[rows].long()
        q_len = (meta.qo_indptr[rows + 1] - meta.qo_indptr[rows]).long()
        kv_len = kv_lens_all[rows].long()
        max_q, max_kv = int(q_len.max()), int(kv_len.max())
        ar_q = torch.arange(max_q)
        q_valid = ar_q[None] < q_len[:, None]
        q_rows = torch.where(q_valid, q_start[:, None] + ar_q[None], 0)
        # Padded page table [S, max_pages] from kv_indptr/kv_indices: whole blocks are gathered
        # (contiguous block_size x Hkv x D rows), keys past kv_len are masked.
        max_pages = (max_kv + bs - 1) // bs
        p_start = meta.kv_indptr[rows].long()
        n_pages = (meta.kv_indptr[rows + 1] - meta.kv_indptr[rows]).long()
        ar_p = torch.arange(max_pages)
        page_pos = torch.where(ar_p[None] < n_pages[:, None], p_start[:, None] + ar_p[None], 0)
        pages = meta.kv_indices.long()[page_pos]
        pages = torch.where(ar_p[None] < n_pages[:, None], pages, 0)
        ar_kv = torch.arange(max_pages * bs)
        kv_valid = ar_kv[None] < kv_len[:, None]
        q_pos = (kv_len - q_len)[:, None] + ar_q[None]  # bottom-right causal alignment
        base = kv_valid[:, None, :] & (ar_kv[None, None, :] <= q_pos[:, :, None])
        padded = not bool(q_valid.all())
        pad_fix = None
        if padded:
            pad_fix = (~q_valid)[:, :, None] & (ar_kv == 0)[None, None, :]
        return _Group(
            q_rows=q_rows.to(dev), out_rows=q_rows[q_valid].to(dev),
            q_valid=q_valid.to(dev) if padded else None, pages=pages.reshape(-1).to(dev),
            q_pos=q_pos[:, :, None].to(dev), base_mask=base.to(dev),
            pad_fix=pad_fix.to(dev) if pad_fix is not None else None)

    def run(self, layer: int, q: torch.Tensor, cache: KVCache, scale: float,
            window: int | None, softcap: float | None, sinks: torch.Tensor | None
            ) -> torch.Tensor:
        """Attention for all packed queries q [T, Hq, D] of this layer → [T, Hq, Dv]."""
        k_blocks, v_blocks = cache.layer(layer)  # [P, B, Hkv, D]
        t, hq, _ = q.shape
        hkv = k_blocks.shape[2]
        g = hq // hkv
        out = q.new_empty(t, hq, v_blocks.shape[-1])
        for grp in self.groups:
            s, mq = grp.q_rows.shape
            qg = q[grp.q_rows]  # [S, mq, Hq, D]
            qg = qg.view(s, mq, hkv, g, -1).permute(0, 2, 3, 1, 4).reshape(s, hkv, g * mq, -1)
            kg = _gather(k_blocks, grp.pages, s, q.dtype)  # [S, Hkv, max_pages * B, D]
            vg = _gather(v_blocks, grp.pages, s, q.dtype)
            mask = grp.mask(window, g, q.dtype)
            if softcap is None and sinks is None:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
            else:
                og = _explicit_attention(qg, kg, vg, mask, scale, softcap, sinks, hkv, g, mq)
            og = og.view(s, hkv, g, mq, -1).permute(0, 3, 1, 2, 4).reshape(s, mq, hq, -1)
            if grp.q_valid is None:
                out[grp.out_rows] = og.reshape(s * mq, hq, -1)
            else:
                out[grp.out_rows] = og[grp.q_valid]
        return out


def _gather(blocks: torch.Tensor, pages: torch.Tensor, s: int, dtype: torch.dtype
            ) -> torch.Tensor:
    """Whole blocks of each sequence, [S, Hkv, pages * block_size, D], in the compute dtype."""
    _, bs, hkv, d = blocks.shape
    kv = blocks.index_select(0, pages).view(s, -1, hkv, d)
    return kv.transpose(1, 2).to(dtype)


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

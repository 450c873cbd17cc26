"""Reference paged attention in plain PyTorch: any device, GQA/MQA, bottom-right causal chunks,
sliding windows, logit softcap and attention sinks.

plan() turns the step's FlashInfer-format metadata into gather indices and masks once per step;
run() per layer gathers K/V through those indices and calls SDPA (or an explicit softmax when
softcap or sinks need it). With the compiled CPU kernel (cpu_kernel.py), decode rows skip the
gathers: the kernel reads their blocks in place, each row over its exact length; rows sharing
blocks then need no cascade. Long prefill chunks are cut into query tiles that see only the keys
up to their last query (the causal upper triangle is skipped). Tiles of one shape share an SDPA
call; the shape depends on the tile alone (see _shape), so results are batch invariant. There is
no Python loop over tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen.attention.cascade import Cascade, plan_cascades, run_cascade
from batchgen.attention.cpu_kernel import PagedDecodeKernel
from batchgen.attention.metadata import StepMetadata
from batchgen.kv.cache import KVCache


@dataclass
class _Group:
    """Query tiles of one shape: S tiles of `q_len` queries, each over `width` keys."""

    rows: slice | torch.Tensor  # packed rows of the tiles' queries: a slice when contiguous
    num_seqs: int
    q_len: int
    width: int  # keys per tile (gathered whole blocks are cut to this)
    pages: torch.Tensor  # [S * ceil(width / B)] physical blocks of each tile; pads → 0
    q_pos: torch.Tensor  # [S, q_len, 1] position of each query (bottom-right aligned)
    base_mask: torch.Tensor  # [S, q_len, width] causal & in-range
    masks: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """[S, 1, groups*q_len, width] additive mask (0 / -inf), built once per step for each
        window size and shared by the layers (SDPA would otherwise convert a bool mask per call)."""
        key = (window, groups, dtype)
        if key not in self.masks:
            m = self.base_mask
            if window is not None:
                kv_pos = torch.arange(m.shape[-1], device=m.device)
                m = m & (kv_pos > self.q_pos - window)
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


@dataclass
class _KernelRows:
    """Decode rows handed to the CPU kernel: their packed rows and page tables (int32)."""

    rows: slice | torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor


class TorchPagedAttention:
    """Vectorised paged attention in PyTorch; the CPU path and the GPU reference. With
    `decode_kernel`, every decode row on the CPU goes to the compiled kernel instead (and no
    cascade is planned)."""

    def __init__(self, device: torch.device | str = "cpu", use_cascade: bool = True,
                 decode_kernel: PagedDecodeKernel | None = None) -> None:
        self.device = torch.device(device)
        self.decode_kernel = decode_kernel if self.device.type == "cpu" else None
        # The kernel reads shared blocks in place (cache-hot after the first row), which beats
        # the gathers a cascade saves and keeps every row's bits batch invariant.
        self.use_cascade = use_cascade and self.decode_kernel is None
        self.name = "torch+cpu-kernel" if self.decode_kernel is not None else "torch"
        self.groups: list[_Group] = []
        self.cascade: Cascade | None = None
        self.kernel_rows: _KernelRows | None = None

    def plan(self, meta: StepMetadata) -> None:
        """Build the gather indices and masks shared by every layer of this step."""
        bs = meta.block_size
        qo = meta.qo_indptr.tolist()
        kv_ptr = meta.kv_indptr.tolist()
        last = meta.kv_last_page_len.tolist()
        indices = meta.kv_indices.tolist()
        kv_lens = [(kv_ptr[i + 1] - kv_ptr[i] - 1) * bs + last[i] for i in range(len(last))]
        pages = [indices[kv_ptr[i]:kv_ptr[i + 1]] for i in range(len(last))]
        self.cascade, covered = None, set()
        if self.use_cascade:
            self.cascade, covered = plan_cascades(qo, kv_lens, pages, bs, self.device)
        self.kernel_rows = None
        if self.decode_kernel is not None:
            decode = [i for i in range(len(last)) if qo[i + 1] - qo[i] == 1 and i not in covered]
            if decode:
                self.kernel_rows = _kernel_rows(decode, qo, kv_lens, pages)
                covered = covered | set(decode)
        buckets: dict[tuple[int, int], list[tuple[int, int, int, list[int]]]] = {}
        for i in range(len(last)):
            if i in covered:
                continue
            for q0, qn, kvn in _tiles(qo[i], qo[i + 1] - qo[i], kv_lens[i]):
                buckets.setdefault(_shape(qn, kvn), []).append((q0, qn, kvn, pages[i]))
        self.groups = [self._group(tiles, width, bs)
                       for (_, width), tiles in sorted(buckets.items())]

    def _group(self, tiles: list[tuple[int, int, int, list[int]]], width: int, bs: int
               ) -> _Group:
        """Index tensors and the causal mask of one group of same-shape query tiles."""
        dev = self.device
        q_len = tiles[0][1]
        kv_len = torch.tensor([t[2] for t in tiles])
        n_pages = (width + bs - 1) // bs
        pages: list[int] = []
        for _, _, kvn, own in tiles:  # page table rows, right-padded with block 0 (masked)
            n = (kvn + bs - 1) // bs
            pages.extend(own[:n])
            pages.extend([0] * (n_pages - n))
        ar_kv = torch.arange(width)
        q_pos = (kv_len - q_len)[:, None] + torch.arange(q_len)[None]  # bottom-right causal
        base = (ar_kv[None, None, :] < kv_len[:, None, None]) & (
            ar_kv[None, None, :] <= q_pos[:, :, None])
        if all(a[0] + a[1] == b[0] for a, b in zip(tiles, tiles[1:])):
            rows: slice | torch.Tensor = slice(tiles[0][0], tiles[-1][0] + q_len)
        else:
            starts = torch.tensor([t[0] for t in tiles])
            rows = (starts[:, None] + torch.arange(q_len)[None]).reshape(-1).to(dev)
        return _Group(rows=rows, num_seqs=len(tiles), q_len=q_len, width=width,
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
            s, mq = grp.num_seqs, grp.q_len
            qg = q[grp.rows].view(s, mq, hkv, g, -1)  # [S, mq, Hkv, G, D]
            qg = qg.permute(0, 2, 3, 1, 4).reshape(s, hkv, g * mq, -1)
            kg, vg = _gather(kv_blocks, grp.pages, s, grp.width, q.dtype)  # [S, Hkv, W, D]
            mask = grp.mask(window, g, q.dtype)
            if softcap is None and sinks is None:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
            else:
                og = _explicit_attention(qg, kg, vg, mask, scale, softcap, sinks, hkv, g, mq)
            og = og.view(s, hkv, g, mq, -1).permute(0, 3, 1, 2, 4)  # [S, mq, Hkv, G, Dv]
            out[grp.rows] = og.reshape(s * mq, hq, -1)
        if self.cascade is not None:
            run_cascade(self.cascade, q, kv_blocks, scale, window, softcap, sinks, out)
        if self.kernel_rows is not None:
            self._run_kernel(self.kernel_rows, q, kv_blocks, scale, window, softcap, sinks, out,
                             check_tables=layer == 0)
        return out

    def _run_kernel(self, kr: _KernelRows, q: torch.Tensor, kv_blocks: torch.Tensor,
                    scale: float, window: int | None, softcap: float | None,
                    sinks: torch.Tensor | None, out: torch.Tensor, check_tables: bool) -> None:
        """Decode rows through the compiled kernel, straight from the pool's blocks (the page
        tables are checked against the pool on the step's first layer)."""
        assert self.decode_kernel is not None
        qk = q[kr.rows].float().contiguous()
        direct = isinstance(kr.rows, slice) and out.dtype == torch.float32
        res = out[kr.rows] if direct else torch.empty_like(qk)
        self.decode_kernel(qk, kv_blocks[0], kv_blocks[1], res, kr.kv_indptr, kr.kv_indices,
                           kr.kv_len, scale, window, softcap, sinks, check_tables)
        if not direct:
            out[kr.rows] = res.to(out.dtype)


def _kernel_rows(seqs: list[int], qo: list[int], kv_lens: list[int], pages: list[list[int]]
                 ) -> _KernelRows:
    """Page tables of the decode rows the kernel takes (their query rows, in order)."""
    rows = [qo[i] for i in seqs]
    indptr = [0]
    indices: list[int] = []
    for i in seqs:
        indices.extend(pages[i])
        indptr.append(len(indices))
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    i32 = torch.int32
    return _KernelRows(
        rows=slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows),
        kv_indptr=torch.tensor(indptr, dtype=i32), kv_indices=torch.tensor(indices, dtype=i32),
        kv_len=torch.tensor([kv_lens[i] for i in seqs], dtype=i32))


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

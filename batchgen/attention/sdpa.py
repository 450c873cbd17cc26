"""Paged attention through PyTorch SDPA over gathered blocks: any device, GQA/MQA,
bottom-right causal chunks, sliding windows, logit softcap and attention sinks.

Prefill chunks are cut into query tiles that see only the keys up to their own window (the
causal upper triangle is mostly skipped). Tiles of one shape share an SDPA call; a tile's shape,
and the row each query takes in it, depend on its absolute positions alone (see `_tiles`), so a
sequence's result depends neither on its batch neighbours nor on how its prompt was chunked or
cached (batch invariance). There is no Python loop over tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen.attention.spec import AttentionSpec
from batchgen.kv.cache import KVCache

# Prefill chunks are cut into tiles at multiples of this many positions; each attends only to
# the keys up to its window's end (bottom-right causal), skipping the upper triangle.
QUERY_TILE = 32
# CPU SDPA reduces over keys in blocks of min(512, keys): a decode row padded to a multiple of
# 512 keys gets the same bits whatever else shares its call.
KV_SPLIT = 512


@dataclass
class _Group:
    """Query tiles of one shape: S tiles of `q_len` query rows, each over `width` keys."""

    rows: slice | torch.Tensor  # packed rows of the tiles' real queries: a slice when contiguous
    slots: torch.Tensor | None  # where each real query sits among the S*q_len rows (None: all)
    num_seqs: int
    q_len: int
    width: int  # keys per tile (gathered whole blocks are cut to this)
    pages: torch.Tensor  # [S * ceil(width / B)] physical blocks of each tile; pads → 0
    q_pos: torch.Tensor  # [S, q_len, 1] position of each query (bottom-right aligned)
    base_mask: torch.Tensor  # [S, q_len, width] causal & in-range
    masks: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    span_mask: torch.Tensor | None = None  # [S, q_len, width] query and key in one image

    def mask(self, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """[S, 1, groups*q_len, width] additive mask (0 / -inf), built once per step for each
        window size and shared by the layers (SDPA would otherwise convert a bool mask per call).
        Bidirectional image spans widen the causal part; a window then bounds both (HF's
        Gemma 3: AND(window, OR(causal, same image)))."""
        key = (window, groups, dtype)
        if key not in self.masks:
            m = self.base_mask if self.span_mask is None else self.base_mask | self.span_mask
            if window is not None:
                kv_pos = torch.arange(m.shape[-1], device=m.device)
                m = m & (kv_pos > self.q_pos - window)
            s, q, k = m.shape
            add = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(
                ~m, float("-inf"))
            self.masks[key] = add[:, None, None].expand(s, 1, groups, q, k).reshape(
                s, 1, groups * q, k)
        return self.masks[key]


@dataclass(frozen=True)
class _Tile:
    """One sequence's queries in one SDPA tile: packed rows [row, row + n) are the queries at
    positions [first, first + n); the tile holds q_len rows from position first - lead, and its
    keys are positions [0, kv_len) of a `width`-wide window."""

    row: int
    n: int
    lead: int
    q_len: int
    kv_len: int
    width: int
    end: int = -1  # one past its last query's position (-1: kv_len)
    spans: tuple[tuple[int, int], ...] = ()  # bidirectional images its queries are in

    @property
    def first_row_position(self) -> int:
        """The position of the tile's row 0."""
        return (self.kv_len if self.end < 0 else self.end) - self.n - self.lead


def _tiles(q_start: int, q_len: int, kv_len: int,
           spans: Sequence[tuple[int, int]] = ()) -> list[_Tile]:
    """The SDPA tiles of one sequence's queries.

    A decode row (one query) is one tile, its keys rounded up to KV_SPLIT. A prefill chunk is
    cut at absolute multiples of QUERY_TILE positions; each tile has QUERY_TILE query rows (the
    positions of its window, those outside the chunk padded) and is as wide as its window (keys
    past its last query are masked). So a prompt position lands in the same row of an SDPA call
    of the same shape however the prompt is chunked or prefix-cached: CPU SDPA blocks its
    queries by row, so its bits depend neither on the batch, the token budget nor the cache.
    `spans`: bidirectional images [s, e) of the sequence; a tile with queries in one also
    sees its keys up to e (never past the chunk: the scheduler ends no chunk inside one)."""
    if q_len == 1:
        return [_Tile(q_start, 1, 0, 1, kv_len, KV_SPLIT * math.ceil(kv_len / KV_SPLIT))]
    first = kv_len - q_len  # position of the first query
    cuts = [first, *range((first // QUERY_TILE + 1) * QUERY_TILE, kv_len, QUERY_TILE), kv_len]
    tiles = []
    for a, b in zip(cuts, cuts[1:]):
        near = tuple((s, e) for s, e in spans if s < b and e > a)
        reach = max([b, *(e for _, e in near)])
        if reach > kv_len:
            raise RuntimeError(f"a prefill chunk ends at {kv_len}, inside a bidirectional "
                               f"image ending at {reach}")
        tiles.append(_Tile(q_start + a - first, b - a, a % QUERY_TILE, QUERY_TILE, reach,
                           QUERY_TILE * math.ceil(reach / QUERY_TILE), b, near))
    return tiles


class SdpaTiles:
    """The SDPA strategy for a subset of a step's sequences: `plan` groups their query tiles
    by shape once per step, `run` attends one layer and writes their rows of `out`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[_Group] = []

    def plan(self, qo: list[int], kv_lens: list[int],
             pages: Sequence[list[int]] | Mapping[int, list[int]], seqs: Iterable[int],
             block_size: int, spans: Mapping[int, list[tuple[int, int]]] | None = None
             ) -> None:
        """Tiles of the sequences `seqs` (indices into qo / kv_lens / pages), grouped by shape;
        `spans`: each sequence's bidirectional images (StepMetadata.spans)."""
        buckets: dict[tuple[int, int], list[tuple[_Tile, list[int]]]] = {}
        spans = spans or {}
        for i in seqs:  # tiles of one (rows, width) shape share an SDPA call
            for t in _tiles(qo[i], qo[i + 1] - qo[i], kv_lens[i], spans.get(i, ())):
                buckets.setdefault((t.q_len, t.width), []).append((t, pages[i]))
        self.groups = [self._group(tiles, width, block_size)
                       for (_, width), tiles in sorted(buckets.items())]

    def _group(self, tiles: list[tuple[_Tile, list[int]]], width: int, bs: int) -> _Group:
        """Index tensors and the causal mask of one group of same-shape query tiles."""
        dev = self.device
        q_len = tiles[0][0].q_len
        n_pages = (width + bs - 1) // bs
        pages: list[int] = []
        for t, own in tiles:  # page table rows, right-padded with block 0 (masked)
            n = (t.kv_len + bs - 1) // bs
            pages.extend(own[:n])
            pages.extend([0] * (n_pages - n))
        kv_len = torch.tensor([t.kv_len for t, _ in tiles])
        start = torch.tensor([t.first_row_position for t, _ in tiles])
        ar_kv = torch.arange(width)
        q_pos = start[:, None] + torch.arange(q_len)[None]
        base = (ar_kv[None, None, :] < kv_len[:, None, None]) & (
            ar_kv[None, None, :] <= q_pos[:, :, None])
        real = [range(t.row, t.row + t.n) for t, _ in tiles]
        flat = [r for rr in real for r in rr]
        contiguous = flat == list(range(flat[0], flat[0] + len(flat)))
        rows = slice(flat[0], flat[0] + len(flat)) if contiguous else torch.tensor(flat, device=dev)
        full = all(t.n == q_len for t, _ in tiles)
        slots = None if full else torch.tensor(
            [k * q_len + t.lead + j for k, (t, _) in enumerate(tiles) for j in range(t.n)],
            device=dev)
        return _Group(rows=rows, slots=slots, num_seqs=len(tiles), q_len=q_len, width=width,
                      pages=torch.tensor(pages, device=dev), q_pos=q_pos[:, :, None].to(dev),
                      base_mask=base.to(dev), span_mask=_span_mask([t for t, _ in tiles],
                                                                   q_pos, width, dev))

    def run(self, q: torch.Tensor, kv_blocks: tuple[torch.Tensor, torch.Tensor],
            spec: AttentionSpec, out: torch.Tensor,
            scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """Attention of the planned rows of q [T, Hq, Dk] over the layer's (K, V) blocks
        [P, B, Hkv, Dk|Dv] (stored K and V times `scales`: an fp8 pool's dequantisation)."""
        hq = q.shape[1]
        hkv = kv_blocks[0].shape[2]
        g = hq // hkv
        for grp in self.groups:
            s, mq = grp.num_seqs, grp.q_len
            qg = q[grp.rows]
            if grp.slots is not None:  # padded rows: zeros, their outputs dropped
                qg = q.new_zeros(s * mq, hq, q.shape[2]).index_copy_(0, grp.slots, qg)
            qg = qg.view(s, mq, hkv, g, -1)  # [S, mq, Hkv, G, D]
            qg = qg.permute(0, 2, 3, 1, 4).reshape(s, hkv, g * mq, -1)
            kg, vg = _gather(kv_blocks, grp.pages, s, grp.width, q.dtype, scales)
            mask = grp.mask(spec.window, g, q.dtype)
            if spec.softcap is None and spec.sinks is None:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=spec.scale)
            else:
                og = _explicit_attention(qg, kg, vg, mask, spec, hkv, g, mq)
            og = og.view(s, hkv, g, mq, -1).permute(0, 3, 1, 2, 4)  # [S, mq, Hkv, G, Dv]
            og = og.reshape(s * mq, hq, -1)
            out[grp.rows] = og if grp.slots is None else og.index_select(0, grp.slots)


class TiledBackend:
    """Base of the backends that run some of a step's rows as SDPA tiles: `run` attends the
    tiles' rows, then `run_rest` the rows the subclass planned otherwise. The pool is the
    LLM's; the plans are the backend's and live for one step."""

    name: str
    supports_graphs = False  # no graph_plan: every step runs eagerly

    def __init__(self, specs: list[AttentionSpec], cache: KVCache) -> None:
        self.specs = specs
        self.cache = cache
        self.tiles = SdpaTiles(cache.device)

    def run(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        spec = self.specs[layer]
        kv_blocks = self.cache.layer_kv(layer)  # K [P, B, Hkv, Dk], V [P, B, Hkv, Dv]
        out = q.new_empty(q.shape[0], q.shape[1], spec.head_dim_v)
        scales = (self.cache.k_scales[layer], self.cache.v_scales[layer])
        self.tiles.run(q, kv_blocks, spec, out, scales)
        self.run_rest(layer, q, kv_blocks, spec, out, scales)
        return out

    def run_rest(self, layer: int, q: torch.Tensor,
                 kv_blocks: tuple[torch.Tensor, torch.Tensor],
                 spec: AttentionSpec, out: torch.Tensor, scales: tuple[float, float]) -> None:
        """Attend the rows the tiles do not cover, into `out` (K, V stored / `scales`)."""


def _span_mask(tiles: list[_Tile], q_pos: torch.Tensor, width: int, dev: torch.device
               ) -> torch.Tensor | None:
    """[S, q_len, width]: query and key in the same bidirectional image (None: no image)."""
    if not any(t.spans for t in tiles):
        return None
    kv = torch.arange(width)
    out = torch.zeros(len(tiles), q_pos.shape[1], width, dtype=torch.bool)
    for k, t in enumerate(tiles):
        for s, e in t.spans:
            out[k] |= (((q_pos[k] >= s) & (q_pos[k] < e))[:, None]
                       & ((kv >= s) & (kv < e))[None, :])
    return out.to(dev)


def _gather(kv_blocks: tuple[torch.Tensor, torch.Tensor], pages: torch.Tensor, s: int,
            width: int,
            dtype: torch.dtype, scales: tuple[float, float] = (1.0, 1.0)
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks of each sequence (contiguous block_size x Hkv x D rows, cheaper than
    per-slot gathers), cut to `width` keys: K and V as [S, Hkv, width, D] in the compute dtype,
    dequantised by `scales`."""
    hkv, d, dv = kv_blocks[0].shape[2], kv_blocks[0].shape[3], kv_blocks[1].shape[3]
    k = kv_blocks[0].index_select(0, pages).view(s, -1, hkv, d)[:, :width].transpose(1, 2)
    v = kv_blocks[1].index_select(0, pages).view(s, -1, hkv, dv)[:, :width].transpose(1, 2)
    return dequantize(k, dtype, scales[0]), dequantize(v, dtype, scales[1])


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Stored K or V in the compute dtype: cast, then times the layer's scale (fp8 pools)."""
    x = x.to(dtype)
    return x * scale if scale != 1.0 else x


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        spec: AttentionSpec, hkv: int, g: int, mq: int) -> torch.Tensor:
    """Softmax attention with Gemma-2 logit softcap and GPT-OSS sinks, as HF's eager path;
    `mask` is additive (0 / -inf)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores + mask
    if spec.sinks is not None:
        s = scores.shape[0]
        sink = spec.sinks.to(scores.dtype).view(1, hkv, g, 1, 1).expand(s, hkv, g, mq, 1)
        scores = torch.cat([scores, sink.reshape(s, hkv, g * mq, 1)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(v.dtype), v)

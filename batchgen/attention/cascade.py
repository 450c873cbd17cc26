"""Cascade decode attention over shared KV blocks in the torch backend.

Decode rows whose block tables start with the same physical blocks (forked samples and beams,
requests that hit the same cached prefix) share those blocks. Instead of gathering them once
per row, the shared prefix is attended once for all rows of a group (level 0) and each row's
own tail separately (level 1); the two partial softmaxes are merged exactly through their
log-sum-exp. This is FlashInfer's two-level cascade, written with plain matmuls. Sharing is
read off the block tables alone, so the metadata stays FlashInfer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.attention.sdpa import dequantize
from batchgen.attention.spec import AttentionSpec

_NEG_INF = float("-inf")


@dataclass
class Cascade:
    """All cascade groups of one step: Gc groups of up to N siblings (padded), each with a
    shared prefix of P_g keys, and R = sum of siblings rows with private tails."""

    rows: torch.Tensor  # [R] packed rows of the siblings, group by group
    member: torch.Tensor  # [Gc * N] bool: which padded (group, sibling) slots are real
    q_index: torch.Tensor  # [Gc, N] packed row of each slot (pads → the group's first row)
    prefix_pages: torch.Tensor  # [Gc * Cmax] shared blocks of each group; pads → block 0
    prefix_len: torch.Tensor  # [Gc, 1, 1] shared keys P_g
    tail_pages: torch.Tensor  # [R * Tmax] each sibling's own blocks after the prefix
    tail_len: torch.Tensor  # [R, 1, 1] keys after the prefix, the row's own token included
    q_pos: torch.Tensor  # [R] position of each sibling's query
    group_of_row: torch.Tensor  # [R] cascade group of each row
    block_size: int
    masks: dict[tuple[int | None, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)

    def mask(self, window: int | None, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive masks for the prefix [Gc, 1, N*g, Pmax] (each sibling's row repeated for
        its g query heads) and the tails [R, 1, 1, Tmax]; built once per step."""
        if (window, g) not in self.masks:
            gc, n = self.q_index.shape
            pmax = self.prefix_pages.numel() // gc * self.block_size
            tmax = self.tail_pages.numel() // self.rows.numel() * self.block_size
            kp = torch.arange(pmax, device=self.rows.device)
            kt = torch.arange(tmax, device=self.rows.device)
            ok_p = (kp[None, None, :] < self.prefix_len).expand(gc, n, pmax).clone()
            ok_t = kt[None, None, :] < self.tail_len  # [R, 1, Tmax]
            if window is not None:
                lo = torch.full((gc * n,), -1, dtype=torch.long, device=self.rows.device)
                lo[self.member] = self.q_pos - window  # keys must be > q_pos - window
                ok_p &= kp[None, None, :] > lo.view(gc, n, 1)
                start = self.prefix_len.view(-1)[self.group_of_row]
                ok_t = ok_t & ((start[:, None, None] + kt) > (self.q_pos - window)[:, None, None])
            ok_p |= ~self.member.view(gc, n, 1) & (kp == 0)  # padded slots: no all -inf row
            prefix = _additive(ok_p)[:, None].repeat_interleave(g, dim=2)
            self.masks[(window, g)] = (prefix, _additive(ok_t)[:, None])
        return self.masks[(window, g)]


def _additive(ok: torch.Tensor) -> torch.Tensor:
    return torch.zeros(ok.shape, device=ok.device).masked_fill_(~ok, _NEG_INF)


def plan_cascades(qo: list[int], kv_lens: list[int], pages: list[list[int]], bs: int,
                  device: torch.device) -> tuple[Cascade | None, set[int]]:
    """Group decode rows by their first physical block and find each group's common full
    blocks. Returns the step's Cascade (None if no rows share a block) and the sequences it
    covers."""
    groups: dict[int, list[int]] = {}
    for i, own in enumerate(pages):
        if qo[i + 1] - qo[i] == 1 and len(own) > 1:
            groups.setdefault(own[0], []).append(i)
    plans = []
    for members in groups.values():
        if len(members) < 2:
            continue
        c = min(len(pages[i]) - 1 for i in members)  # never a row's own (last) block
        first = pages[members[0]]
        for i in members[1:]:
            other = pages[i]
            c = next((j for j in range(c) if other[j] != first[j]), c)
        if c > 0:
            plans.append((members, c))
    if not plans:
        return None, set()
    nmax = max(len(m) for m, _ in plans)
    cmax = max(c for _, c in plans)
    tmax = max(len(pages[i]) - c for m, c in plans for i in m)
    rows, member, q_index, prefix_pages, prefix_len = [], [], [], [], []
    tail_pages, tail_len, q_pos, group_of_row = [], [], [], []
    for g, (members, c) in enumerate(plans):
        prefix_pages.extend(pages[members[0]][:c] + [0] * (cmax - c))
        prefix_len.append(c * bs)
        for i in members:
            rows.append(qo[i])
            own = pages[i][c:]
            tail_pages.extend(own + [0] * (tmax - len(own)))
            tail_len.append(kv_lens[i] - c * bs)
            q_pos.append(kv_lens[i] - 1)
            group_of_row.append(g)
        pad = nmax - len(members)
        member.extend([True] * len(members) + [False] * pad)
        q_index.append([qo[i] for i in members] + [qo[members[0]]] * pad)

    def t(x: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    cascade = Cascade(
        rows=t(rows), member=t(member, torch.bool), q_index=t(q_index),
        prefix_pages=t(prefix_pages), prefix_len=t(prefix_len).view(-1, 1, 1),
        tail_pages=t(tail_pages), tail_len=t(tail_len).view(-1, 1, 1), q_pos=t(q_pos),
        group_of_row=t(group_of_row), block_size=bs)
    return cascade, {i for m, _ in plans for i in m}


def run_cascade(c: Cascade, q: torch.Tensor, kv_blocks: tuple[torch.Tensor, torch.Tensor],
                spec: AttentionSpec, out: torch.Tensor,
                scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Attention of the siblings' queries over the layer's (K, V) blocks [P, B, Hkv, Dk|Dv]:
    shared prefix once per group, tails per row, merged by log-sum-exp; writes their rows of
    `out` [T, Hq, Dv]."""
    _, bs, hkv, d = kv_blocks[0].shape
    dv = kv_blocks[1].shape[-1]
    hq = q.shape[1]
    g = hq // hkv
    gc, n = c.q_index.shape
    scale, softcap, sinks = spec.scale, spec.softcap, spec.sinks
    mask_a, mask_t = c.mask(spec.window, g)
    # level 0: [Gc, Hkv, N*G, D] queries against each group's prefix [Gc, Hkv, Pmax, D]
    qa = q[c.q_index].view(gc, n, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(gc, hkv, n * g, d)
    ka = kv_blocks[0].index_select(0, c.prefix_pages).view(gc, -1, hkv, d).transpose(1, 2)
    va = kv_blocks[1].index_select(0, c.prefix_pages).view(gc, -1, hkv, dv).transpose(1, 2)
    ks, vs = scales
    oa, la = _partial(qa, dequantize(ka, q.dtype, ks), dequantize(va, q.dtype, vs), mask_a,
                      scale, softcap)
    oa = oa.view(gc, hkv, n, g, -1).permute(0, 2, 1, 3, 4).reshape(gc * n, hkv, g, -1)[c.member]
    la = la.view(gc, hkv, n, g).permute(0, 2, 1, 3).reshape(gc * n, hkv, g)[c.member]
    # level 1: each row's own tail [R, Hkv, Tmax, D]
    r = c.rows.numel()
    qb = q[c.rows].view(r, hkv, g, d)
    kb = kv_blocks[0].index_select(0, c.tail_pages).view(r, -1, hkv, d).transpose(1, 2)
    vb = kv_blocks[1].index_select(0, c.tail_pages).view(r, -1, hkv, dv).transpose(1, 2)
    ob, lb = _partial(qb, dequantize(kb, q.dtype, ks), dequantize(vb, q.dtype, vs), mask_t,
                      scale, softcap)
    lse = torch.logaddexp(la, lb)
    o = oa * torch.exp(la - lse)[..., None] + ob * torch.exp(lb - lse)[..., None]
    if sinks is not None:  # one more logit in the denominator, no value
        total = torch.logaddexp(lse, sinks.float().view(1, hkv, g))
        o = o * torch.exp(lse - total)[..., None]
    out[c.rows] = o.reshape(r, hq, -1).to(out.dtype)


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
             scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised attention over a subset of keys and its log-sum-exp (float32)."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    # a row whose keys are all masked (a sliding window past the prefix) contributes nothing
    p = torch.exp(s - lse.clamp_min(torch.finfo(lse.dtype).min)[..., None])
    return torch.matmul(p, v.float()), lse

"""StepInputs: the model runner's persistent step buffers, sized once at start-up and refilled in
place every step (pinned host memory plus device copies on CUDA, one set on the CPU).

`prepare` packs the scheduled rows into one ragged batch: token ids, positions, the slot
mapping for the KV writes, the logits rows to keep and the attention metadata. Row order and
padding are decided here, not by the engine: a step with longer queries has its rows sorted
by (query length, cached length) so that a backend's same-shape rows are contiguous (a
decode-only step keeps the scheduler's order: every row has the same shape), and on the CPU a
step's tokens are padded up to a multiple of `min_rows` (its logits rows up to `min_rows`)
with one-token dummies in the scratch block: small-M CPU GEMMs round differently, and so do the scalar tails of elementwise
kernels (a T x 688 activation ends mid-vector for odd T), so padding keeps every row's result
independent of its batch.

A step with more rows or pages than the buffers were sized for (a beam group wider than
max_num_seqs decodes its beams in one step) is packed into a second, wider set made when first
needed and kept; the first set stays where CUDA graphs captured its addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.attention.metadata import StepMetadata, StepRows
from batchgen.kv.block_manager import slot_of

_LONG = ("input_ids", "positions", "slot_mapping", "logits_indices")  # model inputs, int64
_DEVICE = (*_LONG, "kv_indices")  # copied to the device each step (on CUDA)
_INT = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")  # metadata, int32


@dataclass
class StepBatch:
    """One step's inputs: views into the persistent buffers, valid until the next prepare()."""

    input_ids: torch.Tensor  # [T] int64, model device
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written
    logits_indices: torch.Tensor  # [R'] int64: packed rows whose logits are kept (padded)
    num_logits: int  # R: the real logits rows, one per chunk that wants logits, chunk order
    meta: StepMetadata  # host int32, FlashInfer's format
    order: np.ndarray | None = None  # [S] the step rows' indices in packed order


class _Buffers:
    """One set of step buffers: pinned host tensors (numpy views of them) and, on CUDA, their
    device copies."""

    def __init__(self, sizes: dict[str, int], device: torch.device) -> None:
        self.sizes = sizes
        pin = device.type == "cuda"
        self.host = {k: torch.zeros(n, dtype=torch.long if k in _LONG else torch.int32,
                                    pin_memory=pin) for k, n in sizes.items()}
        self.np = {k: t.numpy() for k, t in self.host.items()}
        self.dev = ({k: torch.zeros_like(self.host[k], device=device) for k in _DEVICE}
                    if pin else self.host)

    @property
    def limits(self) -> tuple[int, int, int, int]:
        """The largest step it holds: (tokens, rows, pages, logits rows), padding included."""
        z = self.sizes
        return z["input_ids"], z["qo_indptr"] - 1, z["kv_indices"], z["logits_indices"]


def _sizes(max_tokens: int, max_seqs: int, max_pages: int, min_rows: int) -> dict[str, int]:
    """Each buffer's length for steps of up to these sizes (plus `min_rows` of padding)."""
    sizes = {"input_ids": max(max_tokens, min_rows) + min_rows,
             # one logits row per sequence, or per prompt position with prompt logprobs
             "logits_indices": max(max_tokens, max_seqs, min_rows) + min_rows,
             "qo_indptr": max_seqs + min_rows + 1, "kv_indptr": max_seqs + min_rows + 1,
             "kv_indices": max_pages + min_rows, "kv_last_page_len": max_seqs + min_rows}
    sizes["positions"] = sizes["slot_mapping"] = sizes["input_ids"]
    return sizes


class StepInputs:
    """Owns the step buffers; nothing else writes them."""

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, block_size: int,
                 scratch_block: int, min_rows: int, device: torch.device) -> None:
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.min_rows = min_rows
        self.device = device
        self.main = _Buffers(_sizes(max_tokens, max_seqs, max_pages, min_rows), device)
        self._main_limits = self.main.limits  # compared every step, without a call
        self.wide: _Buffers | None = None  # steps past `main` (made when first needed)
        self.last = self.main  # the set the last prepared step was packed into

    def _wide(self, tokens: int, rows: int, pages: int, logits: int) -> _Buffers:
        """The set for a step past `main`, (re)made at twice what it needs when the last one
        made does not hold it either."""
        w = self.wide
        if w is None or any(n > m for n, m in zip((tokens, rows, pages, logits), w.limits)):
            self.wide = w = _Buffers(_sizes(2 * tokens, 2 * rows, 2 * pages, self.min_rows),
                                     self.device)
        return w

    def prepare(self, rows: StepRows, pad_to: int | None = None, pad: bool = True
                ) -> StepBatch:
        """Pack the step's rows; the logits rows are each row's last `num_logits` positions,
        row by row in the given order. `pad_to`: exactly this many rows (a decode step
        replaying a CUDA graph captured for that batch size); else a multiple of `min_rows`
        (none when it is 0, or `pad` is off: one sequence's chunk for a state mixer, which
        must see no dummy token). Vector ops only: no Python per row or per page."""
        bs, n_new, starts = self.block_size, rows.num_new, rows.starts
        if len(rows.token_ids) == rows.num_rows:  # decode only: the rows as they come
            return self._decode(rows, pad_to, pad)
        order = np.lexsort((starts, n_new))  # by (query length, cached length), stable
        n_o, s_o = n_new[order], starts[order]
        pages_o = (s_o + n_o + bs - 1) // bs
        qo = np.concatenate(([0], np.cumsum(n_o)))
        kv = np.concatenate(([0], np.cumsum(pages_o)))
        width = int(pages_o.max()) if len(pages_o) else 0
        tables = rows.block_tables[rows.slots[order], :width]
        pages = tables[np.arange(width)[None, :] < pages_o[:, None]]
        t = int(qo[-1])
        if np.all(n_new == 1):
            ids = rows.token_ids[order]
        else:  # each row's query tokens, moved to its packed position
            first = np.concatenate(([0], np.cumsum(n_new)))[:-1][order]
            ids = rows.token_ids[np.repeat(first - qo[:-1], n_o) + np.arange(t)]
        last_row = np.empty(len(order), np.int64)
        last_row[order] = qo[1:] - 1
        logits = _logits_rows(last_row, rows.num_logits)
        batch = self._pad(ids, pages, qo, kv, s_o, n_o, logits, pad_to, pad)
        batch.order = order
        return batch

    def _decode(self, rows: StepRows, pad_to: int | None, pad: bool = True) -> StepBatch:
        """`prepare` for a step of one token per row (the common step): no reordering."""
        starts, n = rows.starts, rows.num_rows
        pages_n = starts // self.block_size + 1
        kv = np.concatenate(([0], np.cumsum(pages_n)))
        width = int(pages_n.max())
        tables = rows.block_tables[rows.slots, :width]
        pages = tables[np.arange(width)[None, :] < pages_n[:, None]]
        logits = np.flatnonzero(rows.num_logits)
        batch = self._pad(rows.token_ids, pages, np.arange(n + 1), kv, starts,
                          np.ones(n, np.int64), logits, pad_to, pad)
        batch.order = np.arange(n)
        return batch

    def _pad(self, ids: np.ndarray, pages: np.ndarray, qo: np.ndarray, kv: np.ndarray,
             starts: np.ndarray, lens: np.ndarray, logits: np.ndarray, pad_to: int | None,
             pad_rows: bool = True) -> StepBatch:
        """Pad with one-token dummy rows in the scratch block (to `pad_to` rows, or on the CPU
        to a multiple of `min_rows` tokens) and the logits rows up to that many, then fill."""
        num_logits, t = len(logits), int(qo[-1])
        if pad_to is not None:
            rows = pad_to
        elif self.min_rows and pad_rows:  # CPU: a multiple of min_rows (elementwise kernels' tails)
            rows = max(self.min_rows, -(-t // self.min_rows) * self.min_rows)
        else:
            rows = 0
        pad = rows - t
        if pad > 0:
            step = np.arange(1, pad + 1)
            ids = np.concatenate((ids, np.zeros(pad, np.int64)))
            pages = np.concatenate((pages, np.full(pad, self.scratch_block, pages.dtype)))
            qo = np.concatenate((qo, qo[-1] + step))
            kv = np.concatenate((kv, kv[-1] + step))
            starts = np.concatenate((starts, np.zeros(pad, np.int64)))
            lens = np.concatenate((lens, np.ones(pad, np.int64)))
        logit_rows = (self.min_rows if pad_rows else 0) if pad_to is None else pad_to
        if 0 < num_logits < logit_rows:
            logits = np.concatenate((logits, np.full(logit_rows - num_logits, logits[-1])))
        return self._fill(ids, pages, qo, kv, starts, lens, logits, num_logits)

    def _fill(self, ids: np.ndarray, pages: np.ndarray, qo: np.ndarray, kv: np.ndarray,
              starts: np.ndarray, lens: np.ndarray, logits: np.ndarray, num_logits: int
              ) -> StepBatch:
        """Write the packed arrays into the buffers; positions, slots and last-page lengths are
        computed vectorised."""
        t, s, p, r = len(ids), len(starts), len(pages), len(logits)
        lim = self._main_limits
        buf = (self.main if t <= lim[0] and s <= lim[1] and p <= lim[2] and r <= lim[3]
               else self._wide(t, s, p, r))
        self.last = buf
        bs, a = self.block_size, buf.np
        a["input_ids"][:t] = ids
        a["qo_indptr"][:s + 1] = qo
        a["kv_indptr"][:s + 1] = kv
        a["kv_indices"][:p] = pages
        a["logits_indices"][:r] = logits
        qo_a, kv_a = a["qo_indptr"][:s + 1], a["kv_indptr"][:s + 1]
        pos = a["positions"][:t]
        np.subtract(np.arange(t), np.repeat(qo_a[:-1] - starts, lens), out=pos)
        # a virtual position kv_indptr[i] * B + pos indexes the step's flat page list
        a["slot_mapping"][:t] = slot_of(a["kv_indices"], np.repeat(kv_a[:-1], lens) * bs + pos,
                                        bs)
        a["kv_last_page_len"][:s] = starts + lens - (np.diff(kv_a) - 1) * bs
        h, d = buf.host, buf.dev
        if d is not h:
            for k, n in (("input_ids", t), ("positions", t), ("slot_mapping", t),
                         ("logits_indices", r), ("kv_indices", p)):
                d[k][:n].copy_(h[k][:n], non_blocking=True)
        meta = StepMetadata(h["qo_indptr"][:s + 1], h["kv_indptr"][:s + 1],
                            h["kv_indices"][:p], h["kv_last_page_len"][:s], bs,
                            d["kv_indices"][:p])
        return StepBatch(d["input_ids"][:t], d["positions"][:t], d["slot_mapping"][:t],
                         d["logits_indices"][:r], num_logits, meta)

    def host_positions(self, t: int) -> np.ndarray:
        """The last prepared step's first `t` positions on the host (padding included)."""
        return self.last.np["positions"][:t]


def _logits_rows(last_row: np.ndarray, num_logits: np.ndarray) -> np.ndarray:
    """Each row's last `num_logits[i]` packed positions, row by row (in the given order)."""
    if np.all(num_logits <= 1):
        return last_row[num_logits == 1]
    k = num_logits[num_logits > 0]
    ends = last_row[num_logits > 0]
    offsets = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
    return np.repeat(ends - k + 1, k) + offsets

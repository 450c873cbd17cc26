"""StepInputs: the model runner's persistent step buffers, sized once at start-up and refilled in
place every step (pinned host memory plus device copies on CUDA, one set on the CPU).

`prepare` packs the scheduled chunks into one ragged batch: token ids, positions, the slot
mapping for the KV writes, the logits rows to keep and the attention metadata. Row order and
padding are decided here, not by the engine: rows are sorted by (query length, cached length)
so that a backend's same-shape rows are contiguous, and on the CPU a step's tokens are padded
up to a multiple of `min_rows` (its logits rows up to `min_rows`) with one-token dummies in the
scratch block: small-M CPU GEMMs round differently, and so do the scalar tails of elementwise
kernels (a T x 688 activation ends mid-vector for odd T), so padding keeps every row's result
independent of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.attention.metadata import SeqChunk, StepMetadata
from batchgen.kv.block_manager import blocks_for, slot_of

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


class StepInputs:
    """Owns the step buffers; nothing else writes them."""

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, block_size: int,
                 scratch_block: int, min_rows: int, device: torch.device) -> None:
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.min_rows = min_rows
        self.device = device
        sizes = {"input_ids": max(max_tokens, min_rows) + min_rows,
                 "logits_indices": max(max_seqs, min_rows),
                 "qo_indptr": max_seqs + min_rows + 1, "kv_indptr": max_seqs + min_rows + 1,
                 "kv_indices": max_pages + min_rows, "kv_last_page_len": max_seqs + min_rows}
        sizes["positions"] = sizes["slot_mapping"] = sizes["input_ids"]
        pin = device.type == "cuda"
        self.host = {k: torch.zeros(n, dtype=torch.long if k in _LONG else torch.int32,
                                    pin_memory=pin) for k, n in sizes.items()}
        self.np = {k: t.numpy() for k, t in self.host.items()}
        self.dev = ({k: torch.zeros_like(self.host[k], device=device) for k in _DEVICE}
                    if pin else self.host)

    def prepare(self, chunks: list[SeqChunk], pad_to: int | None = None) -> StepBatch:
        """Pack the chunks; the logits rows are each chunk's last `num_logits` positions, chunk
        by chunk in the given order. `pad_to`: exactly this many rows (a decode step replaying a CUDA graph
        captured for that batch size); else a multiple of `min_rows` (none when it is 0)."""
        bs = self.block_size
        order = sorted(range(len(chunks)),
                       key=lambda i: (len(chunks[i].token_ids), chunks[i].num_computed))
        ids: list[int] = []
        pages: list[int] = []
        qo, kv, starts, lens = [0], [0], [], []
        last_row = [0] * len(chunks)
        for i in order:
            c = chunks[i]
            n, start = len(c.token_ids), c.num_computed
            num_pages = blocks_for(start + n, bs)
            ids += c.token_ids
            table = c.block_table
            pages += table if len(table) == num_pages else table[:num_pages]
            qo.append(qo[-1] + n)
            kv.append(kv[-1] + num_pages)
            starts.append(start)
            lens.append(n)
            last_row[i] = qo[-1] - 1
        logits = [r for i, c in enumerate(chunks)
                  for r in range(last_row[i] - c.num_logits + 1, last_row[i] + 1)]
        num_logits = len(logits)
        if pad_to is not None:
            rows = pad_to
        elif self.min_rows:  # CPU: a multiple of min_rows (elementwise kernels' tails)
            rows = max(self.min_rows, -(-qo[-1] // self.min_rows) * self.min_rows)
        else:
            rows = 0
        pad = rows - qo[-1]
        if pad > 0:  # one-token dummy sequences writing into the scratch block
            ids += [0] * pad
            pages += [self.scratch_block] * pad
            qo += range(qo[-1] + 1, qo[-1] + pad + 1)
            kv += range(kv[-1] + 1, kv[-1] + pad + 1)
            starts += [0] * pad
            lens += [1] * pad
        logit_rows = self.min_rows if pad_to is None else pad_to
        if 0 < num_logits < logit_rows:
            logits += [logits[-1]] * (logit_rows - num_logits)
        return self._fill(ids, pages, qo, kv, starts, lens, logits, num_logits)

    def _fill(self, ids: list[int], pages: list[int], qo: list[int], kv: list[int],
              starts: list[int], lens: list[int], logits: list[int], num_logits: int
              ) -> StepBatch:
        """Write the packed lists into the buffers; positions, slots and last-page lengths are
        computed vectorised."""
        bs, a = self.block_size, self.np
        t, s, p, r = len(ids), len(starts), len(pages), len(logits)
        a["input_ids"][:t] = ids
        a["qo_indptr"][:s + 1] = qo
        a["kv_indptr"][:s + 1] = kv
        a["kv_indices"][:p] = pages
        a["logits_indices"][:r] = logits
        lens_a = np.asarray(lens)
        starts_a = np.asarray(starts)
        qo_a, kv_a = a["qo_indptr"][:s + 1], a["kv_indptr"][:s + 1]
        pos = a["positions"][:t]
        np.subtract(np.arange(t), np.repeat(qo_a[:-1] - starts_a, lens_a), out=pos)
        # a virtual position kv_indptr[i] * B + pos indexes the step's flat page list
        a["slot_mapping"][:t] = slot_of(a["kv_indices"], np.repeat(kv_a[:-1], lens_a) * bs + pos,
                                        bs)
        a["kv_last_page_len"][:s] = starts_a + lens_a - (np.diff(kv_a) - 1) * bs
        h, d = self.host, self.dev
        if d is not h:
            for k, n in (("input_ids", t), ("positions", t), ("slot_mapping", t),
                         ("logits_indices", r), ("kv_indices", p)):
                d[k][:n].copy_(h[k][:n], non_blocking=True)
        meta = StepMetadata(h["qo_indptr"][:s + 1], h["kv_indptr"][:s + 1],
                            h["kv_indices"][:p], h["kv_last_page_len"][:s], bs,
                            d["kv_indices"][:p])
        return StepBatch(d["input_ids"][:t], d["positions"][:t], d["slot_mapping"][:t],
                         d["logits_indices"][:r], num_logits, meta)

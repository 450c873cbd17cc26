"""StepMetadata: what one engine step tells every attention layer, in FlashInfer's format.

Both backends consume the same tensors, so the CPU tests exercise exactly the bookkeeping that
FlashInfer receives on a GPU. Built once per step on the host from the block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqChunk:
    """One sequence's share of a step: `num_new` query tokens starting at `num_computed`."""

    block_table: list[int]
    num_computed: int  # tokens already in the cache before this step
    num_new: int  # query tokens this step (1 = decode)
    want_logits: int  # rows of logits to keep for this sequence (0 mid-prefill, n for a fork)


@dataclass
class StepMetadata:
    """Ragged batch description (int32 everywhere, FlashInfer's names).

    qo_indptr [S+1]        query tokens of sequence i are rows qo_indptr[i]:qo_indptr[i+1]
    kv_indptr [S+1]        its pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices [pages]     physical block ids, global to the pool
    kv_last_page_len [S]   tokens in the last page (1..block_size), after this step's write
    slot_mapping [T]       flat pool slot where each new token's K/V is written
    positions [T]          position id of each new token
    logits_indices [R]     rows of the packed batch whose logits are kept (duplicates allowed)
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    block_size: int
    max_q_len: int
    max_kv_len: int
    num_logits: int = -1  # real rows of logits_indices; the rest pad the lm_head batch

    def __post_init__(self) -> None:
        if self.num_logits < 0:
            self.num_logits = self.logits_indices.numel()

    @property
    def num_seqs(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    def kv_lens(self) -> torch.Tensor:
        """KV length of each sequence after this step: (pages - 1) * block_size + last_page_len."""
        pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (pages - 1) * self.block_size + self.kv_last_page_len

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int, min_rows: int = 0,
              scratch_block: int | None = None) -> StepMetadata:
        """Turn host-side block tables into the step tensors (one pass over the sequences).

        With `min_rows`, a step of fewer tokens is padded with one-token dummy sequences in
        `scratch_block` and the kept logits rows are padded likewise: CPU GEMM kernels round
        differently for a handful of rows, so padding keeps every row's result independent of
        the batch (batch invariance; prefix caching on and off give bit-identical outputs)."""
        num_tokens = sum(c.num_new for c in chunks)
        if num_tokens < min_rows:
            if scratch_block is None:
                raise ValueError("min_rows needs a scratch_block for the padding tokens")
            chunks = chunks + [SeqChunk([scratch_block], 0, 1, 0)] * (min_rows - num_tokens)
        qo, kv, last = [0], [0], []
        indices: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        logits: list[int] = []
        max_q = max_kv = 0
        bs = block_size
        for c in chunks:
            start, end = c.num_computed, c.num_computed + c.num_new
            n_pages = (end + bs - 1) // bs
            table = c.block_table
            if c.num_new == 1:  # decode: one slot, no range objects
                slots.append(table[start // bs] * bs + start % bs)
                positions.append(start)
            else:
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            indices.extend(table[:n_pages])
            qo.append(qo[-1] + c.num_new)
            kv.append(kv[-1] + n_pages)
            last.append(end - (n_pages - 1) * bs)
            if c.want_logits:
                logits.extend([qo[-1] - 1] * c.want_logits)
            max_q = max(max_q, c.num_new)
            max_kv = max(max_kv, end)

        def i32(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32)

        num_logits = len(logits)
        if 0 < num_logits < min_rows:
            logits.extend([logits[-1]] * (min_rows - num_logits))
        return cls(qo_indptr=i32(qo), kv_indptr=i32(kv), kv_indices=i32(indices),
                   kv_last_page_len=i32(last), slot_mapping=i32(slots),
                   positions=i32(positions), logits_indices=i32(logits), block_size=block_size,
                   max_q_len=max_q, max_kv_len=max_kv, num_logits=num_logits)

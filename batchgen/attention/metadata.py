"""StepMetadata: what one engine step tells every attention layer, in FlashInfer's format.

Every backend consumes the same tensors, so the CPU tests exercise exactly the bookkeeping that
FlashInfer receives on a GPU. The model runner fills them once per step (model/inputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.multimodal.items import MMPrompt
from batchgen.state.slots import StateOps


@dataclass
class StepRows:
    """One step's work as the engine hands it to the runner (engine/layout.py), one entry per
    row (a scheduled sequence): its row of `block_tables`, the tokens it has cached (`starts`),
    its query length and how many of its last positions' logits to keep; `token_ids` holds
    every row's query tokens, row after row. The arrays are the step plan's and the layout's;
    `block_tables` is the persistent batch's (read only here)."""

    slots: np.ndarray  # [R] int64: rows of block_tables
    starts: np.ndarray  # [R] int64
    num_new: np.ndarray  # [R] int64
    num_logits: np.ndarray  # [R] int64: 1 where the row's last logits are sampled, all of a
    # prompt chunk's for prompt logprobs, else 0
    token_ids: np.ndarray  # [sum(num_new)] int64
    block_tables: np.ndarray  # [slots, max_blocks] int32
    # models with state mixers: each row's state slot, and the state moves to make before
    # the forward (swaps, forks, beams); None without state
    state_slots: np.ndarray | None = None
    state_ops: StateOps | None = None
    # vision-language models: the image side of each row whose chunk covers prompt tokens
    # (row index -> its request's MMPrompt), and each row's M-RoPE decode delta
    images: dict[int, MMPrompt] | None = None
    rope_delta: np.ndarray | None = None
    adapters: np.ndarray | None = None  # [R] each row's LoRA slot (batchgen/lora), None: none

    @property
    def num_rows(self) -> int:
        return len(self.slots)

    @classmethod
    def from_chunks(cls, chunks: list[SeqChunk]) -> StepRows:
        """The rows of explicit chunks (each with its own block table): for tests, and for the
        dummy rows of CUDA-graph capture."""
        width = max([len(c.block_table) for c in chunks] + [1])
        tables = np.zeros((max(len(chunks), 1), width), np.int32)
        for i, c in enumerate(chunks):
            tables[i, :len(c.block_table)] = c.block_table
        ids = [t for c in chunks for t in c.token_ids]
        return cls(np.arange(len(chunks), dtype=np.int64),
                   np.array([c.num_computed for c in chunks], np.int64),
                   np.array([c.num_new for c in chunks], np.int64),
                   np.array([c.num_logits for c in chunks], np.int64),
                   np.array(ids, np.int64), tables)


@dataclass
class SeqChunk:
    """One sequence's share of a step written out in full (tests and graph capture build
    steps this way; the engine hands the runner StepRows)."""

    token_ids: list[int]  # the query tokens of this step (1 while decoding)
    block_table: list[int]  # covers every position up to num_computed + len(token_ids)
    num_computed: int  # tokens already in the cache before this step
    # logits kept for the chunk's last num_logits positions: 1 where the chunk ends the
    # sequence's known tokens (its last row is sampled), all of them for prompt logprobs, else 0
    num_logits: int

    @property
    def num_new(self) -> int:
        return len(self.token_ids)


@dataclass
class StepMetadata:
    """Ragged batch description (host int32 tensors, FlashInfer's names).

    qo_indptr [S+1]        query tokens of sequence i are rows qo_indptr[i]:qo_indptr[i+1]
    kv_indptr [S+1]        its pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices [pages]     physical block ids, global to the pool
    kv_last_page_len [S]   tokens in the last page (1..block_size), after this step's write
    kv_indices_device      the same page ids on the model's device (what FlashInfer plans on)
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    block_size: int
    kv_indices_device: torch.Tensor | None = None
    # bidirectional images (Gemma 3): sequence i's [start, end) positions whose queries
    # attend every key of their image, for the sequences that have any (None: causal)
    spans: dict[int, list[tuple[int, int]]] | None = None

    def __post_init__(self) -> None:
        if self.kv_indices_device is None:
            self.kv_indices_device = self.kv_indices

    @property
    def num_seqs(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    def kv_lens(self) -> torch.Tensor:
        """KV length of each sequence after this step: (pages - 1) * block_size + last_page_len."""
        pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (pages - 1) * self.block_size + self.kv_last_page_len

    def span_mask(self) -> torch.Tensor | None:
        """FlashInfer's `custom_mask` for a step with bidirectional images: every sequence's
        [qo_len, kv_len] boolean mask, row-major, concatenated (causal, widened to the whole
        image for queries inside one; the layer's window still applies on top, as in HF's
        Gemma 3), on the pages' device; None without images."""
        if not self.spans:
            return None
        qo = self.qo_indptr.tolist()
        parts = []
        for i, kv_len in enumerate(self.kv_lens().tolist()):
            q = torch.arange(kv_len - (qo[i + 1] - qo[i]), kv_len)[:, None]
            k = torch.arange(kv_len)[None, :]
            m = k <= q
            for s, e in self.spans.get(i, ()):
                m |= (q >= s) & (q < e) & (k >= s) & (k < e)
            parts.append(m.reshape(-1))
        device = self.kv_indices_device.device if self.kv_indices_device is not None else None
        return torch.cat(parts).to(device)

    def as_lists(self) -> tuple[list[int], list[int], list[list[int]]]:
        """(qo_indptr, kv_lens, pages of each sequence) as Python lists, for host-side plans."""
        qo = self.qo_indptr.tolist()
        ptr = self.kv_indptr.tolist()
        indices = self.kv_indices.tolist()
        kv_lens = self.kv_lens().tolist()
        return qo, kv_lens, [indices[ptr[i]:ptr[i + 1]] for i in range(len(kv_lens))]

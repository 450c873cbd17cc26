"""The CPU kernel backend ("cpu_kernel"): decode rows through the compiled C kernel, which
reads each sequence's blocks in place over its exact length; prefill rows through SDPA.

Rows sharing blocks need no cascade here: re-reading a shared block from cache is cheaper than
the cascade's gathers, and every row keeps the bits it would have alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.attention.cpu_kernel import PagedDecodeKernel
from batchgen.attention.metadata import StepMetadata
from batchgen.attention.sdpa import TiledBackend
from batchgen.attention.spec import AttentionSpec
from batchgen.kv.cache import KVCache


@dataclass
class _KernelRows:
    """Decode rows handed to the kernel: their packed rows and page tables (int32)."""

    rows: slice | torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor


class CpuKernelBackend(TiledBackend):
    """Kernel for decode rows, SDPA tiles for the rest. The kernel is loaded once per process
    (cpu_kernel.load)."""

    name = "cpu_kernel"

    def __init__(self, specs: list[AttentionSpec], cache: KVCache,
                 kernel: PagedDecodeKernel) -> None:
        super().__init__(specs, cache)
        self.kernel = kernel
        self.rows: _KernelRows | None = None
        # the C kernel reads K and V of one width: values of another go through SDPA tiles
        self.kernel_decodes = all(s.head_dim == s.head_dim_v for s in specs)

    def plan(self, meta: StepMetadata) -> None:
        """Decode rows to the kernel (vector ops over the step's page lists, no Python per row
        or page), prefill rows to SDPA tiles."""
        qo = meta.qo_indptr.numpy()
        kv_ptr = meta.kv_indptr.numpy()
        q_len = np.diff(qo)
        kv_lens = (np.diff(kv_ptr) - 1) * meta.block_size + meta.kv_last_page_len.numpy()
        decode = np.flatnonzero(q_len == 1) if self.kernel_decodes else np.zeros(0, np.int64)
        self.rows = (_kernel_rows(decode, qo, kv_ptr, meta.kv_indices, kv_lens)
                     if decode.size else None)
        prefill = np.flatnonzero((q_len > 1) | (not self.kernel_decodes)).tolist()
        pages = {i: meta.kv_indices[kv_ptr[i]:kv_ptr[i + 1]].tolist() for i in prefill}
        self.tiles.plan(qo.tolist() if prefill else [], kv_lens.tolist() if prefill else [],
                        pages, prefill, meta.block_size, meta.spans)

    def run_rest(self, layer: int, q: torch.Tensor,
                 kv_blocks: tuple[torch.Tensor, torch.Tensor],
                 spec: AttentionSpec, out: torch.Tensor, scales: tuple[float, float]) -> None:
        """Decode rows straight from the pool's blocks; the page tables are checked against
        the pool on the step's first layer (the C code trusts them). An fp8 pool's k_scale
        folds into the softmax scale, its v_scale multiplies the output."""
        kr = self.rows
        if kr is None:
            return
        qk = q[kr.rows].float().contiguous()
        direct = (isinstance(kr.rows, slice) and out.dtype == torch.float32
                  and scales[1] == 1.0)
        res = out[kr.rows] if direct else torch.empty_like(qk)
        self.kernel(qk, kv_blocks[0], kv_blocks[1], res, kr.kv_indptr, kr.kv_indices,
                    kr.kv_len, spec.scale * scales[0], spec.window, spec.softcap, spec.sinks,
                    check_tables=layer == 0)
        if not direct:
            out[kr.rows] = (res * scales[1] if scales[1] != 1.0 else res).to(out.dtype)


def _kernel_rows(seqs: np.ndarray, qo: np.ndarray, kv_ptr: np.ndarray,
                 kv_indices: torch.Tensor, kv_lens: np.ndarray) -> _KernelRows:
    """Page tables of the decode rows the kernel takes (their query rows, in order)."""
    rows = qo[seqs]
    first, count = kv_ptr[seqs], kv_ptr[seqs + 1] - kv_ptr[seqs]
    indptr = np.concatenate(([0], np.cumsum(count))).astype(np.int32)
    if seqs[-1] - seqs[0] + 1 == len(seqs):  # one run of rows: their pages are one run too
        indices = kv_indices[int(first[0]):int(first[0]) + int(indptr[-1])]
    else:
        at = np.repeat(first - indptr[:-1], count) + np.arange(int(indptr[-1]))
        indices = kv_indices[torch.from_numpy(at)]
    contiguous = rows[-1] - rows[0] + 1 == len(rows)
    return _KernelRows(
        rows=slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else torch.from_numpy(rows),
        kv_indptr=torch.from_numpy(indptr), kv_indices=indices.contiguous(),
        kv_len=torch.from_numpy(kv_lens[seqs].astype(np.int32)))

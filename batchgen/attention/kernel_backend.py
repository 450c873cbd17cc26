"""The CPU kernel backend ("cpu_kernel"): decode rows through the compiled C kernel, which
reads each sequence's blocks in place over its exact length; prefill rows through SDPA.

Rows sharing blocks need no cascade here: re-reading a shared block from cache is cheaper than
the cascade's gathers, and every row keeps the bits it would have alone.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def plan(self, meta: StepMetadata) -> None:
        qo, kv_lens, pages = meta.as_lists()
        seqs = range(len(kv_lens))
        decode = [i for i in seqs if qo[i + 1] - qo[i] == 1]
        self.rows = _kernel_rows(decode, qo, kv_lens, pages) if decode else None
        self.tiles.plan(qo, kv_lens, pages, (i for i in seqs if qo[i + 1] - qo[i] > 1),
                        meta.block_size)

    def run_rest(self, layer: int, q: torch.Tensor, kv_blocks: torch.Tensor,
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

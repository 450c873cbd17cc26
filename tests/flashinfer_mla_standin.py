"""A PyTorch stand-in for FlashInfer's MLA wrapper (`flashinfer.mla`), for CPU tests only.

Written from FlashInfer 0.7.4's `BatchMLAPagedAttentionWrapper` (mla/_batch_mla/_wrapper.py)
with the same parameter names and defaults (tests/test_flashinfer_mla.py compares them): a
plan from `MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr)` (int32, host
indptrs), causal bottom-right masks, `sm_scale`, and "packed" query [tokens, heads, ckv + kpe]
and KV cache [pages, page_size, ckv + kpe]; the output is ckv wide. It checks what the real one
checks of its caller that batchgen relies on (a plan before run, the packed widths, the planned
dtypes, `out`'s shape) and lets batchgen/attention/flashinfer_mla.py run end to end on the CPU:
evidence about our use of the API, none about FlashInfer's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MLAPlanMetadata:
    """CSR metadata, as the real `MLAPlanMetadata.csr` builds it."""

    qo_indptr: torch.Tensor | None = None
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    kv_len_arr: torch.Tensor | None = None

    @classmethod
    def csr(cls, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_len_arr: torch.Tensor) -> MLAPlanMetadata:
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


class BatchMLAPagedAttentionWrapper:
    """Plan once, run per layer: softmax(q · K^T · sm_scale, causal) · K[:, :ckv]."""

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None,
                 kv_len_arr: torch.Tensor | None = None, backend: str = "auto") -> None:
        self.workspace = float_workspace_buffer
        self.backend = backend
        self.plan_args: dict[str, Any] | None = None

    def plan(self, qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
             kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
             num_heads: int | None = None, head_dim_ckv: int | None = None,
             head_dim_kpe: int | None = None, page_size: int | None = None,
             causal: bool | None = None, sm_scale: float | None = None,
             q_data_type: torch.dtype | None = None, kv_data_type: torch.dtype | None = None,
             use_profiler: bool = False, *, metadata: MLAPlanMetadata | None = None,
             query_layout: str | None = None, kv_cache_layout: str | None = None) -> None:
        if metadata is None or qo_indptr is not None:
            raise ValueError("pass metadata=MLAPlanMetadata.csr(...)")
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"):
            t = getattr(metadata, name)
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        if (query_layout, kv_cache_layout) != ("packed", "packed"):
            raise ValueError("this stand-in reads packed query and KV cache only")
        self.plan_args = dict(meta=metadata, heads=num_heads, ckv=head_dim_ckv,
                              kpe=head_dim_kpe, page=page_size, causal=causal, scale=sm_scale,
                              q_dtype=q_data_type, kv_dtype=kv_data_type)

    def run(self, q_nope: torch.Tensor | None = None, q_pe: torch.Tensor | None = None,
            ckv_cache: torch.Tensor | None = None, kpe_cache: torch.Tensor | None = None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, *, query: torch.Tensor | None = None,
            kv_cache: torch.Tensor | None = None) -> torch.Tensor:
        p = self.plan_args
        if p is None:
            raise RuntimeError("BatchMLAPagedAttentionWrapper.run() called before plan().")
        if query is None or kv_cache is None:
            raise ValueError("pass query= and kv_cache= (packed)")
        width = p["ckv"] + p["kpe"]
        if query.shape[1:] != (p["heads"], width) or kv_cache.shape[1:] != (p["page"], width):
            raise ValueError("query / kv_cache do not match the planned heads and widths")
        if query.dtype != p["q_dtype"] or kv_cache.dtype != p["kv_dtype"]:
            raise ValueError("query / kv_cache dtypes differ from the plan's")
        if out is None or out.shape != (query.shape[0], p["heads"], p["ckv"]):
            raise ValueError("out must be [tokens, heads, head_dim_ckv]")
        m = p["meta"]
        qo, ptr, lens = m.qo_indptr.tolist(), m.kv_indptr.tolist(), m.kv_len_arr.tolist()
        for i, n in enumerate(lens):
            q = query[qo[i]:qo[i + 1]].float()  # [m, H, C+R]
            keys = kv_cache[m.kv_indices[ptr[i]:ptr[i + 1]].long()].reshape(-1, width)[:n]
            keys = keys.float()
            scores = torch.einsum("mhd,nd->hmn", q, keys) * p["scale"]
            pos = torch.arange(n - q.shape[0], n)[:, None]
            if p["causal"]:
                scores = scores.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[qo[i]:qo[i + 1]] = torch.einsum("hmn,nc->mhc", probs,
                                                keys[:, :p["ckv"]]).to(out.dtype)
        return out


class mla:  # noqa: N801 - the stand-in for the `flashinfer.mla` module
    """What batchgen reads from `flashinfer.mla`."""

    BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    MLAPlanMetadata = MLAPlanMetadata


__version__ = "0.7.4 (stand-in)"

"""The CUDA backend for latent MLA pools ("flashinfer_mla"): FlashInfer's MLA wrapper.

With the latent cache (attention/mla.py) every MLA layer attends one KV head of kv_lora_rank +
qk_rope_head_dim values per token (576 in DeepSeek-V3), with the absorbed query of the same
width per head and an output kv_lora_rank wide: FlashInfer's `BatchMLAPagedAttentionWrapper`
computes exactly that. The pool's per-layer block view [pages, page_size, 576] is its
"packed" KV cache and the absorbed query [tokens, heads, 576] its "packed" query, so nothing is
split or copied. All MLA layers share one scale, so one plan per step (on the first layer)
serves every layer, on the CSR metadata the other backends get (kv lengths from the last-page
lengths). Kernels are built when the backend is made (fallback with the cause otherwise).
No CUDA graphs and no fp8 pool here: those run on the torch backend.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.attention.backend import BackendUnavailable, KernelBuildFailed
from batchgen.attention.flashinfer_backend import WORKSPACE_BYTES, WRAPPER_BYTES, build_failure
from batchgen.attention.metadata import StepMetadata
from batchgen.attention.spec import AttentionSpec
from batchgen.kv.cache import KVCache

# DeepSeek-V2/V3 and Kimi-K2's latent: kv_lora_rank 512 + rope 64 (FlashInfer's MLA shape)
HEAD_DIMS = (576,)
Q_DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float16, torch.bfloat16)


def reserved_bytes(specs: list[AttentionSpec], max_num_tokens: int,
                   graph_sizes: list[int] | None) -> int:
    """GPU bytes beyond the pool: the workspace, the output and one wrapper."""
    s0 = specs[0]
    out = max_num_tokens * s0.num_heads * s0.head_dim_v * s0.dtype.itemsize
    return WORKSPACE_BYTES + out + WRAPPER_BYTES


class FlashInferMlaBackend:
    """One MLA wrapper, planned once per step; owns the workspace and the output buffer."""

    name = "flashinfer_mla"
    supports_graphs = False

    def __init__(self, specs: list[AttentionSpec], cache: KVCache, max_num_tokens: int,
                 fi: Any) -> None:
        _check_specs(specs, cache)
        self.specs = specs
        self.cache = cache
        self.fi = fi
        s0 = specs[0]
        self.ckv, self.kpe = s0.head_dim_v, s0.head_dim - s0.head_dim_v
        dev = cache.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.out = torch.empty(max_num_tokens, s0.num_heads, s0.head_dim_v, dtype=s0.dtype,
                               device=dev)
        self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend="fa2")
        self.meta: StepMetadata | None = None
        self.planned = False
        self._build_kernels()

    def plan(self, meta: StepMetadata) -> None:
        """Record the step; the wrapper is planned on the step's first layer."""
        self.meta = meta
        self.planned = False

    def run(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, heads, lora + rope] (absorbed) → [T, heads, lora] over the layer's latent."""
        if not self.planned:
            self._plan()
        out = self.out[:q.shape[0]]
        latent = self.cache.k_blocks[layer][:, :, 0]  # [pages, page_size, lora + rope]
        self.wrapper.run(query=q, kv_cache=latent, out=out)
        return out

    def _plan(self) -> None:
        """Plan the wrapper on the step's CSR metadata (host indptrs and lengths, device
        page ids), causal, with the layers' shared scale and dtypes."""
        meta, s0 = self.meta, self.specs[0]
        assert meta is not None, "run() before plan()"
        lens = meta.kv_lens().to(torch.int32)
        self.wrapper.plan(
            metadata=self.fi.mla.MLAPlanMetadata.csr(meta.qo_indptr, meta.kv_indptr,
                                                     meta.kv_indices_device, lens),
            num_heads=s0.num_heads, head_dim_ckv=self.ckv, head_dim_kpe=self.kpe,
            page_size=meta.block_size, causal=True, sm_scale=s0.scale,
            q_data_type=s0.dtype, kv_data_type=self.cache.dtype,
            query_layout="packed", kv_cache_layout="packed")
        self.planned = True

    def _build_kernels(self) -> None:
        """Plan and run one token in the scratch block, so FlashInfer builds (or loads) the
        kernel module now; KernelBuildFailed with the cause and the fix otherwise."""
        one = torch.tensor([0, 1], dtype=torch.int32)
        page = torch.tensor([self.cache.scratch_block], dtype=torch.int32)
        s0 = self.specs[0]
        self.plan(StepMetadata(one, one, page, torch.ones(1, dtype=torch.int32),
                               self.cache.block_size, page.to(self.cache.device)))
        q = torch.zeros(1, s0.num_heads, s0.head_dim, dtype=s0.dtype, device=self.cache.device)
        try:
            self.run(0, q)
        except (RuntimeError, OSError, ImportError) as e:
            raise KernelBuildFailed(build_failure(e)) from e
        self.meta, self.planned = None, False


def _check_specs(specs: list[AttentionSpec], cache: KVCache) -> None:
    """BackendUnavailable unless every layer attends the pool's latent the same way."""
    if not cache.v_in_k:
        raise BackendUnavailable("the pool is not an MLA latent (FlashInfer's MLA wrapper "
                                 "reads one packed latent head)")
    s0 = specs[0]
    for i, s in enumerate(specs):
        if (s.num_kv_heads, s.head_dim, s.head_dim_v) != (1, cache.head_dim, cache.head_dim_v):
            raise BackendUnavailable(f"layer {i} does not attend the latent pool")
        if s.plan_key != s0.plan_key or s.num_heads != s0.num_heads:
            raise BackendUnavailable("MLA layers differ in scale, heads, window or softcap "
                                     "(one plan per step)")
        if s.window or s.softcap or s.sinks is not None:
            raise BackendUnavailable(f"layer {i} has a window, softcap or sinks; FlashInfer's "
                                     "MLA wrapper has none")
        if s.dtype not in Q_DTYPES:
            raise BackendUnavailable(f"layer {i} computes in {s.dtype}; FlashInfer's MLA "
                                     f"wrapper takes {[str(d) for d in Q_DTYPES]}")
    if cache.dtype not in KV_DTYPES:
        raise BackendUnavailable(f"a {cache.dtype} latent pool; FlashInfer's MLA path here "
                                 f"reads {[str(d) for d in KV_DTYPES]}")

"""The CUDA backend ("flashinfer"): FlashInfer's paged prefill and decode kernels over the pool.

Per step, `plan()` only records the step's metadata; each distinct plan key of the layers
(window, softcap, scale: Gemma 2/3, GPT-OSS and Qwen2 layer types differ by layer) is planned
once, on the first layer that needs it, with the host int32 `qo_indptr` / `kv_indptr` /
`kv_last_page_len`, the device `kv_indices` and the model dtype as `q_data_type`. `run()` per
layer attends on `(pool[l, 0], pool[l, 1])` into a preallocated output. A step with any row of
more than one query uses the paged-prefill wrapper (causal, fa2); a decode-only step uses the
tensor-core decode wrapper. With CUDA graphs, each captured batch size has its own decode
wrappers over index buffers shared by all sizes (`graph_plan`).

The module is passed in (`fi`): the registry imports `flashinfer`; the CPU contract tests pass
a PyTorch stand-in written from FlashInfer's documented semantics.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.attention.backend import BackendUnavailable
from batchgen.attention.metadata import StepMetadata
from batchgen.attention.spec import AttentionSpec
from batchgen.kv.cache import KVCache

WORKSPACE_BYTES = 256 << 20  # one zeroed float workspace shared by every wrapper
# each wrapper's own int workspace on the GPU (it pins as much host memory too)
WRAPPER_BYTES = 8 << 20
# fa2 is safe for these head sizes only (others can crash or be silently wrong upstream)
HEAD_DIMS = (64, 128, 256)
Q_DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)

PlanKey = tuple[int | None, float | None, float, bool]  # AttentionSpec.plan_key


def reserved_bytes(specs: list[AttentionSpec], max_num_tokens: int,
                   graph_sizes: list[int] | None) -> int:
    """GPU bytes the backend allocates beyond the pool, for sizing the pool before it exists:
    the workspace, the output buffer and WRAPPER_BYTES per wrapper (eager prefill and decode
    per plan key, plus one decode per captured batch size per key with graphs)."""
    keys = len({s.plan_key for s in specs})
    wrappers = keys * (2 + len(graph_sizes or ()))
    s0 = specs[0]
    out = max_num_tokens * s0.num_heads * s0.head_dim_v * s0.dtype.itemsize
    return WORKSPACE_BYTES + out + wrappers * WRAPPER_BYTES


class FlashInferBackend:
    """Prefill and decode wrappers per plan key, planned lazily once per step. Owns the
    workspace, the wrappers, the output buffer and the graph index buffers; the pool is the
    LLM's."""

    name = "flashinfer"
    supports_graphs = True  # a GraphBackend: graph_plan, reserve_graph_buffers

    def __init__(self, specs: list[AttentionSpec], cache: KVCache, max_num_tokens: int,
                 fi: Any) -> None:
        _check_specs(specs, cache.dtype)
        self.specs = specs
        self.cache = cache
        self.fi = fi
        dev = cache.pool.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        s0 = specs[0]
        self.out = torch.empty(max_num_tokens, s0.num_heads, s0.head_dim_v, dtype=s0.dtype,
                               device=dev)
        # FlashInfer takes sinks as float32 [num_qo_heads]: one copy per layer, made once
        self.sinks = [None if s.sinks is None else s.sinks.detach().float().contiguous()
                      for s in specs]
        self.wrappers: dict[tuple[Any, ...], Any] = {}  # (kind, plan key[, batch]) -> wrapper
        self.meta: StepMetadata | None = None
        self.graph_batch: int | None = None  # captured batch size this step replays
        self.planned: dict[PlanKey, Any] = {}
        self.steps = 0  # plan() calls, and wrapper plans made: one per key per step
        self.plans_made = 0
        self.graph_buffers: dict[str, torch.Tensor] = {}

    # ---- per step ---------------------------------------------------------------------------
    def plan(self, meta: StepMetadata) -> None:
        """Record the step; each plan key is planned on its first layer (run)."""
        self.steps += 1
        self.meta = meta
        self.graph_batch = None
        self.planned = {}

    def graph_plan(self, meta: StepMetadata, batch_size: int) -> None:
        """A decode step padded to a captured batch size: plan every key now, outside the
        graph (plans must never be captured), on that size's wrappers."""
        self.plan(meta)
        self.graph_batch = batch_size
        for spec in self.specs:
            self._planned_wrapper(spec)

    def run(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        spec = self.specs[layer]
        out = self.out[:q.shape[0]]
        self._planned_wrapper(spec).run(
            q, (self.cache.pool[layer, 0], self.cache.pool[layer, 1]), out=out,
            k_scale=self.cache.k_scales[layer], v_scale=self.cache.v_scales[layer],
            sinks=self.sinks[layer])
        return out

    # ---- plans and wrappers -----------------------------------------------------------------
    def _planned_wrapper(self, spec: AttentionSpec) -> Any:
        key = spec.plan_key
        wrapper = self.planned.get(key)
        if wrapper is None:
            meta = self.meta
            assert meta is not None, "run() before plan()"
            decode = meta.num_tokens == meta.num_seqs
            wrapper = self._wrapper("decode" if decode else "prefill", key)
            common = dict(window_left=spec.window - 1 if spec.window else -1,
                          logits_soft_cap=spec.softcap or 0.0, sm_scale=spec.scale,
                          q_data_type=spec.dtype, kv_data_type=self.cache.dtype)
            if decode:
                wrapper.plan(meta.kv_indptr, meta.kv_indices_device, meta.kv_last_page_len,
                             spec.num_heads, spec.num_kv_heads, spec.head_dim, meta.block_size,
                             **common)
            else:
                wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices_device,
                             meta.kv_last_page_len, spec.num_heads, spec.num_kv_heads,
                             spec.head_dim, meta.block_size, head_dim_vo=spec.head_dim_v,
                             causal=True, **common)
            self.planned[key] = wrapper
            self.plans_made += 1
        return wrapper

    def _wrapper(self, kind: str, key: PlanKey) -> Any:
        """The wrapper of this kind and key (of the captured batch size under a graph),
        created on first use; all share the workspace."""
        batch = self.graph_batch
        wkey = (kind, key) if batch is None else (kind, key, batch)
        if wkey not in self.wrappers:
            if kind == "prefill":
                w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                backend="fa2")
            elif batch is None:
                w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                               use_tensor_cores=True)
            else:
                b = self.graph_buffers
                w = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                    paged_kv_indptr_buffer=b["indptr"][:batch + 1],
                    paged_kv_indices_buffer=b["indices"],
                    paged_kv_last_page_len_buffer=b["last_page_len"][:batch])
            self.wrappers[wkey] = w
        return self.wrappers[wkey]

    def reserve_graph_buffers(self, max_batch: int, max_pages: int) -> None:
        """Index buffers every captured batch size's decode wrappers slice (one set)."""
        dev = self.cache.pool.device
        self.graph_buffers = {
            "indptr": torch.zeros(max_batch + 1, dtype=torch.int32, device=dev),
            "indices": torch.zeros(max_pages, dtype=torch.int32, device=dev),
            "last_page_len": torch.ones(max_batch, dtype=torch.int32, device=dev)}


def _check_specs(specs: list[AttentionSpec], kv_dtype: torch.dtype) -> None:
    """BackendUnavailable unless FlashInfer serves every layer safely."""
    for i, s in enumerate(specs):
        if s.head_dim not in HEAD_DIMS or s.head_dim_v != s.head_dim:
            raise BackendUnavailable(f"layer {i} has head_dim {s.head_dim}/{s.head_dim_v}; "
                                     f"FlashInfer's fa2 kernels serve {HEAD_DIMS} (q = v)")
        if s.dtype not in Q_DTYPES:
            raise BackendUnavailable(f"layer {i} computes in {s.dtype}; FlashInfer takes "
                                     f"{[str(d) for d in Q_DTYPES]}")
        if s.num_heads != specs[0].num_heads or s.head_dim_v != specs[0].head_dim_v:
            raise BackendUnavailable("layers differ in heads or head size (one output buffer)")
    if kv_dtype not in KV_DTYPES:
        raise BackendUnavailable(f"a {kv_dtype} KV cache; FlashInfer reads "
                                 f"{[str(d) for d in KV_DTYPES]}")

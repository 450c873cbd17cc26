"""The CUDA backend ("flashinfer"): FlashInfer's paged prefill and decode kernels over the pool.

Per step, `plan()` only records the step's metadata; each distinct plan key of the layers
(window, softcap, scale: Gemma 2/3, GPT-OSS and Qwen2 layer types differ by layer) is planned
once, on the first layer that needs it, with the host int32 `qo_indptr` / `kv_indptr` /
`kv_last_page_len`, the device `kv_indices` and the model dtype as `q_data_type`. `run()` per
layer attends on `(pool[l, 0], pool[l, 1])` into a preallocated output. A step with any row of
more than one query uses the paged-prefill wrapper (causal, fa2); a decode-only step uses the
tensor-core decode wrapper. With CUDA graphs, each captured batch size has its own decode
wrappers over index buffers shared by all sizes (`graph_plan`).

Layers with attention sinks (GPT-OSS) use FlashInfer's sink wrappers, whose JIT variant takes
the sinks and sm_scale at run: the plain fa2 path ignores a `sinks=` argument without a word,
so it is never given one. Every kernel module the layers need is built (JIT-compiled with nvcc
on first use) when the backend is made, so a machine that cannot build them falls back to
another backend at load time, with the cause and the fix, instead of failing at the first step.

The module is passed in (`fi`): the registry imports `flashinfer`; the CPU contract tests pass
a PyTorch stand-in written from FlashInfer's documented semantics.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.attention.backend import BackendUnavailable, KernelBuildFailed
from batchgen.attention.metadata import StepMetadata
from batchgen.attention.spec import AttentionSpec
from batchgen.kv.cache import KVCache

WORKSPACE_BYTES = 256 << 20  # one zeroed float workspace shared by every wrapper
# each wrapper's own int workspace on the GPU (it pins as much host memory too)
WRAPPER_BYTES = 8 << 20
# fa2 is safe for these head sizes only (others can crash or be silently wrong upstream)
HEAD_DIMS = (64, 128, 256)
Q_DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)

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
        if any(s.sinks is not None for s in specs) and not hasattr(
                fi, "BatchDecodeWithAttentionSinkWrapper"):
            raise BackendUnavailable(f"this FlashInfer ({getattr(fi, '__version__', '?')}) has "
                                     "no attention-sink decode wrapper; 0.7.4 has")
        self.specs = specs
        self.cache = cache
        self.fi = fi
        dev = cache.device
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
        self._build_kernels()

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
        wrapper = self._planned_wrapper(spec)
        kv = self.cache.layer_kv(layer)
        scales = dict(k_scale=self.cache.k_scales[layer], v_scale=self.cache.v_scales[layer])
        sinks = self.sinks[layer]
        if sinks is None:
            wrapper.run(q, kv, out=out, **scales)
        else:  # the sink variant reads sinks and sm_scale by position (k_scale folds into it)
            wrapper.run(q, kv, sinks, spec.scale, out=out, **scales)
        return out

    def _build_kernels(self) -> None:
        """Plan and run one token per plan key and wrapper kind into the scratch block, so
        that FlashInfer builds (or loads) every kernel module now. KernelBuildFailed, with the
        cause and the fix, where they cannot be built here."""
        dev = self.cache.device
        one = torch.tensor([0, 1], dtype=torch.int32)
        page = torch.tensor([self.cache.scratch_block], dtype=torch.int32)
        meta = StepMetadata(one, one, page, torch.ones(1, dtype=torch.int32),
                            self.cache.block_size, page.to(dev))
        firsts = {s.plan_key: i for i, s in reversed(list(enumerate(self.specs)))}
        try:
            for layer in firsts.values():
                spec = self.specs[layer]
                q = torch.zeros(1, spec.num_heads, spec.head_dim, dtype=spec.dtype, device=dev)
                for kind in ("prefill", "decode"):
                    self.planned = {spec.plan_key: self._plan(kind, spec, meta)}
                    self.run(layer, q)
        except (RuntimeError, OSError, ImportError) as e:
            raise KernelBuildFailed(build_failure(e)) from e
        self.planned = {}

    # ---- plans and wrappers -----------------------------------------------------------------
    def _planned_wrapper(self, spec: AttentionSpec) -> Any:
        """The wrapper the step's layers of this plan key run on, planned on first use."""
        key = spec.plan_key
        wrapper = self.planned.get(key)
        if wrapper is None:
            meta = self.meta
            assert meta is not None, "run() before plan()"
            kind = "decode" if meta.num_tokens == meta.num_seqs else "prefill"
            wrapper = self.planned[key] = self._plan(kind, spec, meta)
            self.plans_made += 1
        return wrapper

    def _plan(self, kind: str, spec: AttentionSpec, meta: StepMetadata) -> Any:
        """Plan this kind's wrapper for the spec's key on the step's metadata."""
        wrapper = self._wrapper(kind, spec)
        common = dict(window_left=spec.window - 1 if spec.window else -1,
                      logits_soft_cap=spec.softcap or 0.0, sm_scale=spec.scale,
                      q_data_type=spec.dtype, kv_data_type=self.cache.dtype)
        if kind == "decode":
            wrapper.plan(meta.kv_indptr, meta.kv_indices_device, meta.kv_last_page_len,
                         spec.num_heads, spec.num_kv_heads, spec.head_dim, meta.block_size,
                         **common)
        else:  # bidirectional images (Gemma 3): FlashInfer's custom mask, window on top
            mask = meta.span_mask()
            extra = {} if mask is None else {"custom_mask": mask}
            wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices_device,
                         meta.kv_last_page_len, spec.num_heads, spec.num_kv_heads,
                         spec.head_dim, meta.block_size, head_dim_vo=spec.head_dim_v,
                         causal=True, **extra, **common)
        return wrapper

    def _wrapper(self, kind: str, spec: AttentionSpec) -> Any:
        """The wrapper of this kind for the spec's plan key (of the captured batch size under
        a graph), created on first use; all share the workspace."""
        batch = self.graph_batch
        key = spec.plan_key
        wkey = (kind, key) if batch is None else (kind, key, batch)
        if wkey not in self.wrappers:
            graph = {} if batch is None else dict(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=self.graph_buffers["indptr"][:batch + 1],
                paged_kv_indices_buffer=self.graph_buffers["indices"],
                paged_kv_last_page_len_buffer=self.graph_buffers["last_page_len"][:batch])
            make = _sink_wrapper if spec.sinks is not None else _plain_wrapper
            self.wrappers[wkey] = make(self.fi, kind, self.workspace, spec, self.cache.dtype,
                                       graph)
        return self.wrappers[wkey]

    def reserve_graph_buffers(self, max_batch: int, max_pages: int) -> None:
        """Index buffers every captured batch size's decode wrappers slice (one set)."""
        dev = self.cache.device
        self.graph_buffers = {
            "indptr": torch.zeros(max_batch + 1, dtype=torch.int32, device=dev),
            "indices": torch.zeros(max_pages, dtype=torch.int32, device=dev),
            "last_page_len": torch.ones(max_batch, dtype=torch.int32, device=dev)}


def build_failure(e: BaseException) -> str:
    """The fallback's one line: what failed, and what to do about it."""
    lines = str(e).strip().splitlines()
    return (f"FlashInfer's attention kernels could not be built or loaded here "
            f"({type(e).__name__}: {lines[0] if lines else 'no message'}); FlashInfer "
            "JIT-compiles them at first use, which needs a CUDA toolkit (nvcc and ninja on "
            "PATH, or CUDA_HOME): install one, or pass attention_backend='torch'")


def _plain_wrapper(fi: Any, kind: str, workspace: torch.Tensor, spec: AttentionSpec,
                   kv_dtype: torch.dtype, graph: dict[str, Any]) -> Any:
    """fa2 paged prefill, or tensor-core decode (graph-captured when `graph` has buffers)."""
    if kind == "prefill":
        return fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    return fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True,
                                                 **graph)


def _sink_wrapper(fi: Any, kind: str, workspace: torch.Tensor, spec: AttentionSpec,
                  kv_dtype: torch.dtype, graph: dict[str, Any]) -> Any:
    """The attention-sink variant (fa2), specialised when made on dtypes, head dims and
    whether a window applies."""
    variant = dict(backend="fa2", q_data_type=spec.dtype, kv_data_type=kv_dtype,
                   head_dim_qk=spec.head_dim, head_dim_vo=spec.head_dim_v,
                   window_left=spec.window - 1 if spec.window else -1)
    if kind == "prefill":
        return fi.BatchAttentionWithAttentionSinkWrapper(workspace, "NHD", **variant)
    return fi.BatchDecodeWithAttentionSinkWrapper(workspace, "NHD", **variant, **graph)


def _check_specs(specs: list[AttentionSpec], kv_dtype: torch.dtype) -> None:
    """BackendUnavailable unless FlashInfer serves every layer safely."""
    for i, s in enumerate(specs):
        if s.head_dim_v != s.head_dim:
            raise BackendUnavailable(
                f"layer {i} has keys {s.head_dim} and values {s.head_dim_v} wide; "
                "FlashInfer's paged decode kernels read K and V of one width, so the SDPA "
                "backend (torch) runs these layers")
        if s.head_dim not in HEAD_DIMS:
            raise BackendUnavailable(f"layer {i} has head_dim {s.head_dim}; FlashInfer's fa2 "
                                     f"kernels serve {HEAD_DIMS}")
        if s.dtype not in Q_DTYPES:
            raise BackendUnavailable(f"layer {i} computes in {s.dtype}; FlashInfer takes "
                                     f"{[str(d) for d in Q_DTYPES]}")
        if s.sinks is not None and s.softcap:
            raise BackendUnavailable(f"layer {i} has attention sinks and a logit softcap; "
                                     "FlashInfer's sink kernel applies no softcap")
        if s.num_heads != specs[0].num_heads or s.head_dim_v != specs[0].head_dim_v:
            raise BackendUnavailable("layers differ in heads or head size (one output buffer)")
    if kv_dtype not in KV_DTYPES:
        raise BackendUnavailable(f"a {kv_dtype} KV cache; FlashInfer reads "
                                 f"{[str(d) for d in KV_DTYPES]}")

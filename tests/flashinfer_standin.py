"""A PyTorch stand-in for the FlashInfer wrappers batchgen uses, for CPU tests only.

Written from FlashInfer 0.7.4's wrapper code and docstrings, with the same signatures (a test,
tests/test_flashinfer_real.py, compares them with the installed package's): NHD paged KV as a
(k, v) tuple, int32 indptr / indices / last_page_len, bottom-right causal masks, `window_left`,
`logits_soft_cap`, `sm_scale`, `k_scale` / `v_scale`, the attention-sink wrappers (sinks and
sm_scale passed to `run` by position), the `use_cuda_graph` buffers whose batch size is fixed.
It checks what FlashInfer checks of its caller (a plan before run, `q` in the planned
`q_data_type`, `out`'s shape, dtype, device and contiguity, host indptrs, buffers large
enough) and raises TypeError on unknown keywords, as Python does for the real ones. Stricter
than FlashInfer in one place: the plain wrappers refuse `sinks=`, which 0.7.4's fa2 path
drops without a word. It lets batchgen/attention/flashinfer_backend.py run end to end on the
CPU, so the tests check *our use* of the API; it says nothing about FlashInfer's kernels:
only a run on a GPU (scripts/gpu_check.sh) can.
"""

from __future__ import annotations

from typing import Any

import torch

PLAN_LOG: list[tuple[str, int]] = []  # (wrapper kind, id) of every plan() call


def _dtype(x: Any) -> torch.dtype | None:
    return getattr(torch, x) if isinstance(x, str) else x


def _check_index(name: str, t: torch.Tensor, device: str | torch.device) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if torch.device(device).type != t.device.type:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


class _Wrapper:
    """What both wrappers share: the workspace, the plan, the checks and the attention."""

    kind = ""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        if kv_layout != "NHD":
            raise ValueError(f"the stand-in serves kv_layout NHD only, got {kv_layout}")
        if float_workspace_buffer.dtype != torch.uint8:
            raise ValueError("float_workspace_buffer must be a uint8 tensor")
        self.device = float_workspace_buffer.device
        self.plan_args: dict[str, Any] | None = None
        self.num_plans = 0

    def _record(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                last: torch.Tensor, hq: int, hkv: int, d: int, page_size: int, *,
                causal: bool, sm_scale: float | None, window_left: int,
                logits_soft_cap: float | None, q_data_type: Any, kv_data_type: Any,
                pos_encoding_mode: str) -> None:
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", indptr),
                        ("kv_last_page_len", last)):
            _check_index(name, t, "cpu")  # host: FlashInfer copies them for its scheduler
        _check_index("kv_indices", indices, self.device)
        if not (len(qo_indptr) == len(indptr) == len(last) + 1):
            raise ValueError("indptr lengths must be batch_size + 1")
        if int(indptr[-1]) > len(indices):
            raise ValueError("kv_indptr[-1] exceeds len(kv_indices)")
        if len(last) and (int(last.min()) < 1 or int(last.max()) > page_size):
            raise ValueError("kv_last_page_len must lie in [1, page_size]")
        if hq % hkv:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        if pos_encoding_mode != "NONE":
            raise NotImplementedError("the stand-in applies no position encoding")
        q_dtype = _dtype(q_data_type)
        kv_dtype = _dtype(kv_data_type) or q_dtype
        self.plan_args = dict(qo=qo_indptr.clone(), indptr=indptr.clone(),
                              indices=indices.clone(), last=last.clone(), hq=hq, hkv=hkv, d=d,
                              page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
                              causal=causal, window_left=window_left,
                              soft_cap=logits_soft_cap or 0.0, sm_scale=sm_scale or d ** -0.5)
        self.num_plans += 1
        PLAN_LOG.append((self.kind, id(self)))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], *,
            q_scale: float | None = None, k_scale: float | None = None,
            v_scale: float | None = None, out: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The plain wrappers' run (the sink variant has its own)."""
        _refuse_sinks(sinks, q_scale)
        return self._run(q, paged_kv_cache, k_scale, v_scale, out)

    def _run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
             k_scale: float | None, v_scale: float | None, out: torch.Tensor | None,
             sinks: torch.Tensor | None = None, sm_scale: float | None = None
             ) -> torch.Tensor:
        p = self.plan_args
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        k_cache, v_cache = paged_kv_cache  # unequal K/V strides are fine (0.7.4 has a variant)
        if q.dtype != p["q_dtype"]:
            raise ValueError(f"q is {q.dtype} but the plan's q_data_type is {p['q_dtype']}")
        if k_cache.dtype != p["kv_dtype"] or v_cache.dtype != p["kv_dtype"]:
            raise ValueError(f"k/v are {k_cache.dtype} but the plan's kv_data_type is "
                             f"{p['kv_dtype']}")
        if q.shape[1:] != (p["hq"], p["d"]) or q.shape[0] != int(self._qo()[-1]):
            raise ValueError(f"q has shape {tuple(q.shape)}, the plan expects "
                             f"[{int(self._qo()[-1])}, {p['hq']}, {p['d']}]")
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (p["hq"],)):
            raise ValueError("sinks must be float32 [num_qo_heads]")
        if out is not None:
            _check_out(out, (*q.shape[:-1], v_cache.shape[-1]), q.dtype, q.device)
        res = self._attend(q, k_cache, v_cache, sm_scale or p["sm_scale"], k_scale or 1.0,
                           v_scale or 1.0, sinks)
        if out is None:
            return res.to(q.dtype)
        out.copy_(res.to(out.dtype))
        return out

    def _qo(self) -> torch.Tensor:
        return self.plan_args["qo"]

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.plan_args
        return p["indptr"], p["indices"], p["last"]

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                sm_scale: float, k_scale: float, v_scale: float, sinks: torch.Tensor | None
                ) -> torch.Tensor:
        """Per sequence: gather its pages, bottom-right causal (and windowed) softmax."""
        p = self.plan_args
        qo = self._qo().tolist()
        indptr, indices, last = (t.tolist() for t in self._tables())
        g = p["hq"] // p["hkv"]
        res = torch.zeros(q.shape[0], p["hq"], v_cache.shape[-1])
        at = 0  # the sequence's first entry of a custom mask
        for i in range(len(last)):
            pages = indices[indptr[i]:indptr[i + 1]]
            n = (len(pages) - 1) * p["page_size"] + last[i]
            k = k_cache[pages].reshape(-1, p["hkv"], k_cache.shape[-1])[:n].float() * k_scale
            v = v_cache[pages].reshape(-1, p["hkv"], v_cache.shape[-1])[:n].float() * v_scale
            qi = q[qo[i]:qo[i + 1]].float()
            s = torch.einsum("qhd,khd->hqk", qi, k.repeat_interleave(g, dim=1)) * sm_scale
            if p["soft_cap"] > 0:
                s = p["soft_cap"] * torch.tanh(s / p["soft_cap"])
            qpos = torch.arange(n - qi.shape[0], n)[:, None]
            kpos = torch.arange(n)[None]
            allowed = kpos <= qpos if (p["causal"] or qi.shape[0] == 1) else kpos >= 0
            if p.get("mask") is not None:  # FlashInfer: the custom mask, window on top
                allowed = p["mask"][at:at + qi.shape[0] * n].view(qi.shape[0], n)
                at += qi.shape[0] * n
            if p["window_left"] >= 0:
                allowed = allowed & (kpos >= qpos - p["window_left"])
            s = s.masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                sink = sinks.float().view(-1, 1, 1).expand(p["hq"], qi.shape[0], 1)
                prob = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
            else:
                prob = torch.softmax(s, dim=-1)
            res[qo[i]:qo[i + 1]] = torch.einsum("hqk,khd->qhd", prob,
                                                v.repeat_interleave(g, dim=1))
        return res


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
    """What FlashInfer checks of a caller's `out` (check_shape_dtype_device), and that the
    kernel can write it in place."""
    if out.shape != torch.Size(shape):
        raise ValueError(f"Invalid shape of out: expected {shape}, got {out.shape}")
    if out.dtype != dtype:
        raise ValueError(f"Invalid dtype of out: expected {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"Invalid device of out: expected {device}, got {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    kind = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None,
                 custom_mask_buf: torch.Tensor | None = None,
                 mask_indptr_buf: torch.Tensor | None = None, backend: str = "auto") -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        if use_cuda_graph or custom_mask_buf is not None:
            raise NotImplementedError("the stand-in's prefill wrapper is eager and maskless "
                                      "(as batchgen uses it)")
        self.backend = backend

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
             packed_custom_mask: torch.Tensor | None = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: float | None = None, window_left: int = -1,
             logits_soft_cap: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None) -> None:
        if packed_custom_mask is not None:
            raise NotImplementedError("the stand-in takes custom_mask unpacked only")
        if custom_mask is not None and (custom_mask.dtype != torch.bool or custom_mask.dim() != 1):
            raise ValueError("custom_mask must be a flat bool tensor")
        self._record(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                     num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=causal,
                     sm_scale=sm_scale, window_left=window_left,
                     logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                     kv_data_type=kv_data_type, pos_encoding_mode=pos_encoding_mode)
        self.plan_args["mask"] = custom_mask  # each sequence's [qo, kv] rows, concatenated
        if custom_mask is not None:
            qo = qo_indptr.tolist()
            lens = ((paged_kv_indptr[1:] - paged_kv_indptr[:-1] - 1) * page_size
                    + paged_kv_last_page_len).tolist()
            want = sum((qo[i + 1] - qo[i]) * n for i, n in enumerate(lens))
            if custom_mask.numel() != want:
                raise ValueError(f"custom_mask has {custom_mask.numel()} entries, the batch "
                                 f"needs sum(qo_len * kv_len) = {want}")


def _refuse_sinks(sinks: torch.Tensor | None, q_scale: float | None) -> None:
    """FlashInfer 0.7.4's fa2 path takes `sinks=` and drops it: the stand-in refuses it."""
    if sinks is not None:
        raise ValueError("sinks= reaches no fa2 kernel in FlashInfer 0.7.4 (silently "
                         "ignored there): use the attention-sink wrappers")
    if q_scale is not None:
        raise NotImplementedError("the stand-in takes no q_scale (batchgen passes none)")


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    kind = "decode"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self.use_cuda_graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        if use_cuda_graph:
            for name, b in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                            ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                            ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if not torch.is_tensor(b):
                    raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
            self.batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self.batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                        paged_kv_last_page_len_buffer)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
             pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, sm_scale: float | None = None) -> None:
        if self.use_cuda_graph:
            if len(last_page_len) != self.batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self.buffers[1]):
                raise ValueError("The size of indices should be less than or equal to the "
                                 "allocated buffer")
            self.buffers[0].copy_(indptr)
            self.buffers[1][:len(indices)].copy_(indices)
            self.buffers[2].copy_(last_page_len)
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._record(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                     page_size, causal=True, sm_scale=sm_scale, window_left=window_left,
                     logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                     kv_data_type=kv_data_type, pos_encoding_mode=pos_encoding_mode)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Under a graph the kernels read the buffers (what plan() last wrote there)."""
        if self.use_cuda_graph:
            indptr, indices, last = self.buffers
            return indptr.cpu(), indices.cpu(), last.cpu()
        return super()._tables()


class _SinkVariant:
    """The attention-sink JIT variant: specialised when made (dtypes, head dims, whether a
    window applies), no softcap, sinks and sm_scale read at run."""

    def _specialise(self, q_data_type: torch.dtype, kv_data_type: torch.dtype,
                    head_dim_qk: int, head_dim_vo: int, window_left: int) -> None:
        self.variant = (q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left >= 0)

    def _check_variant(self) -> None:
        p = self.plan_args
        planned = (p["q_dtype"], p["kv_dtype"], p["d"], p["d"], p["window_left"] >= 0)
        if planned != self.variant:
            raise ValueError(f"planned {planned}, but the sink variant was built for "
                             f"{self.variant} (q dtype, kv dtype, head dims, window)")
        if p["soft_cap"] > 0:
            raise ValueError("the attention-sink variant applies no logits_soft_cap")

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
            sinks: torch.Tensor, sm_scale: float, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        if self.plan_args is None:
            raise RuntimeError("plan() must be called before run()")
        self._check_variant()
        _refuse_sinks(None, q_scale)
        return self._run(q, paged_kv_cache, k_scale, v_scale, out, sinks, sm_scale)


class BatchAttentionWithAttentionSinkWrapper(_SinkVariant, BatchPrefillWithPagedKVCacheWrapper):
    kind = "prefill"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None,
                 custom_mask_buf: torch.Tensor | None = None,
                 mask_indptr_buf: torch.Tensor | None = None, backend: str = "auto",
                 pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                 q_data_type: torch.dtype = torch.bfloat16,
                 kv_data_type: torch.dtype = torch.bfloat16, head_dim_qk: int = 128,
                 head_dim_vo: int = 128, window_left: int = -1) -> None:
        BatchPrefillWithPagedKVCacheWrapper.__init__(
            self, float_workspace_buffer, kv_layout, use_cuda_graph, backend=backend)
        self._specialise(q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left)


class BatchDecodeWithAttentionSinkWrapper(_SinkVariant, BatchDecodeWithPagedKVCacheWrapper):
    kind = "decode"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 backend: str = "auto", q_data_type: torch.dtype = torch.bfloat16,
                 kv_data_type: torch.dtype = torch.bfloat16, head_dim_qk: int = 128,
                 head_dim_vo: int = 128, window_left: int = -1, *,
                 use_cuda_graph: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        BatchDecodeWithPagedKVCacheWrapper.__init__(
            self, float_workspace_buffer, kv_layout, use_cuda_graph, True,
            paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer,
            backend)
        self._specialise(q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left)

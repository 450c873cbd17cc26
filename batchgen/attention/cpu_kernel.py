"""The CPU decode kernel (csrc/paged_decode.c): built once with the system C compiler, cached,
loaded through ctypes (batchgen/cpu_build.py).

Decode attention reads each sequence's K/V in place from the paged pool, so the torch
backend's per-step block gathers and padded SDPA calls disappear for decode rows. Without a
compiler (or with BATCHGEN_CPU_KERNEL=0) the pure-PyTorch path runs instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

from batchgen import cpu_build
from batchgen.cpu_build import ENV_SWITCH, KernelUnavailable, load_library

logger = logging.getLogger("batchgen")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn,  # pool dtypes the kernel reads
             torch.float8_e5m2)  # (its kv_kind: the index here)
__all__ = ["ENV_SWITCH", "KernelUnavailable", "PagedDecodeKernel", "build", "load", "try_load"]


class PagedDecodeKernel:
    """Typed wrapper over `batchgen_paged_decode`; every tensor is checked before the call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.batchgen_paged_decode
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 4
                             + [ctypes.c_int64] * 5
                             + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor,
                 scale: float, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None, check_tables: bool = True) -> None:
        """out [S, Hq, D] = attention of q [S, Hq, D] over k/v [P, B, Hkv, D] (q and out
        float32, k and v float32, bfloat16, float8 e4m3fn or e5m2, unscaled; contiguous, CPU); sequence i's keys are its first kv_len[i] slots of the pages
        kv_indices[kv_indptr[i]:kv_indptr[i+1]] (int32). `check_tables` verifies the page
        tables stay inside the pool (the C code trusts them); once per step is enough."""
        s, hq, d = q.shape
        _, bs, hkv, dk = k.shape
        for name, t in (("q", q), ("out", out)):
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
        for name, t in (("k", k), ("v", v)):
            if (t.dtype not in KV_DTYPES or t.dtype != k.dtype or t.device.type != "cpu"
                    or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous CPU tensor of one of "
                                 f"{[str(d) for d in KV_DTYPES]} (k and v alike)")
        for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_len", kv_len)):
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int32 tensor")
        if (dk != d or tuple(v.shape) != tuple(k.shape) or tuple(out.shape) != (s, hq, d)
                or hq % hkv or kv_indptr.numel() != s + 1 or kv_len.numel() != s):
            raise ValueError("paged decode kernel: inconsistent shapes")
        if check_tables:
            _check_tables(kv_indptr, kv_indices, kv_len, k.shape[0], bs)
        if sinks is not None:
            if sinks.numel() != hq:
                raise ValueError(f"sinks must have one value per query head ({hq})")
            sinks = sinks.detach().to(torch.float32).contiguous()
        rc = self._fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), KV_DTYPES.index(k.dtype),
                      out.data_ptr(),
                      kv_indptr.data_ptr(), kv_indices.data_ptr(), kv_len.data_ptr(),
                      s, hq, hkv, d, bs, scale, window or 0, softcap or 0.0,
                      sinks.data_ptr() if sinks is not None else None)
        if rc != 0:
            raise MemoryError("paged decode kernel could not allocate its scratch buffers")


def _check_tables(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor,
                  num_blocks: int, block_size: int) -> None:
    """ValueError unless every page is a pool block and every length fits its pages."""
    pages = kv_indptr[1:] - kv_indptr[:-1]
    if bool((pages < 0).any()) or int(kv_indptr[-1]) != kv_indices.numel():
        raise ValueError("kv_indptr must be non-decreasing and end at len(kv_indices)")
    if kv_indices.numel() and (int(kv_indices.min()) < 0 or int(kv_indices.max()) >= num_blocks):
        raise ValueError(f"kv_indices must lie in [0, {num_blocks})")
    if bool(((kv_len < 1) | (kv_len > pages * block_size)).any()):
        raise ValueError("each kv_len must be >= 1 and fit its pages")


def build(verbose: bool = False) -> Path:
    """Compile the kernel into the cache (once per source, compiler, flags and CPU; ~1 s)."""
    return cpu_build.build(SOURCE, verbose)


def load() -> PagedDecodeKernel:
    """The kernel, built on first use; raises KernelUnavailable when it cannot be."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        raise KernelUnavailable(f"disabled by {ENV_SWITCH}=0")
    kernel = _load_once()
    if isinstance(kernel, KernelUnavailable):
        raise kernel
    return kernel


@lru_cache(maxsize=1)
def _load_once() -> PagedDecodeKernel | KernelUnavailable:
    """Build and load once per process; a failure is remembered too (no rebuild per LLM)."""
    try:
        return _build_and_load()
    except KernelUnavailable as e:
        return e


def _build_and_load() -> PagedDecodeKernel:
    return PagedDecodeKernel(load_library(SOURCE))


def try_load() -> PagedDecodeKernel | None:
    """The kernel, or None (and a log line) where it cannot be built."""
    try:
        return load()
    except KernelUnavailable as e:
        logger.info("CPU decode kernel unavailable (%s); using the PyTorch path", e)
        return None

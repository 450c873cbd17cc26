"""The CPU decode kernel (csrc/paged_decode.c): built once with the system C compiler, cached,
loaded through ctypes.

Decode attention reads each sequence's K/V in place from the paged pool, so the torch
backend's per-step block gathers and padded SDPA calls disappear for decode rows. The kernel
uses OpenMP and links `libgomp.so.1`, which resolves to the runtime torch already loaded, so
`torch.set_num_threads` governs it too. Without a compiler (or with BATCHGEN_CPU_KERNEL=0) the
pure-PyTorch path runs instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from batchgen.cache import cache_root

logger = logging.getLogger("batchgen")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
         "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math"]
ENV_SWITCH = "BATCHGEN_CPU_KERNEL"  # "0" disables the kernel
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)  # pool dtypes the kernel reads


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here."""


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
        float32, k and v float32, bfloat16 or float8 e4m3fn, unscaled; contiguous, CPU); sequence i's keys are its first kv_len[i] slots of the pages
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


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise KernelUnavailable("no C compiler found (set CC, or install gcc)")


def _cpu_id() -> str:
    """What -march=native compiles for: a build is reused only on the same kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), sys.platform)
    except OSError:
        return sys.platform


def build(verbose: bool = False) -> Path:
    """Compile the kernel into the cache (once per source, compiler, flags and CPU; ~1 s)."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, *FLAGS, _cpu_id()])
                         .encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"paged_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelUnavailable(f"{cc} failed to build {SOURCE.name}:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders agree on the file
    if verbose:
        logger.info("compiled the CPU decode kernel (once per machine): %s", target)
    return target


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
    if not sys.platform.startswith("linux"):
        raise KernelUnavailable("the CPU kernel is built on Linux only")
    try:
        path = build(verbose=True)
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, compiler crash
        raise KernelUnavailable(f"cannot build {SOURCE.name}: {e}") from e
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e
    return PagedDecodeKernel(lib)


def try_load() -> PagedDecodeKernel | None:
    """The kernel, or None (and a log line) where it cannot be built."""
    try:
        return load()
    except KernelUnavailable as e:
        logger.info("CPU decode kernel unavailable (%s); using the PyTorch path", e)
        return None

"""The attention backends by name, with what each can run. `attention_backend=` names one;
None takes the first, in this order, that runs here.

Selection happens twice, both times before anything is allocated for the engine: on the
device, dtypes, head size and KV layout (before the weights load), then on the layers' probed
specs (a backend may still refuse them; the default then falls back to the next one, with a log
line). An entry also declares what the engine must know before the pool is sized: the GPU
memory its backend takes beyond the pool and whether it can run CUDA-graph decode.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch

from batchgen.attention import cpu_kernel, flashinfer_backend, flashinfer_mla
from batchgen.attention.backend import AttentionBackend, BackendUnavailable, KernelBuildFailed
from batchgen.attention.kernel_backend import CpuKernelBackend
from batchgen.attention.spec import AttentionSpec
from batchgen.attention.torch_backend import TorchBackend
from batchgen.kv.cache import NHD, KVCache

logger = logging.getLogger("batchgen")

# (specs, cache, max_num_tokens) -> backend; raises BackendUnavailable for specs it cannot serve
BackendFactory = Callable[[list[AttentionSpec], KVCache, int], AttentionBackend]
# (specs, max_num_tokens, captured batch sizes or None when eager) -> GPU bytes beyond the pool
ReserveFn = Callable[[list[AttentionSpec], int, list[int] | None], int]


def no_reserve(specs: list[AttentionSpec], max_num_tokens: int,
               graph_sizes: list[int] | None) -> int:
    """A backend that keeps nothing on the device beyond the pool (its plans live per step)."""
    return 0


@dataclass(frozen=True)
class BackendQuery:
    """What is known of the engine before the weights load."""

    device: torch.device
    dtype: torch.dtype  # the model's (queries')
    kv_dtype: torch.dtype
    head_dim: int


@dataclass(frozen=True)
class BackendEntry:
    """One backend and its capability flags (None: any), with what it needs declared before
    the pool exists: the pool layout it reads, CUDA-graph decode, GPU memory beyond the pool."""

    name: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None
    kv_dtypes: tuple[torch.dtype, ...] | None
    head_dims: tuple[int, ...] | None
    load: Callable[[], BackendFactory]  # raises BackendUnavailable
    kv_layout: str = NHD  # the pool layout it reads: must be KVCache.layout
    graphs: bool = False  # its backends are GraphBackends (supports_graphs)
    reserve: ReserveFn = no_reserve

    def unfit(self, q: BackendQuery) -> str | None:
        """Why this backend cannot serve the query (None if it can)."""
        if self.kv_layout != KVCache.layout:
            return (f"reads a {self.kv_layout} KV pool, but the pool is {KVCache.layout} "
                    "(kv/cache.py kv_pool_shape)")
        if q.device.type not in self.devices:
            return f"needs device in {self.devices}, got {q.device.type!r}"
        for what, value, allowed in (("a model dtype", q.dtype, self.dtypes),
                                     ("a KV cache", q.kv_dtype, self.kv_dtypes)):
            if allowed is not None and value not in allowed:
                return f"needs {what} of {[str(d) for d in allowed]}, got {value}"
        if self.head_dims is not None and q.head_dim not in self.head_dims:
            return f"serves head_dim {self.head_dims} only, got {q.head_dim}"
        return None


def _import_flashinfer() -> ModuleType:
    """The flashinfer module, or BackendUnavailable saying how to install it."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as e:
        raise BackendUnavailable(f"flashinfer is not installed ({e}); pip install "
                                 "'batchgen[cuda]'") from e


def _load_flashinfer() -> BackendFactory:
    return partial(flashinfer_backend.FlashInferBackend, fi=_import_flashinfer())


def _load_flashinfer_mla() -> BackendFactory:
    module = _import_flashinfer()
    if not hasattr(module, "mla"):
        raise BackendUnavailable(f"this FlashInfer ({getattr(module, '__version__', '?')}) "
                                 "has no MLA wrapper")
    return partial(flashinfer_mla.FlashInferMlaBackend, fi=module)


def _load_cpu_kernel() -> BackendFactory:
    try:
        kernel = cpu_kernel.load()
    except cpu_kernel.KernelUnavailable as e:
        raise BackendUnavailable(str(e)) from e
    return lambda specs, cache, max_num_tokens: CpuKernelBackend(specs, cache, kernel)


BACKENDS: dict[str, BackendEntry] = {
    "flashinfer_mla": BackendEntry("flashinfer_mla", ("cuda",), flashinfer_mla.Q_DTYPES,
                                   flashinfer_mla.KV_DTYPES, flashinfer_mla.HEAD_DIMS,
                                   _load_flashinfer_mla, reserve=flashinfer_mla.reserved_bytes),
    "flashinfer": BackendEntry("flashinfer", ("cuda",), flashinfer_backend.Q_DTYPES,
                               flashinfer_backend.KV_DTYPES, flashinfer_backend.HEAD_DIMS,
                               _load_flashinfer, graphs=True,
                               reserve=flashinfer_backend.reserved_bytes),
    "cpu_kernel": BackendEntry("cpu_kernel", ("cpu",), None, cpu_kernel.KV_DTYPES, None,
                               _load_cpu_kernel),
    "torch": BackendEntry("torch", ("cpu", "cuda"), None, None, None,
                          lambda: lambda specs, cache, max_num_tokens: TorchBackend(specs, cache)),
}


Candidate = tuple[BackendEntry, BackendFactory]


def backend_candidates(name: str | None, query: BackendQuery) -> list[Candidate]:
    """The backends to try, best first (only `name` when one is asked for). ValueError naming
    attention_backend when the one asked for cannot run here."""
    if name is not None:
        entry = BACKENDS[name]
        reason = entry.unfit(query)
        if reason is None:
            try:
                return [(entry, entry.load())]
            except BackendUnavailable as e:
                reason = str(e)
        raise ValueError(f"attention_backend={name!r} cannot run here: {reason}")
    out = []
    for entry in BACKENDS.values():
        reason = entry.unfit(query)
        if reason is None:
            try:
                out.append((entry, entry.load()))
                continue
            except BackendUnavailable as e:
                reason = str(e)
        if entry.devices == (query.device.type,):  # meant for this device: say why not
            logger.info("attention backend %r unavailable (%s); trying the next",
                        entry.name, reason)
    return out


def reserved_bytes(candidates: list[Candidate], specs: list[AttentionSpec],
                   max_num_tokens: int, graph_sizes: list[int] | None) -> int:
    """GPU bytes to keep beyond the pool for the backend: the most any candidate takes (the
    one that runs is known only once it accepts the specs); graph wrappers for those with
    graphs."""
    return max((entry.reserve(specs, max_num_tokens, graph_sizes if entry.graphs else None)
                for entry, _ in candidates), default=0)


def build_backend(candidates: list[Candidate], specs: list[AttentionSpec], cache: KVCache,
                  max_num_tokens: int, insisted: bool) -> tuple[str, AttentionBackend]:
    """The first candidate that accepts the layers' specs. A backend asked for by name that
    refuses them is a ValueError."""
    for entry, factory in candidates:
        name = entry.name
        try:
            return name, factory(specs, cache, max_num_tokens)
        except BackendUnavailable as e:
            if insisted:
                raise ValueError(f"attention_backend={name!r} cannot run this model: {e}") from e
            # a library that cannot build its kernels costs the GPU its fast path: say so
            level = logging.WARNING if isinstance(e, KernelBuildFailed) else logging.INFO
            logger.log(level, "attention backend %r cannot run this model (%s); trying the "
                       "next", name, e)
    raise ValueError(f"no attention backend runs this model on {cache.device}")

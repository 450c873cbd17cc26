"""The attention backends by name, with what each can run. `attention_backend=` names one;
None takes the first, in this order, that runs here.

Selection happens twice, both times before anything is allocated for the engine: on the
device, dtypes and head size (before the weights load), then on the layers' probed specs (a
backend may still refuse them; the default then falls back to the next one, with a log line).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from batchgen.attention import cpu_kernel, flashinfer_backend
from batchgen.attention.backend import AttentionBackend, BackendUnavailable, KernelBuildFailed
from batchgen.attention.kernel_backend import CpuKernelBackend
from batchgen.attention.spec import AttentionSpec
from batchgen.attention.torch_backend import TorchBackend
from batchgen.kv.cache import KVCache

logger = logging.getLogger("batchgen")

# (specs, cache, max_num_tokens) -> backend; raises BackendUnavailable for specs it cannot serve
BackendFactory = Callable[[list[AttentionSpec], KVCache, int], AttentionBackend]


@dataclass(frozen=True)
class BackendQuery:
    """What is known of the engine before the weights load."""

    device: torch.device
    dtype: torch.dtype  # the model's (queries')
    kv_dtype: torch.dtype
    head_dim: int


@dataclass(frozen=True)
class BackendEntry:
    """One backend and its capability flags (None: any)."""

    name: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None
    kv_dtypes: tuple[torch.dtype, ...] | None
    head_dims: tuple[int, ...] | None
    load: Callable[[], BackendFactory]  # raises BackendUnavailable

    def unfit(self, q: BackendQuery) -> str | None:
        """Why this backend cannot serve the query (None if it can)."""
        if q.device.type not in self.devices:
            return f"needs device in {self.devices}, got {q.device.type!r}"
        for what, value, allowed in (("a model dtype", q.dtype, self.dtypes),
                                     ("a KV cache", q.kv_dtype, self.kv_dtypes)):
            if allowed is not None and value not in allowed:
                return f"needs {what} of {[str(d) for d in allowed]}, got {value}"
        if self.head_dims is not None and q.head_dim not in self.head_dims:
            return f"serves head_dim {self.head_dims} only, got {q.head_dim}"
        return None


def _load_flashinfer() -> BackendFactory:
    try:
        module = importlib.import_module("flashinfer")
    except ImportError as e:
        raise BackendUnavailable(f"flashinfer is not installed ({e}); pip install "
                                 "'batchgen[cuda]'") from e
    return partial(flashinfer_backend.FlashInferBackend, fi=module)


def _load_cpu_kernel() -> BackendFactory:
    try:
        kernel = cpu_kernel.load()
    except cpu_kernel.KernelUnavailable as e:
        raise BackendUnavailable(str(e)) from e
    return lambda specs, cache, max_num_tokens: CpuKernelBackend(specs, cache, kernel)


BACKENDS: dict[str, BackendEntry] = {
    "flashinfer": BackendEntry("flashinfer", ("cuda",), flashinfer_backend.Q_DTYPES,
                               flashinfer_backend.KV_DTYPES, flashinfer_backend.HEAD_DIMS,
                               _load_flashinfer),
    "cpu_kernel": BackendEntry("cpu_kernel", ("cpu",), None, cpu_kernel.KV_DTYPES, None,
                               _load_cpu_kernel),
    "torch": BackendEntry("torch", ("cpu", "cuda"), None, None, None,
                          lambda: lambda specs, cache, max_num_tokens: TorchBackend(specs, cache)),
}


def backend_candidates(name: str | None, query: BackendQuery
                       ) -> list[tuple[str, BackendFactory]]:
    """The backends to try, best first (only `name` when one is asked for). ValueError naming
    attention_backend when the one asked for cannot run here."""
    if name is not None:
        entry = BACKENDS[name]
        reason = entry.unfit(query)
        if reason is None:
            try:
                return [(name, entry.load())]
            except BackendUnavailable as e:
                reason = str(e)
        raise ValueError(f"attention_backend={name!r} cannot run here: {reason}")
    out = []
    for entry in BACKENDS.values():
        reason = entry.unfit(query)
        if reason is None:
            try:
                out.append((entry.name, entry.load()))
                continue
            except BackendUnavailable as e:
                reason = str(e)
        if entry.devices == (query.device.type,):  # meant for this device: say why not
            logger.info("attention backend %r unavailable (%s); trying the next",
                        entry.name, reason)
    return out


def build_backend(candidates: list[tuple[str, BackendFactory]], specs: list[AttentionSpec],
                  cache: KVCache, max_num_tokens: int, insisted: bool
                  ) -> tuple[str, AttentionBackend]:
    """The first candidate that accepts the layers' specs. A backend asked for by name that
    refuses them is a ValueError."""
    for name, factory in candidates:
        try:
            return name, factory(specs, cache, max_num_tokens)
        except BackendUnavailable as e:
            if insisted:
                raise ValueError(f"attention_backend={name!r} cannot run this model: {e}") from e
            # a library that cannot build its kernels costs the GPU its fast path: say so
            level = logging.WARNING if isinstance(e, KernelBuildFailed) else logging.INFO
            logger.log(level, "attention backend %r cannot run this model (%s); trying the "
                       "next", name, e)
    raise ValueError(f"no attention backend runs this model on {cache.pool.device}")

"""The attention backends by name, with what each can run on. `attention_backend=` names one;
None takes the first, in this order, that runs here."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from batchgen.attention import cpu_kernel
from batchgen.attention.backend import AttentionBackend
from batchgen.attention.kernel_backend import CpuKernelBackend
from batchgen.attention.spec import AttentionSpec
from batchgen.attention.torch_backend import TorchBackend
from batchgen.kv.cache import KVCache

logger = logging.getLogger("batchgen")

BackendFactory = Callable[[list[AttentionSpec], KVCache], AttentionBackend]


class BackendUnavailable(RuntimeError):
    """The backend's library or kernel cannot be loaded here (the message says why)."""


def _load_cpu_kernel() -> BackendFactory:
    try:
        return partial(CpuKernelBackend, kernel=cpu_kernel.load())
    except cpu_kernel.KernelUnavailable as e:
        raise BackendUnavailable(str(e)) from e


@dataclass(frozen=True)
class BackendEntry:
    """One backend and its capability flags."""

    name: str
    devices: tuple[str, ...]  # device types it runs on
    kv_dtypes: tuple[torch.dtype, ...] | None  # KV pool dtypes it reads; None: any
    load: Callable[[], BackendFactory]  # raises BackendUnavailable

    def unfit(self, device: torch.device, kv_dtype: torch.dtype) -> str | None:
        """Why this backend cannot serve this device and pool dtype (None if it can)."""
        if device.type not in self.devices:
            return f"needs device in {self.devices}, got {device.type!r}"
        if self.kv_dtypes is not None and kv_dtype not in self.kv_dtypes:
            return (f"needs a KV cache of {[str(d) for d in self.kv_dtypes]}, "
                    f"got {kv_dtype}")
        return None


BACKENDS: dict[str, BackendEntry] = {
    "cpu_kernel": BackendEntry("cpu_kernel", ("cpu",), cpu_kernel.KV_DTYPES, _load_cpu_kernel),
    "torch": BackendEntry("torch", ("cpu", "cuda"), None, lambda: TorchBackend),
}


def select_backend(name: str | None, device: torch.device, kv_dtype: torch.dtype
                   ) -> tuple[str, BackendFactory]:
    """(name, factory) of the backend to run; ValueError naming attention_backend when the
    one asked for cannot run here. Called before any weights load."""
    if name is not None:
        entry = BACKENDS[name]
        reason = entry.unfit(device, kv_dtype)
        if reason is None:
            try:
                return name, entry.load()
            except BackendUnavailable as e:
                reason = str(e)
        raise ValueError(f"attention_backend={name!r} cannot run here: {reason}")
    for entry in BACKENDS.values():
        if entry.unfit(device, kv_dtype) is None:
            try:
                return entry.name, entry.load()
            except BackendUnavailable as e:
                logger.info("attention backend %r unavailable (%s); trying the next",
                            entry.name, e)
    raise ValueError(f"no attention backend runs on {device} with a {kv_dtype} KV cache")

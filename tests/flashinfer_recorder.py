"""FlashInfer's real Python layer on a CPU, with every compiled kernel module replaced by a
recorder. For CPU tests only (tests/test_flashinfer_real.py).

FlashInfer builds each kernel module through `flashinfer.jit.core.JitSpec.build_and_load`;
the module getters are cached with functools. `real_flashinfer()` patches that one method, the
compute-capability probes, pinned host allocations and `torch.version.cuda`, and sets
`FLASHINFER_CUDA_ARCH_LIST`, so that the wrappers' own `plan()` and `run()` run here, validate
their arguments as on a GPU, and hand the kernel bindings what batchgen gave them. The
recorder shows which of our values reach a binding. Nothing here computes attention: this is
no evidence that FlashInfer's kernels are right, only that our calls reach them as intended.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

PLAN_INFO = [0] * 64  # what a plan binding returns (FlashInfer keeps it opaque)
# modules that import the compute-capability probe by name
CAPABILITY_USERS = ("flashinfer.utils", "flashinfer.prefill", "flashinfer.decode",
                    "flashinfer.mla._batch_mla._backends._fa_common")
# an H100's shared memory and SMs, for the MLA planner's device checks
DEVICE = SimpleNamespace(shared_memory_per_multiprocessor=233472,
                         shared_memory_per_block_optin=232448, multi_processor_count=132)
# modules whose planners read the device's properties by name
PROPERTY_USERS = ("flashinfer.utils", "flashinfer.mla._batch_mla._backends._fa_common")


@dataclass
class Call:
    """One call of a kernel binding: the module's name, the function, its arguments."""

    module: str
    fn: str
    args: tuple[Any, ...]


@dataclass
class KernelRecorder:
    """Every kernel module FlashInfer asks for. A call is recorded; a run writes 1.0 into any
    argument that is the registered `out`, so scales applied after the kernel show in it.
    `fail` set: building a module raises it (a machine without nvcc)."""

    calls: list[Call] = field(default_factory=list)
    out: torch.Tensor | None = None
    fail: BaseException | None = None

    def build_and_load(self, spec: Any) -> _Module:
        if self.fail is not None:
            raise self.fail
        return _Module(self, str(getattr(spec, "name", spec)))

    def record(self, module: str, fn: str, args: tuple[Any, ...]) -> Any:
        self.calls.append(Call(module, fn, args))
        if "run" in fn and self.out is not None:
            for a in args:
                if torch.is_tensor(a) and a.data_ptr() == self.out.data_ptr():
                    a.fill_(1.0)
        if fn == "plan_with_staged_workspace_bytes":  # the MLA plan: (info, staged bytes)
            return PLAN_INFO, 0
        return PLAN_INFO if fn == "plan" else None

    def last(self, fn_part: str) -> Call:
        """The most recent call whose function name contains `fn_part`."""
        for c in reversed(self.calls):
            if fn_part in c.fn:
                return c
        raise AssertionError(f"no kernel binding named *{fn_part}* was called")


class _Module:
    def __init__(self, recorder: KernelRecorder, name: str) -> None:
        self._recorder = recorder
        self._name = name

    def __getattr__(self, fn: str) -> Any:
        if fn.startswith("__"):
            raise AttributeError(fn)
        return lambda *args, **kwargs: self._recorder.record(self._name, fn, args)


def reaches(call: Call, value: Any) -> bool:
    """Whether `value` is among the binding's arguments: a tensor by storage and shape, a
    float to 1e-6, an int exactly (bools are not ints here)."""
    for a in call.args:
        if torch.is_tensor(value):
            if torch.is_tensor(a) and a.data_ptr() == value.data_ptr() and a.shape == value.shape:
                return True
        elif isinstance(value, float):
            if isinstance(a, float) and math.isclose(a, value, rel_tol=1e-6):
                return True
        elif isinstance(a, int) and not isinstance(a, bool) and a == value:
            return True
    return False


def _clear_module_caches() -> None:
    """Forget every cached kernel-module getter, so the next call builds (records) afresh."""
    for name, mod in list(sys.modules.items()):
        if not name.startswith("flashinfer") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            clear = getattr(obj, "cache_clear", None)
            if callable(clear) and isinstance(obj, functools._lru_cache_wrapper):
                clear()


@contextmanager
def real_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, KernelRecorder]]:
    """(the installed flashinfer module, the recorder its kernels go to); skipped where
    flashinfer is not installed."""
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # describe modules without a GPU
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")
    fi = pytest.importorskip("flashinfer")
    from flashinfer.jit import core

    recorder = KernelRecorder()
    monkeypatch.setattr(core.JitSpec, "build_and_load",
                        lambda spec: recorder.build_and_load(spec))  # a method: spec is self
    for name in CAPABILITY_USERS:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "get_compute_capability", lambda device: (9, 0))
    for name in PROPERTY_USERS:
        monkeypatch.setattr(importlib.import_module(name), "get_device_properties",
                            lambda device: DEVICE)
    empty = torch.empty

    def unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", unpinned)
    _clear_module_caches()
    try:
        yield fi, recorder
    finally:
        _clear_module_caches()

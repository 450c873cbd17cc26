"""ForwardQueue: the device side of an overlapped engine, one worker thread that runs each
step's block moves, forward and sampler in submission order (a stream), so the host thread
plans the next step meanwhile.

On the CPU the worker computes while the host's Python runs (torch ops release the GIL); on
CUDA it queues the step's kernels and then blocks in the sampler's one device-to-host copy,
so the host thread never waits for the device except to read the sampled tokens.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class ForwardQueue:
    """Runs submitted steps one at a time, in order, on its own thread (made on first use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda_index: int | None = None  # the caller's CUDA device, fixed on first use
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, step: Callable[[], T]) -> Future[T]:
        """Queue a step; its future holds the step's result or its exception. Returns once
        the worker has taken the step: a host thread busy in Python would otherwise keep
        the GIL from it (for up to the interpreter's switch interval, 5 ms) and the step
        would start only when the host next waits."""
        with self._lock:
            if self._pool is None:
                self._cuda_index = cuda_index(self.device)
                self._pool = ThreadPoolExecutor(1, "batchgen-forward", self._enter)
                weakref.finalize(self, self._pool.shutdown, wait=False)
        taken = threading.Event()
        future = self._pool.submit(_in_inference_mode, step, taken)
        # a worker that could not start (its set-up raised) fails the future instead
        future.add_done_callback(lambda _: taken.set())
        taken.wait()
        return future

    def drain(self) -> None:
        """Wait until every queued step is done (an aborted call frees its blocks only then:
        a step still running writes into them)."""
        if self._pool is not None:
            self._pool.submit(_nothing).result()

    def _enter(self) -> None:
        """The worker's thread-local settings: the model's CUDA device (a new thread starts
        on device 0 whatever the caller's is)."""
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)

    def close(self) -> None:
        """Stop the worker once the queued steps are done."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def cuda_index(device: torch.device) -> int | None:
    """The CUDA device index steps run on: the device's own, or for a bare "cuda" the
    calling thread's current one (what the model was loaded onto); None off CUDA."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _nothing() -> None:
    """A step that marks the queue's end."""


def _in_inference_mode(step: Callable[[], T], taken: threading.Event) -> T:
    """Run a step (inference mode is per thread: the worker's steps run under it as the
    caller's do), saying first that it is taken."""
    taken.set()
    with torch.inference_mode():
        return step()

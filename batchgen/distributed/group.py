"""The tensor-parallel group as rank 0 sees it: the worker processes it started, the process
group every rank's forward communicates through, and the control channel that carries each
step to the workers.

Start-up never blocks blindly on a worker. Rank 0 serves the rendezvous store itself, starts
the workers (launch.py), and polls, every POLL_S, both the store's count of workers ready to
join and each worker's liveness; it joins only once all have counted themselves in, and it
joins on a helper thread while it keeps polling, so a worker that dies between counting itself
in and joining is caught too. A worker that dies at start-up makes `start` raise WorkerDied
within a poll, naming it with its exit code and last stderr lines; the others are stopped.
(A join abandoned that way stays blocked on its daemon thread until the rendezvous timeout;
it holds nothing the next group in this process needs, see `_reset_group_names`.)
(A worker that fails while loading its shard, after joining, exits: under gloo rank 0's next
collective, its own probe forward, fails at once, and the LLM stops the group, which logs the
worker's death; under NCCL that collective waits for its timeout.)

Rank 0 owns the workers: it stops them when the LLM is deleted, when the interpreter exits, or
when one of them dies (the others are stopped too, and the call that noticed raises). Workers
ignore Ctrl-C (the terminal sends it to every process) and exit on their own when rank 0 goes
away (their stdin, which rank 0 holds, reaches EOF).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from batchgen.distributed import launch
from batchgen.distributed.launch import Worker
from batchgen.distributed.rendezvous import (
    ANNOUNCED,
    FORWARD_TIMEOUT,
    HOST,
    WorkerSpec,
    join,
)

logger = logging.getLogger("batchgen")

STOP_GRACE_S = 5.0
POLL_S = 0.1  # how often rank 0 looks at its starting workers
START_TIMEOUT_S = FORWARD_TIMEOUT.total_seconds()  # for live workers that never join


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited: the group cannot run another forward."""


@dataclass
class TPGroup:
    """Rank 0's handle on the workers (ranks 1..k-1) and the control channel."""

    spec: WorkerSpec
    procs: list[Worker] = field(default_factory=list)
    control: Any = None
    failed: str | None = None
    store: Any = None  # the rendezvous store rank 0 serves to the workers it started
    joiner: threading.Thread | None = None  # rank 0's join, watched from the caller's thread

    @classmethod
    def start(cls, spec: WorkerSpec, spawn: bool = True) -> TPGroup:
        """Start ranks 1..k-1 (unless a launcher did) and join the group as rank 0; returns
        once all have joined, raises WorkerDied as soon as one has exited."""
        group = cls(spec)
        try:
            group.control = group._start_workers() if spawn else join(0, spec)
        except BaseException:
            group.failed = group.failed or "rank 0 could not join the group"
            group.shutdown()
            if dist.is_initialized() and not group._joining():
                dist.destroy_process_group()
            raise
        return group

    def _start_workers(self) -> Any:
        """Serve the store, start the workers, wait until all count themselves in, and join
        with them; returns the control group."""
        self.store = dist.TCPStore(HOST, 0, self.spec.tp_size, is_master=True,
                                   wait_for_workers=False, timeout=FORWARD_TIMEOUT)
        self.spec = replace(self.spec, store_port=self.store.port)
        self.procs = [launch.start_worker(r, self.spec) for r in range(1, self.spec.tp_size)]
        self._watch(lambda: self.store.add(ANNOUNCED, 0) >= len(self.procs))
        _reset_group_names()
        joined: dict[str, Any] = {}
        self.joiner = threading.Thread(target=self._join, args=(joined,), daemon=True,
                                       name="batchgen-tp-join")
        self.joiner.start()
        self._watch(lambda: not self._joining())
        if "error" in joined:
            raise joined["error"]
        return joined["control"]

    def _join(self, joined: dict[str, Any]) -> None:
        """Rank 0's join (on the joiner thread): its control group, or the error."""
        try:
            joined["control"] = join(0, self.spec, self.store)
        except BaseException as e:
            joined["error"] = e

    def _joining(self) -> bool:
        return self.joiner is not None and self.joiner.is_alive()

    def _watch(self, done: Callable[[], bool]) -> None:
        """Poll until `done()`; WorkerDied once a worker has exited, TimeoutError after
        START_TIMEOUT_S."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            dead = [w for w in self.procs if w.exitcode is not None]
            if dead:
                tails = self._record(dead)
                raise WorkerDied(f"tensor-parallel worker {self.failed} during start-up"
                                 f"{tails}")
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not join within "
                                   f"{START_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)

    def _record(self, dead: list[Worker]) -> str:
        """Record the dead workers as the group's failure; returns their last stderr lines."""
        self.failed = ", ".join(f"{w.name} exited with code {w.exitcode}" for w in dead)
        return "".join(w.last_lines() for w in dead)

    def send(self, message: tuple[Any, ...]) -> None:
        """Broadcast one message to every worker (a pickled object over the control group)."""
        self.check()
        try:
            dist.broadcast_object_list([message], src=0, group=self.control)
        except RuntimeError as e:
            raise self.failure(e) from e

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (each worker contributes its own)."""
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        except RuntimeError as e:
            raise self.failure(e) from e
        return int(t.item())

    def check(self) -> None:
        """WorkerDied if the group has failed or a worker has exited."""
        tails = ""
        if self.failed is None:
            dead = [w for w in self.procs if w.exitcode is not None]
            if dead:
                tails = self._record(dead)
        if self.failed is not None:
            self.shutdown()
            raise WorkerDied(f"tensor-parallel worker failed ({self.failed}); this LLM cannot "
                             f"run again: make a new one{tails}")

    def died(self) -> WorkerDied | None:
        """WorkerDied naming a worker that has exited (one on its way out is given two
        seconds to finish dying), else None."""
        for w in self.procs:
            w.wait(2.0)
        try:
            self.check()
        except WorkerDied as dead:
            return dead
        return None

    def failure(self, error: BaseException) -> WorkerDied:
        """The error to raise for a collective that failed: names the dead worker if one is."""
        dead = self.died()
        if dead is not None:
            return dead
        self.failed = f"a collective failed: {error}"
        self.shutdown()
        return WorkerDied(f"tensor-parallel group failed ({error}); make a new LLM")

    def shutdown(self) -> None:
        """Stop every worker (asked, then terminated, then killed) and leave the group."""
        if self.failed is None:
            dead = [w for w in self.procs if w.exitcode not in (None, 0)]
            if dead:  # no call has raised for it (it failed while rank 0 loaded its shard)
                self._record(dead)
                logger.error("tensor parallel: %s (its stderr is above)", self.failed)
        if self.failed is None and self.control is not None:
            try:
                dist.broadcast_object_list([("stop",)], src=0, group=self.control)
            except RuntimeError:
                pass
        for w in self.procs:
            w.close_stdin()  # a worker still waiting sees EOF and exits
        for w in self.procs:
            w.stop(STOP_GRACE_S)
        self.procs, self.store = [], None
        if self.control is not None:  # this group joined the default one: leave it
            dist.destroy_process_group()
        self.control = None


def _reset_group_names() -> None:
    """Name this process's next default group as a fresh worker names its own. torch counts
    the default groups it names and resets the count only in destroy_process_group, so after
    a join that failed or was abandoned (a worker died mid-rendezvous) rank 0 would wait on
    keys no fresh worker writes; with no default group there is nothing the count names."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and hasattr(world, "group_count"):
        world.group_count = 0

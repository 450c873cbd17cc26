"""Rank 0 starts each worker as `python -m batchgen.distributed.worker_process RANK`, a fresh
interpreter that does not re-run the user's script (multiprocessing's spawn re-imports
`__main__`, which a script without an `if __name__ == "__main__":` guard cannot survive), so
scripts, notebooks and `python -c` all work. The child imports the same batchgen as rank 0: its
PYTHONPATH is rank 0's `sys.path`, and (Python >= 3.11) `-P` keeps the working directory off it.

The WorkerSpec goes pickled over the child's stdin, which rank 0 then holds open for the
worker's life: the worker exits when it reaches EOF, that is when rank 0 stops it or dies.
The child's stderr is copied to rank 0's line by line, and its last lines are kept for the
error that reports its death.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import IO

from batchgen.distributed.rendezvous import WorkerSpec

WORKER_MODULE = "batchgen.distributed.worker_process"
TAIL_LINES = 8  # a worker's last stderr lines that its obituary quotes
READER_GRACE_S = 2.0  # for the copier to reach the end of an exited worker's stderr


@dataclass
class Worker:
    """One worker process as rank 0 holds it."""

    name: str  # batchgen-tp<rank>
    proc: subprocess.Popen
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status after (-N: killed by signal N)."""
        return self.proc.poll()

    def wait(self, timeout: float | None) -> bool:
        """True once the process has exited (within `timeout` seconds)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def last_lines(self) -> str:
        """Its last stderr lines, indented under a heading ("" when it wrote none)."""
        if self.reader is not None:
            self.reader.join(READER_GRACE_S)
        lines = [line for line in self.tail if line.strip()]
        return "".join([f"\n{self.name}'s last stderr lines:"] + [f"\n    {x}" for x in lines]
                       ) if lines else ""

    def close_stdin(self) -> None:
        """Close rank 0's end of its stdin: a live worker sees EOF and exits."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:  # it died with bytes unread in the pipe
                pass

    def stop(self, grace_s: float) -> None:
        """Close its stdin, then terminate, then kill it, `grace_s` apart, until it exits."""
        self.close_stdin()
        if self.wait(grace_s):
            return
        self.proc.terminate()
        if not self.wait(grace_s):
            self.proc.kill()
            self.proc.wait()


def worker_command(rank: int) -> list[str]:
    """The command line of rank `rank`'s process (tests replace it to make a worker fail)."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", WORKER_MODULE, str(rank)]


def child_env() -> dict[str, str]:
    """This process's environment with PYTHONPATH set to its sys.path: the worker imports
    the same modules (this checkout's batchgen, a notebook's added paths)."""
    paths = [p or os.getcwd() for p in sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def start_worker(rank: int, spec: WorkerSpec) -> Worker:
    """Start rank `rank` and hand it the spec; returns at once (it joins later)."""
    proc = subprocess.Popen(worker_command(rank), stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=child_env())
    worker = Worker(f"batchgen-tp{rank}", proc)
    worker.reader = threading.Thread(target=_copy_stderr, args=(proc.stderr, worker.tail),
                                     name=f"{worker.name}-stderr", daemon=True)
    worker.reader.start()
    try:
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.flush()
    except OSError:  # it is dead already: rank 0's liveness check reports it
        pass
    return worker


def _copy_stderr(stream: IO[bytes], tail: deque[str]) -> None:
    """Copy a worker's stderr to this process's (file descriptor 2, where the worker's own
    would have gone) until it closes, keeping the last lines."""
    for line in stream:
        tail.append(line.decode(errors="replace").rstrip())
        try:
            os.write(2, line)
        except OSError:
            pass
    stream.close()

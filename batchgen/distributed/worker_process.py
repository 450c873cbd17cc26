"""A worker process's entry point: rank 0 runs `python -m batchgen.distributed.worker_process
RANK` and writes the WorkerSpec, pickled, to its stdin (see launch.py).

The worker ignores Ctrl-C (the terminal sends it to every process; rank 0 handles it), exits
when its stdin reaches EOF (rank 0 stopped it, or died), and exits with code 1 after printing
the traceback of anything that fails, so rank 0 can name it and quote its last lines.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import traceback

import torch

from batchgen.distributed.worker import serve


def main() -> None:
    """A worker's whole life; exits the process when done or when rank 0 is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    try:
        rank, spec = int(sys.argv[1]), pickle.load(sys.stdin.buffer)
        threading.Thread(target=_exit_with_parent, daemon=True).start()
        torch.set_num_threads(spec.threads)
        serve(rank, spec)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _exit_with_parent() -> None:
    """Block until stdin reaches EOF (rank 0 closed it or exited), then exit."""
    try:
        sys.stdin.buffer.read()
    except OSError:
        pass
    os._exit(0)


if __name__ == "__main__":
    main()

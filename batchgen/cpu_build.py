"""Small C libraries batchgen builds for the CPU (the paged decode kernel, the sampler's
masked elementwise stages): compiled once with the system C compiler into the cache, keyed
by source, compiler, flags and CPU, and loaded through ctypes. They use OpenMP and link
`libgomp.so.1`, which resolves to the runtime torch already loaded, so `torch.set_num_threads`
governs them too. BATCHGEN_CPU_KERNEL=0 disables every one (the PyTorch paths run instead)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from batchgen.cache import cache_root

logger = logging.getLogger("batchgen")

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
         "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math"]
ENV_SWITCH = "BATCHGEN_CPU_KERNEL"  # "0" disables the C libraries


class KernelUnavailable(RuntimeError):
    """A C library could not be built or loaded here."""


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


def build(source: Path, verbose: bool = False) -> Path:
    """Compile `source` into the cache (once per source, compiler, flags and CPU; ~1 s)."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), cc, version, *FLAGS, _cpu_id()])
                         .encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, str(source), "-o", str(out), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelUnavailable(f"{cc} failed to build {source.name}:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders agree on the file
    if verbose:
        logger.info("compiled %s (once per machine): %s", source.name, target)
    return target


def load_library(source: Path) -> ctypes.CDLL:
    """`source` built (on first use) and loaded; KernelUnavailable when it cannot be."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        raise KernelUnavailable(f"disabled by {ENV_SWITCH}=0")
    if not sys.platform.startswith("linux"):
        raise KernelUnavailable("batchgen's C libraries are built on Linux only")
    try:
        path = build(source, verbose=True)
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, compiler crash
        raise KernelUnavailable(f"cannot build {source.name}: {e}") from e
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e

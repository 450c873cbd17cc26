"""Start-up time: what a command costs before it does anything (issue 32).

Each case is a fresh `python` process (this interpreter, PYTHONPATH = the repository), timed
wall-clock from spawn to exit: `import batchgen`, the vLLM names a script imports, the CLI's
`--help`, a one-line argument error of a model-loading command (a bad `--kv-cache-memory`),
and `import torch` alone for reference. Every case runs `--repeats` times in rounds; the table
gives the first run (the coldest this script can get: dropping the OS page cache needs root)
and the median and minimum of the others (warm). A second section lists the slowest imports of
`import batchgen` and of `from batchgen import LLM` from `python -X importtime` (cumulative
microseconds; modules nested under a listed one are left out), and whether torch or
transformers' model code was imported at all.

Self-contained on purpose (no benchmarks/common.py): it needs no model and no weights.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/startup.py
    PYTHONPATH=. python benchmarks/startup.py --repeats 9 --top 12 --json startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "import batchgen": ["-c", "import batchgen"],
    "from batchgen import LLM, SamplingParams": [
        "-c", "from batchgen import LLM, SamplingParams"],
    "batchgen --help": ["-m", "batchgen", "--help"],
    "batchgen generate --help": ["-m", "batchgen", "generate", "--help"],
    "batchgen run-batch (bad --kv-cache-memory)": [
        "-m", "batchgen", "run-batch", "-i", __file__, "-o", "/nonexistent-dir/out.jsonl",
        "--model", "/nonexistent-model", "--kv-cache-memory", "4gigs"],
    "import torch (reference)": ["-c", "import torch"],
}
HEAVY = ("torch", "transformers.modeling_utils", "torch.distributed.tensor", "datasets",
         "pyarrow", "ray", "lm_eval", "xgrammar", "flashinfer")
PROBES = {"import batchgen": "import batchgen",
          "from batchgen import LLM": "from batchgen import LLM",
          "batchgen --help": "import sys; sys.argv = ['batchgen', '--help']\n"
                             "from batchgen.cli import main\ntry:\n    main()\n"
                             "except SystemExit:\n    pass"}


def env() -> dict[str, str]:
    """This repository first on the path, no hub access, quiet."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}


def run_once(argv: list[str]) -> float:
    """Seconds from spawn to exit of `python ARGV` (its output discarded)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def time_cases(repeats: int) -> dict[str, list[float]]:
    """Every case `repeats` times, in rounds (so load swings hit every case alike)."""
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(repeats):
        for name, argv in CASES.items():
            times[name].append(run_once(argv))
    return times


def import_profile(code: str, top: int) -> tuple[list[tuple[str, int]], list[str]]:
    """The `top` slowest imports of `code` by cumulative microseconds (a module nested under
    one already listed is skipped), and which HEAVY modules it imported."""
    probe = f"{code}\nimport sys\nprint('MODULES', ' '.join(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", probe], cwd=ROOT,
                          env=env(), capture_output=True, text=True, check=False)
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = (part.strip() for part in line[12:].split("|"))
        rows.append((name, int(cumulative)))
    loaded = next((ln.split()[1:] for ln in proc.stdout.splitlines()
                   if ln.startswith("MODULES")), [])
    picked: list[tuple[str, int]] = []
    for name, us in sorted(rows, key=lambda r: -r[1]):
        if not any(name.startswith(p + ".") for p, _ in picked):
            picked.append((name, us))
        if len(picked) == top:
            break
    return picked, [m for m in HEAVY if m in loaded]


def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """First run, and the median and minimum of the rest (of all runs when there is one)."""
    out = {}
    for name, ts in times.items():
        warm = ts[1:] or ts
        out[name] = {"first_s": ts[0], "warm_median_s": statistics.median(warm),
                     "warm_min_s": min(warm)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="runs of each case")
    ap.add_argument("--top", type=int, default=10, help="slowest imports listed per probe")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"python {sys.version.split()[0]}, {cores} cores, load average {load:.2f} at start, "
          f"{args.repeats} runs per case\n")
    figures = summary(time_cases(args.repeats))
    print("| command | first s | warm median s | warm min s |\n|---|--:|--:|--:|")
    for name, f in figures.items():
        print(f"| `{name}` | {f['first_s']:.2f} | {f['warm_median_s']:.2f} | "
              f"{f['warm_min_s']:.2f} |")
    profiles = {}
    for label, code in PROBES.items():
        picked, heavy = import_profile(code, args.top)
        profiles[label] = {"slowest": picked, "heavy_modules": heavy}
        print(f"\n`{label}` imports {', '.join(heavy) or 'none of ' + ', '.join(HEAVY)}; "
              "slowest (cumulative ms):")
        for name, us in picked:
            print(f"  {us / 1000:8.1f}  {name}")
    if args.json is not None:
        args.json.write_text(json.dumps({"cores": cores, "load": load, "repeats": args.repeats,
                                         "cases": figures, "imports": profiles}, indent=1))


if __name__ == "__main__":
    main()

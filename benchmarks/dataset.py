"""Dataset jobs: `batchgen generate` (the CLI, Parquet shards) vs `LLM.generate` on the same rows.

Issue 11's bars, measured with a random-weight Llama (the other benchmarks' model, plus the
tiny byte-level BPE tokenizer and ``--eos-boost``) on a JSONL file of short English-like
sentences (``prompt``) with one extra column (``topic``):

1. **Throughput.** ``python -m batchgen generate --n N --max-tokens T`` over ``--rows`` rows
   against a minimal script that loads ``LLM``, reads the JSONL with ``json`` and calls
   ``llm.generate`` once on all rows with the same per-row seeded params
   (``batchgen.data.rows.row_params``), the same model and the same engine flags (the two
   processes' KV-pool and attention-backend log lines are checked to be equal). Every process
   is fresh and the systems are interleaved (CLI, script, timed CLI; again ...), best of
   ``--repeats``. Two figures:

   (a) generation phase, model load excluded: the CLI's ``generate_dataset`` call (reading the
       rows, streaming them through the engine, writing and fsyncing the shards, reading them
       back) timed with ``perf_counter`` by a wrapper that runs ``batchgen.cli.main`` in a
       fresh process ("timed CLI"; the real CLI's own summary line, 0.1 s resolution, is
       reported alongside), vs the ``llm.generate(...)`` call of the script;
   (b) whole process: launch to exit of ``python -m batchgen generate ...`` (each run with a
       fresh ``datasets`` cache, so it converts the JSONL to Arrow as on a new input) vs the
       script's process.

   The output tokens must be identical row by row and sample by sample (the seeds are the
   same): every CLI run's shards are read back with pyarrow and compared with the script's
   outputs; a difference is reported loudly and makes the script exit with status 1.
2. **Time to first shard**: from launching ``python -m batchgen generate`` until
   ``part-00000.parquet`` appears in its output folder (polled every 50 ms), with the CLI's
   default rows per shard (256) unless ``--rows-per-shard``. Bar: < 10 s.
3. **Peak RSS** of the CLI over each of ``--rss-rows`` rows (default 1,000 and 100,000; n=1,
   ``--rss-max-tokens`` tokens), each in a fresh process: the child's ``ru_maxrss`` from
   ``os.wait4`` (whole process), and the peak up to the end of ``generate_dataset`` (read in
   the child with ``getrusage``, i.e. without the CLI's summary line). Bar: peak at the largest
   row count < 2x the peak at the smallest.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/dataset.py --json /tmp/dataset_bench.json
    PYTHONPATH=. python benchmarks/dataset.py --rows 200 --rss-rows 100,1000 --repeats 1
    PYTHONPATH=. python benchmarks/dataset.py --skip-rss --profile /tmp/cli.prof  # where the
                                                         # CLI's generation phase spends time
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_model_args,
    add_run_args,
    args_dict,
    fmt_ratio,
    machine_info,
    machine_line,
    markdown_table,
    model_overrides,
    parse_int_list,
    quiet_logging,
    write_json,
)

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.05
FIRST_SHARD = "part-00000.parquet"
FIRST_SHARD_BAR_S = 10.0
RSS_BAR = 2.0
GEN_SLOWDOWN_TOLERANCE = 0.10  # the CLI may be this much slower than LLM.generate
SUMMARY = re.compile(r"batchgen: (\d+) rows, (\d+) samples, (\d+) output tokens in .* "
                     r"\(([\d.]+) s this run\)")

# The user's side of the comparison: load, read the JSONL, one llm.generate call, exit.
MINIMAL_SCRIPT = '''\
import json, sys, time
from batchgen import LLM, SamplingParams
from batchgen.data.rows import row_params

cfg = json.loads(sys.argv[1])
llm = LLM(cfg["model"], **cfg["llm"])
with open(cfg["input"]) as f:
    rows = [json.loads(line) for line in f]
params = SamplingParams(**cfg["params"])
per_row = [row_params(params, cfg["seed"], i) for i in range(len(rows))]
t0 = time.perf_counter()
outs = llm.generate([r[cfg["column"]] for r in rows], per_row, use_tqdm=False)
gen_s = time.perf_counter() - t0
result = {"gen_s": gen_s, "rows": len(outs),
          "samples": sum(len(o.outputs) for o in outs),
          "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
          "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs)}
if cfg["dump"]:
    result["token_ids"] = [[list(c.token_ids) for c in o.outputs] for o in outs]
with open(cfg["result"], "w") as f:
    json.dump(result, f)
'''

# `batchgen.cli.main` with its generate_dataset call timed (and optionally profiled); also the
# peak RSS up to the end of that call.
TIMED_CLI_SCRIPT = '''\
import json, resource, sys, time
import batchgen.data.runner as runner
import batchgen.cli.generate as cli_generate
from batchgen.cli import main

cfg = json.loads(sys.argv[1])
inner = runner.generate_dataset
timing = {"calls": 0}

def timed_generate_dataset(*args, **kwargs):
    profiler = None
    if cfg["profile"]:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    try:
        return inner(*args, **kwargs)
    finally:
        timing["gen_s"] = time.perf_counter() - t0
        timing["calls"] += 1
        timing["rss_after_gen_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(cfg["profile"])

runner.generate_dataset = timed_generate_dataset
if hasattr(cli_generate, "generate_dataset"):  # in case the CLI imports it at module level
    cli_generate.generate_dataset = timed_generate_dataset
rc = main(sys.argv[2:])
with open(cfg["result"], "w") as f:
    json.dump(timing, f)
sys.exit(rc)
'''

WORDS = """the of and a to in is was that for it with as his on be at by this had not are but from
or have an they which one you were her all she there would their we him been has when who will
more no if out so said what up its about into than them can only other new some could time
these two may then do first any my now such like our over man me even most made after also did
many before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long get here
between both life being under never day same another know while last might us great old year
off come since against go came right used take three river garden morning letter window
village forest mountain water light house city road children story music evening question
answer small large early late quiet bright cold warm green blue red white black simple strange
happy careful quick slow ancient modern open close walk read write sing build carry remember
follow begin""".split()
TOPICS = ["travel", "history", "science", "cooking", "sports", "music", "nature", "letters"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p)
    p.add_argument("--eos-boost", type=float, default=0.06,
                   help="make_tiny_model's eos_boost: EOS ends some samples early")
    add_run_args(p)
    p.set_defaults(repeats=3)
    w = p.add_argument_group("workload (part 1: throughput, part 2: first shard)")
    w.add_argument("--rows", type=int, default=2000, help="rows of the JSONL input")
    w.add_argument("--n", type=int, default=4, help="samples per row")
    w.add_argument("--max-tokens", type=int, default=16)
    w.add_argument("--temperature", type=float, default=1.0)
    w.add_argument("--min-words", type=int, default=4, help="words per prompt, at least")
    w.add_argument("--max-words", type=int, default=16, help="words per prompt, at most")
    w.add_argument("--seed", type=int, default=0,
                   help="seeds the weights, the prompts and the job (row seeds derive from it)")
    w.add_argument("--rows-per-shard", type=int, default=None,
                   help="pass --rows-per-shard to the CLI (default: the CLI's own, 256)")
    e = p.add_argument_group("engine (the same flags for the CLI and LLM(...))")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    r = p.add_argument_group("part 3: peak RSS")
    r.add_argument("--rss-rows", default="1000,100000",
                   help="comma-separated row counts, one fresh CLI process each; the bar "
                        "compares the largest with the smallest")
    r.add_argument("--rss-n", type=int, default=1)
    r.add_argument("--rss-max-tokens", type=int, default=4)
    r.add_argument("--skip-rss", action="store_true")
    o = p.add_argument_group("other")
    o.add_argument("--profile", type=Path, default=None, metavar="PATH",
                   help="after the timed runs, one more timed-CLI run with cProfile around "
                        "generate_dataset; stats to PATH, top functions printed")
    o.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds any one child process may run")
    o.add_argument("--verbose", action="store_true", help="print the children's stderr")
    args = p.parse_args(argv)
    for flag in ("rows", "n", "max_tokens", "min_words", "repeats", "rss_n", "rss_max_tokens",
                 "vocab_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.min_words > args.max_words:
        p.error("need --min-words <= --max-words")
    if args.rows_per_shard is not None and args.rows_per_shard < 1:
        p.error("--rows-per-shard must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.device != "cpu":
        print("note: this benchmark was written for CPU; the figures on "
              f"{args.device} also include the device's own start-up", file=sys.stderr)
    args.rss_rows = parse_int_list(p, args.rss_rows, "--rss-rows")
    return args


# ---- inputs ---------------------------------------------------------------------------------
def prepare_model(args: argparse.Namespace, root: Path) -> Path:
    """``--model-dir`` if it holds a config.json, else a random Llama with the tiny BPE
    tokenizer (text prompts need one) written to ``--model-dir`` or under ``root``."""
    from batchgen.tools.make_tiny_model import make_tiny_model

    given = args.model_dir
    if given is not None and (Path(given) / "config.json").is_file():
        return Path(given)
    out = Path(given) if given is not None else root / "model"
    make_tiny_model(out, family="llama", vocab_size=args.vocab_size, seed=args.seed,
                    dtype=_torch_dtype(args.dtype), eos_boost=args.eos_boost,
                    with_tokenizer=True, **model_overrides(args, 1024))
    return out


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def write_jsonl(path: Path, rows: int, args: argparse.Namespace, seed: int) -> None:
    """``rows`` lines of {"prompt": an English-like sentence, "topic": a word}; streamed out,
    deterministic for a seed."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            words = [rng.choice(WORDS) for _ in range(rng.randint(args.min_words, args.max_words))]
            text = " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!"])
            f.write(json.dumps({"prompt": text, "topic": rng.choice(TOPICS)}) + "\n")


# ---- children -------------------------------------------------------------------------------
class Child:
    """A fresh Python process with its stdout/stderr in files, timed from launch to exit."""

    def __init__(self, argv: list[str], env: dict[str, str], logs: Path, name: str) -> None:
        self.name = name
        self.out_path, self.err_path = logs / f"{name}.out", logs / f"{name}.err"
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        self.argv = argv
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._out, stderr=self._err,
                                     stdin=subprocess.DEVNULL)
        self.wall_s: float | None = None
        self.maxrss_kib: int | None = None
        self.cpu_s: float | None = None

    def poll_exited(self) -> bool:
        """Non-blocking: reap the child if it has exited."""
        pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
        if pid == 0:
            return False
        self._reaped(status, usage)
        return True

    def wait(self) -> None:
        """Block until exit (os.wait4, so ru_maxrss is this child's own peak RSS)."""
        if self.wall_s is None:
            _, status, usage = os.wait4(self.proc.pid, 0)
            self._reaped(status, usage)

    def kill(self) -> None:
        """SIGKILL, unless already reaped (not Popen.kill: its poll() would reap the child
        behind os.wait4's back)."""
        if self.wall_s is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def _reaped(self, status: int, usage: Any) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.maxrss_kib = usage.ru_maxrss  # KiB on Linux
        self.cpu_s = usage.ru_utime + usage.ru_stime  # wall >> cpu / threads: machine load
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self._out.close()
        self._err.close()

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def check(self, verbose: bool) -> None:
        if verbose and self.stderr.strip():
            print(f"  [{self.name} stderr]\n" + self.stderr.rstrip(), flush=True)
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                               f"{' '.join(self.argv)}\n--- stderr ---\n{self.stderr[-4000:]}")


def wait_with_timeout(child: Child, timeout: float) -> None:
    """Wait for the child, killing it once ``timeout`` seconds have passed since launch."""
    timer = threading.Timer(max(0.0, child.t0 + timeout - time.perf_counter()), child.kill)
    timer.start()
    try:
        child.wait()
    finally:
        timer.cancel()


class Runner:
    """Launches the three kinds of children with the same model, input and engine flags."""

    def __init__(self, args: argparse.Namespace, root: Path, model: Path) -> None:
        self.args, self.root, self.model = args, root, model
        self.logs = root / "logs"
        self.logs.mkdir()
        self.minimal = root / "minimal_generate.py"
        self.minimal.write_text(MINIMAL_SCRIPT)
        self.timed_cli = root / "timed_cli.py"
        self.timed_cli.write_text(TIMED_CLI_SCRIPT)
        self.count = 0

    def env(self) -> dict[str, str]:
        """Offline, a fresh datasets cache for this child, repository on the path."""
        self.count += 1
        cache = self.root / f"hf-datasets-{self.count}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "TOKENIZERS_PARALLELISM": "false"}
        if self.args.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.args.threads)
        return env

    def drop_caches(self) -> None:
        for d in self.root.glob("hf-datasets-*"):
            shutil.rmtree(d, ignore_errors=True)

    def engine_flags(self) -> list[str]:
        a = self.args
        flags = ["--block-size", str(a.block_size), "--max-num-seqs", str(a.max_num_seqs),
                 "--dtype", a.dtype, "--device", a.device, "--seed", str(a.seed)]
        if a.max_num_batched_tokens is not None:
            flags += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
        if a.num_kv_blocks is not None:
            flags += ["--num-kv-blocks", str(a.num_kv_blocks)]
        if a.no_prefix_caching:
            flags.append("--no-prefix-caching")
        return flags

    def cli_argv(self, data: Path, out: Path, n: int, max_tokens: int) -> list[str]:
        a = self.args
        argv = ["generate", "--model", str(self.model), "--input", str(data), "--n", str(n),
                "--max-tokens", str(max_tokens), "--temperature", repr(a.temperature),
                "--output", str(out), "--quiet", *self.engine_flags()]
        if a.rows_per_shard is not None:
            argv += ["--rows-per-shard", str(a.rows_per_shard)]
        return argv

    def llm_kwargs(self) -> dict[str, Any]:
        """What the CLI passes to LLM(...) for engine_flags() (batchgen/cli/generate.py)."""
        a = self.args
        return {"block_size": a.block_size, "max_num_seqs": a.max_num_seqs,
                "max_num_batched_tokens": a.max_num_batched_tokens,
                "enable_prefix_caching": not a.no_prefix_caching,
                "num_kv_blocks": a.num_kv_blocks, "dtype": a.dtype, "device": a.device,
                "seed": a.seed}

    def launch_cli(self, data: Path, out: Path, name: str) -> Child:
        """The real thing: ``python -m batchgen generate ...``."""
        a = self.args
        return Child([sys.executable, "-m", "batchgen", *self.cli_argv(data, out, a.n,
                                                                        a.max_tokens)],
                     self.env(), self.logs, name)

    def run_timed_cli(self, data: Path, out: Path, name: str, n: int, max_tokens: int,
                      profile: Path | None = None) -> tuple[Child, dict[str, Any]]:
        """Run the timed CLI to its end (checked); its process and the figures it wrote."""
        result = self.root / f"{name}.json"
        cfg = {"result": str(result), "profile": None if profile is None else str(profile)}
        argv = [sys.executable, str(self.timed_cli), json.dumps(cfg),
                *self.cli_argv(data, out, n, max_tokens)]
        child = Child(argv, self.env(), self.logs, name)
        wait_with_timeout(child, self.args.timeout)
        child.check(self.args.verbose)
        return child, read_json(result)

    def launch_minimal(self, data: Path, name: str, dump: bool) -> tuple[Child, Path]:
        a = self.args
        result = self.root / f"{name}.json"
        cfg = {"model": str(self.model), "llm": self.llm_kwargs(), "input": str(data),
               "column": "prompt", "seed": a.seed, "dump": dump, "result": str(result),
               "params": {"n": a.n, "temperature": a.temperature, "max_tokens": a.max_tokens,
                          "seed": a.seed}}
        return Child([sys.executable, str(self.minimal), json.dumps(cfg)], self.env(),
                     self.logs, name), result


def parse_summary(stdout: str) -> dict[str, Any]:
    m = SUMMARY.search(stdout)
    if m is None:
        raise RuntimeError(f"no summary line in the CLI's output:\n{stdout[-2000:]}")
    rows, samples, tokens, secs = m.groups()
    return {"rows": int(rows), "samples": int(samples), "output_tokens": int(tokens),
            "gen_s": float(secs)}


def engine_lines(stderr: str) -> list[str]:
    """The engine's set-up log lines (KV pool, attention backend): equal for a fair race."""
    return [ln.strip() for ln in stderr.splitlines()
            if "KV cache:" in ln or "attention backend:" in ln]


# ---- checking outputs -----------------------------------------------------------------------
def read_shards(out: Path) -> dict[int, dict[str, Any]]:
    """row_id -> {"topic", "num_prompt_tokens", "tokens": [sample token ids by index]}."""
    import pyarrow.parquet as pq

    rows: dict[int, dict[str, Any]] = {}
    files = sorted(out.glob("part-*.parquet"))
    for f in files:
        t = pq.read_table(f, columns=["row_id", "topic", "num_prompt_tokens", "outputs"])
        for rid, topic, npt, outs in zip(*(t.column(c).to_pylist() for c in t.column_names)):
            if rid in rows:
                raise AssertionError(f"{out}: row {rid} is in two shards")
            samples = sorted(outs, key=lambda s: s["index"])
            rows[rid] = {"topic": topic, "num_prompt_tokens": npt,
                         "tokens": [s["token_ids"] for s in samples]}
    return rows


def compare(label: str, got: dict[int, dict[str, Any]], want: list[list[list[int]]],
            topics: list[str]) -> dict[str, Any]:
    """Row-by-row comparison of a CLI run's shards with LLM.generate's tokens."""
    missing = sorted(set(range(len(want))) - set(got))
    extra = sorted(set(got) - set(range(len(want))))
    differ = [i for i in range(len(want)) if i in got and got[i]["tokens"] != want[i]]
    bad_topic = [i for i in range(len(want)) if i in got and got[i]["topic"] != topics[i]]
    res = {"run": label, "rows_checked": len(want), "identical_rows": len(want) - len(missing)
           - len(differ), "missing_rows": missing[:20], "extra_rows": extra[:20],
           "differing_rows": differ[:20], "num_differing_rows": len(differ),
           "extra_column_mismatch": bad_topic[:20],
           "output_tokens": sum(len(s) for r in got.values() for s in r["tokens"]),
           "prompt_tokens": sum(r["num_prompt_tokens"] for r in got.values())}
    if differ:
        i = differ[0]
        res["first_difference"] = {"row": i, "cli": got[i]["tokens"], "llm_generate": want[i]}
    res["ok"] = not (missing or extra or differ or bad_topic)
    return res


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# ---- the three parts ------------------------------------------------------------------------
def run_throughput(args: argparse.Namespace, runner: Runner, data: Path
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Part 1 and 2: interleaved rounds of CLI / minimal script / timed CLI, fresh processes."""
    topics = [json.loads(line)["topic"] for line in data.open()]
    runs: dict[str, list[dict[str, Any]]] = {"cli": [], "minimal": [], "timed_cli": []}
    checks: list[dict[str, Any]] = []
    reference: list[list[list[int]]] | None = None
    for r in range(args.repeats):
        # 1. python -m batchgen generate: whole process, first shard, summary line
        out = runner.root / f"out-cli-{r}"
        child = runner.launch_cli(data, out, f"cli-{r}")
        first_shard_s = None
        while not child.poll_exited():
            if first_shard_s is None and (out / FIRST_SHARD).exists():
                first_shard_s = time.perf_counter() - child.t0
            if first_shard_s is not None:  # nothing more to poll: block until exit
                wait_with_timeout(child, args.timeout)
                break
            if time.perf_counter() - child.t0 > args.timeout:
                child.kill()
            time.sleep(POLL_S)
        child.check(args.verbose)
        if first_shard_s is None and (out / FIRST_SHARD).exists():
            first_shard_s = child.wall_s  # appeared between the last poll and the exit
        summary = parse_summary(child.stdout)
        runs["cli"].append({"process_s": child.wall_s, "cpu_s": child.cpu_s,
                            "summary_gen_s": summary["gen_s"],
                            "first_shard_s": first_shard_s, "maxrss_kib": child.maxrss_kib,
                            "summary": summary, "engine": engine_lines(child.stderr)})
        cli_out = out
        # 2. the minimal LLM.generate script (dumps its tokens in the first round only)
        mchild, mres = runner.launch_minimal(data, f"minimal-{r}", dump=r == 0)
        wait_with_timeout(mchild, args.timeout)
        mchild.check(args.verbose)
        m = read_json(mres)
        if r == 0:
            reference = m.pop("token_ids")
        runs["minimal"].append({"process_s": mchild.wall_s, "cpu_s": mchild.cpu_s,
                                "gen_s": m["gen_s"],
                                "maxrss_kib": mchild.maxrss_kib, "dumped_tokens": r == 0,
                                "engine": engine_lines(mchild.stderr),
                                **{k: m[k] for k in ("rows", "samples", "output_tokens",
                                                     "prompt_tokens")}})
        # 3. the CLI's main() with generate_dataset timed precisely
        tout = runner.root / f"out-timed-{r}"
        tchild, t = runner.run_timed_cli(data, tout, f"timed-cli-{r}", args.n, args.max_tokens)
        if t.get("calls") != 1:
            raise RuntimeError("the timed CLI did not go through batchgen.data.runner."
                               "generate_dataset: update TIMED_CLI_SCRIPT")
        runs["timed_cli"].append({"process_s": tchild.wall_s, "cpu_s": tchild.cpu_s,
                                  "gen_s": t["gen_s"],
                                  "summary": parse_summary(tchild.stdout),
                                  "engine": engine_lines(tchild.stderr)})
        assert reference is not None
        for label, d in ((f"cli-{r}", cli_out), (f"timed-cli-{r}", tout)):
            checks.append(compare(label, read_shards(d), reference, topics))
            shutil.rmtree(d)
        runner.drop_caches()
        c, mm, tt = runs["cli"][-1], runs["minimal"][-1], runs["timed_cli"][-1]
        fs = "-" if c["first_shard_s"] is None else f"{c['first_shard_s']:.2f}"
        print(f"  round {r + 1}/{args.repeats}: CLI process {c['process_s']:.2f} s (cpu "
              f"{c['cpu_s']:.1f} s; summary {c['summary_gen_s']:.1f} s, first shard {fs} s); "
              f"script process {mm['process_s']:.2f} s (cpu {mm['cpu_s']:.1f} s; llm.generate "
              f"{mm['gen_s']:.2f} s); timed CLI generate_dataset {tt['gen_s']:.2f} s", flush=True)
    return runs, checks


def run_rss(args: argparse.Namespace, runner: Runner) -> list[dict[str, Any]]:
    """Part 3: one fresh timed-CLI process per row count; os.wait4's ru_maxrss."""
    out: list[dict[str, Any]] = []
    for rows in args.rss_rows:
        data = runner.root / f"rss-{rows}.jsonl"
        write_jsonl(data, rows, args, args.seed + 1)
        dest = runner.root / f"out-rss-{rows}"
        child, t = runner.run_timed_cli(data, dest, f"rss-{rows}", args.rss_n,
                                        args.rss_max_tokens)
        summary = parse_summary(child.stdout)
        shards = len(list(dest.glob("part-*.parquet")))
        out.append({"rows": rows, "peak_rss_kib": child.maxrss_kib,
                    "peak_rss_through_generate_dataset_kib": t["rss_after_gen_kib"],
                    "process_s": child.wall_s, "cpu_s": child.cpu_s, "gen_s": t["gen_s"],
                    "shards": shards,
                    "summary": summary})
        assert summary["rows"] == rows, f"RSS run over {rows} rows reported {summary['rows']}"
        shutil.rmtree(dest)
        data.unlink()
        runner.drop_caches()
        print(f"  {rows:,} rows: peak RSS {child.maxrss_kib / 1024:,.0f} MiB (through "
              f"generate_dataset {t['rss_after_gen_kib'] / 1024:,.0f} MiB), "
              f"{child.wall_s:.1f} s, {shards} shards", flush=True)
    return out


def run_profile(args: argparse.Namespace, runner: Runner, data: Path) -> list[str]:
    """One more timed-CLI run with cProfile around generate_dataset; the top functions."""
    import io
    import pstats

    dest = runner.root / "out-profile"
    runner.run_timed_cli(data, dest, "profile", args.n, args.max_tokens,
                         profile=args.profile.resolve())
    shutil.rmtree(dest)
    runner.drop_caches()
    buf = io.StringIO()
    pstats.Stats(str(args.profile), stream=buf).sort_stats("cumulative").print_stats(30)
    return buf.getvalue().splitlines()


# ---- main -----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.verbose:
        quiet_logging()  # make_tiny_model's save_pretrained progress bar
    info = machine_info(args.device)
    if args.threads is not None:
        info["torch_threads"] = args.threads  # the children's, through OMP_NUM_THREADS
    payload: dict[str, Any] = {"machine": info, "command": [sys.executable, *sys.argv],
                               "args": args_dict(args)}
    with tempfile.TemporaryDirectory(prefix="batchgen-dataset-bench-") as tmp:
        root = Path(tmp)
        model = prepare_model(args, root)
        runner = Runner(args, root, model)
        data = root / "input.jsonl"
        write_jsonl(data, args.rows, args, args.seed)
        print(f"model: random Llama, hidden {args.hidden_size}, {args.num_layers} layers, "
              f"{args.num_heads}/{args.num_kv_heads} q/kv heads, ffn {args.intermediate_size}, "
              f"vocab {args.vocab_size}, {args.dtype}, eos_boost {args.eos_boost}")
        print(f"workload: {args.rows} rows of {args.min_words}-{args.max_words} words (+ a "
              f"topic column), n={args.n}, max_tokens {args.max_tokens}, temperature "
              f"{args.temperature}, seed {args.seed}; CLI flags: "
              f"{' '.join(runner.cli_argv(Path('IN'), Path('OUT'), args.n, args.max_tokens))}",
              flush=True)
        runs, checks = run_throughput(args, runner, data)
        rss: list[dict[str, Any]] = []
        if not args.skip_rss:
            print("peak RSS:", flush=True)
            rss = run_rss(args, runner)
        profile = run_profile(args, runner, data) if args.profile is not None else None

    # ---- figures ----
    cli, mini, timed = runs["cli"], runs["minimal"], runs["timed_cli"]
    tokens = mini[0]["output_tokens"]
    best = {
        "timed_cli_gen_s": min(x["gen_s"] for x in timed),
        "cli_summary_gen_s": min(x["summary_gen_s"] for x in cli),
        "llm_generate_s": min(x["gen_s"] for x in mini),
        "cli_process_s": min(x["process_s"] for x in cli),
        "minimal_process_s": min(x["process_s"] for x in mini),
    }
    tok_s = {k.removesuffix("_s") + "_output_tok_s": tokens / v if v > 0 else None
             for k, v in best.items()}  # the summary line rounds to 0.1 s: may be 0.0
    first = [x["first_shard_s"] for x in cli if x["first_shard_s"] is not None]
    gen_ratio = best["llm_generate_s"] / best["timed_cli_gen_s"]  # CLI tok/s over generate's
    proc_ratio = best["minimal_process_s"] / best["cli_process_s"]
    summary: dict[str, Any] = {
        "output_tokens": tokens, "prompt_tokens": mini[0]["prompt_tokens"],
        "samples": mini[0]["samples"], **best, **tok_s,
        "generation_phase_cli_over_llm_generate": gen_ratio,
        "generation_phase_cli_slowdown_pct": 100 * (1 / gen_ratio - 1),
        "whole_process_cli_over_script": proc_ratio,
        "whole_process_cli_slowdown_pct": 100 * (1 / proc_ratio - 1),
        "first_shard_s": min(first) if first else None,
        "first_shard_bar_s": FIRST_SHARD_BAR_S,
        "first_shard_bar_met": bool(first) and min(first) < FIRST_SHARD_BAR_S,
        "generation_phase_within_10pct": 1 / gen_ratio - 1 <= GEN_SLOWDOWN_TOLERANCE,
    }
    mismatched = [c for c in checks if not c["ok"]]
    counts_ok = all(x["summary"]["output_tokens"] == tokens for x in cli + timed) and all(
        x["output_tokens"] == tokens for x in mini)
    engines_equal = all(x["engine"] == mini[0]["engine"] for x in cli + mini + timed)
    summary["tokens_identical"] = not mismatched
    summary["token_counts_equal"] = counts_ok
    summary["engine_setup_equal"] = engines_equal
    if rss:
        lo = min(rss, key=lambda x: x["rows"])
        hi = max(rss, key=lambda x: x["rows"])
        summary["rss_ratio"] = hi["peak_rss_kib"] / lo["peak_rss_kib"]
        summary["rss_ratio_through_generate_dataset"] = (
            hi["peak_rss_through_generate_dataset_kib"]
            / lo["peak_rss_through_generate_dataset_kib"])
        summary["rss_bar"] = RSS_BAR
        summary["rss_bar_met"] = summary["rss_ratio"] < RSS_BAR

    # ---- report ----
    rep = f" (best of {args.repeats})" if args.repeats > 1 else ""
    print()
    print(markdown_table(
        ["system", f"generation s{rep}", "output tok/s", f"whole process s{rep}",
         "output tok/s (process)"],
        [["batchgen generate (CLI)", f"{best['timed_cli_gen_s']:.2f}",
          f"{tokens / best['timed_cli_gen_s']:.0f}", f"{best['cli_process_s']:.2f}",
          f"{tokens / best['cli_process_s']:.0f}"],
         ["LLM.generate script", f"{best['llm_generate_s']:.2f}",
          f"{tokens / best['llm_generate_s']:.0f}", f"{best['minimal_process_s']:.2f}",
          f"{tokens / best['minimal_process_s']:.0f}"]]))
    print(f"CLI / LLM.generate output tok/s: generation phase "
          f"{fmt_ratio(best['llm_generate_s'], best['timed_cli_gen_s'])}, whole process "
          f"{fmt_ratio(best['minimal_process_s'], best['cli_process_s'])}")
    print(f"{tokens} output tokens, {mini[0]['samples']} samples, {mini[0]['prompt_tokens']} "
          f"prompt tokens; CLI's own summary line: best {best['cli_summary_gen_s']:.1f} s "
          f"generation")
    within = "within" if summary["generation_phase_within_10pct"] else "OVER"
    print(f"CLI time vs LLM.generate: generation phase "
          f"{summary['generation_phase_cli_slowdown_pct']:+.1f}% ({within} the "
          f"+{GEN_SLOWDOWN_TOLERANCE:.0%} allowed), whole process "
          f"{summary['whole_process_cli_slowdown_pct']:+.1f}%")
    fs = summary["first_shard_s"]
    all_fs = ", ".join("-" if x["first_shard_s"] is None else f"{x['first_shard_s']:.2f}"
                       for x in cli)
    met = "met" if summary["first_shard_bar_met"] else "NOT met"
    print("time to first shard: " + ("never appeared" if fs is None else f"{fs:.2f} s")
          + f" (all runs: {all_fs}); bar < {FIRST_SHARD_BAR_S:.0f} s: {met}")
    if rss:
        print(markdown_table(
            ["rows", "peak RSS MiB (process)", "peak RSS MiB (through generate_dataset)",
             "process s", "shards"],
            [[f"{x['rows']}", f"{x['peak_rss_kib'] / 1024:.0f}",
              f"{x['peak_rss_through_generate_dataset_kib'] / 1024:.0f}",
              f"{x['process_s']:.1f}", f"{x['shards']}"] for x in rss]))
        print(f"peak RSS {hi['rows']:,} / {lo['rows']:,} rows: {summary['rss_ratio']:.2f}x "
              f"(through generate_dataset {summary['rss_ratio_through_generate_dataset']:.2f}x);"
              f" bar < {RSS_BAR:.0f}x: {'met' if summary['rss_bar_met'] else 'NOT met'}")
    ok_runs = sum(c["ok"] for c in checks)
    print(f"tokens: {ok_runs}/{len(checks)} CLI runs identical to LLM.generate row by row; "
          f"token counts equal: {counts_ok}; engine set-up equal: {engines_equal}")
    if mismatched:
        bar = "!" * 78
        print(f"\n{bar}\nMISMATCH: the CLI's tokens differ from LLM.generate's with the same "
              f"row seeds (a bug):", file=sys.stderr)
        for c in mismatched:
            print(f"  {c['run']}: {c['num_differing_rows']} rows differ (first {c['differing_rows'][:5]}),"
                  f" missing {c['missing_rows'][:5]}, extra {c['extra_rows'][:5]}, extra column "
                  f"wrong {c['extra_column_mismatch'][:5]}; first difference "
                  f"{c.get('first_difference')}", file=sys.stderr)
        print(bar, file=sys.stderr)
    if not engines_equal:
        print("WARNING: the processes set the engine up differently:", file=sys.stderr)
        for x in cli + mini + timed:
            print(f"  {x['engine']}", file=sys.stderr)
    if profile is not None:
        print(f"\ncProfile of one CLI generate_dataset call ({args.profile}):")
        print("\n".join(profile))
    print(machine_line(info))

    payload.update({"summary": summary, "runs": runs, "token_checks": checks, "rss": rss,
                    "cli_command": ["python", "-m", "batchgen",
                                    *runner.cli_argv(Path("INPUT.jsonl"), Path("OUT"), args.n,
                                                     args.max_tokens)]})
    if args.json is not None:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    if mismatched or not counts_ok:
        raise SystemExit(1)
    return payload


if __name__ == "__main__":
    main()

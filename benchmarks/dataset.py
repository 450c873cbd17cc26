"""Dataset jobs: `batchgen generate` (the CLI, Parquet shards) vs `LLM.generate` on the same rows.

Issue 11's bars, on the benchmarks' random Llama with the tiny BPE tokenizer and
``--eos-boost``, over a JSONL of English-like sentences (``prompt``) and a ``topic`` column:

1. **Throughput**: ``python -m batchgen generate --n N --max-tokens T`` over ``--rows`` rows vs a
   minimal script (load ``LLM``, read the JSONL, one ``llm.generate`` with the same per-row
   seeded params, model and engine flags; both processes' KV-pool and backend log lines checked
   equal). Fresh processes, interleaved (CLI, script, timed CLI; again), best of ``--repeats``:
   (a) generation phase: the CLI's ``generate_dataset`` call timed in a wrapper around
   ``batchgen.cli.main`` ("timed CLI"; the CLI's own 0.1 s summary alongside) vs the script's
   ``llm.generate``; (b) whole process, launch to exit (a fresh ``datasets`` cache each). Every
   CLI run's shards must hold the script's tokens row by row and sample by sample, else exit 1.
2. **Time to first shard**: launch until ``part-00000.parquet`` appears (polled every 50 ms).
   Bar: < 10 s.
3. **Peak RSS** over each of ``--rss-rows`` rows (n=1, ``--rss-max-tokens``), a fresh process
   each: ``ru_maxrss`` from ``os.wait4``, and up to the end of ``generate_dataset``. Bar: the
   largest row count's peak < 2x the smallest's.

    PYTHONPATH=. python benchmarks/dataset.py --json /tmp/dataset_bench.json
    PYTHONPATH=. python benchmarks/dataset.py --rows 200 --rss-rows 100,1000 --repeats 1
    PYTHONPATH=. python benchmarks/dataset.py --skip-rss --profile /tmp/cli.prof
"""

from __future__ import annotations

import io
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common as h  # noqa: E402

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


def parse_args(argv: list[str] | None = None) -> Any:
    p = h.parser(__doc__)
    h.add_model_args(p)
    p.add_argument("--eos-boost", type=float, default=0.06,
                   help="make_tiny_model's eos_boost: EOS ends some samples early")
    h.add_run_args(p, repeats=3, verbose=True)
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
    h.add_engine_args(p, max_num_batched_tokens=None)
    p.add_argument("--no-prefix-caching", action="store_true")
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
    args = h.check_args(p, p.parse_args(argv), "rows", "n", "max_tokens", "min_words", "rss_n",
                        "rss_max_tokens", "rows_per_shard")
    if args.min_words > args.max_words:
        p.error("need --min-words <= --max-words")
    if args.device != "cpu":
        print("note: this benchmark was written for CPU; the figures on "
              f"{args.device} also include the device's own start-up", file=sys.stderr)
    args.rss_rows = h.parse_int_list(p, args.rss_rows, "--rss-rows")
    return args


def write_jsonl(path: Path, rows: int, args: Any, seed: int) -> None:
    """``rows`` lines of {"prompt": an English-like sentence, "topic": a word}; seeded."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            words = [rng.choice(WORDS) for _ in range(rng.randint(args.min_words, args.max_words))]
            text = " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!"])
            f.write(json.dumps({"prompt": text, "topic": rng.choice(TOPICS)}) + "\n")


class Runner:
    """Launches the three kinds of children with the same model, input and engine flags."""

    def __init__(self, args: Any, root: Path, model: Path) -> None:
        self.args, self.root, self.model, self.count = args, root, model, 0
        (root / "logs").mkdir()
        (root / "minimal_generate.py").write_text(MINIMAL_SCRIPT)
        (root / "timed_cli.py").write_text(TIMED_CLI_SCRIPT)

    def child(self, argv: list[str], name: str) -> h.Child:
        """A fresh process: offline, its own datasets cache, the torch threads of --threads."""
        self.count += 1
        env = {"HF_DATASETS_CACHE": str(self.root / f"hf-datasets-{self.count}")}
        if self.args.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.args.threads)
        return h.Child(argv, h.child_env(**env), self.root / "logs" / f"{name}.log")

    def finish(self, child: h.Child) -> str:
        """Wait for the child (killed after --timeout), check it; its output."""
        child.wait(self.args.timeout)
        if self.args.verbose:
            print(f"  [{' '.join(child.argv[:3])} output]\n{child.output.rstrip()}", flush=True)
        child.check()
        return child.output

    def drop_caches(self) -> None:
        for d in self.root.glob("hf-datasets-*"):
            shutil.rmtree(d, ignore_errors=True)

    def cli_argv(self, data: Path, out: Path, n: int, max_tokens: int) -> list[str]:
        a = self.args
        argv = ["generate", "--model", str(self.model), "--input", str(data), "--n", str(n),
                "--max-tokens", str(max_tokens), "--temperature", repr(a.temperature),
                "--output", str(out), "--quiet", "--block-size", str(a.block_size),
                "--max-num-seqs", str(a.max_num_seqs), "--dtype", a.dtype, "--device", a.device,
                "--seed", str(a.seed)]
        for flag in ("max_num_batched_tokens", "num_kv_blocks", "rows_per_shard"):
            if getattr(a, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
        return argv + ["--no-prefix-caching"] * a.no_prefix_caching

    def launch_cli(self, data: Path, out: Path, name: str) -> h.Child:
        """The real thing: ``python -m batchgen generate ...``."""
        return self.child([sys.executable, "-m", "batchgen", *self.cli_argv(
            data, out, self.args.n, self.args.max_tokens)], name)

    def timed_cli(self, data: Path, out: Path, name: str, n: int, max_tokens: int,
                  profile: Path | None = None) -> tuple[h.Child, str, dict[str, Any]]:
        """The timed CLI, run to its end: its process, output and the figures it wrote."""
        result = self.root / f"{name}.json"
        cfg = {"result": str(result), "profile": None if profile is None else str(profile)}
        child = self.child([sys.executable, str(self.root / "timed_cli.py"), json.dumps(cfg),
                            *self.cli_argv(data, out, n, max_tokens)], name)
        return child, self.finish(child), json.loads(result.read_text())

    def minimal(self, data: Path, name: str, dump: bool) -> tuple[h.Child, str, dict[str, Any]]:
        """The LLM.generate script (what the CLI passes to LLM(...) for its flags), run."""
        a, result = self.args, self.root / f"{name}.json"
        cfg = {"model": str(self.model), "input": str(data), "column": "prompt", "seed": a.seed,
               "dump": dump, "result": str(result), "llm": h.engine_kwargs(
                   a, enable_prefix_caching=not a.no_prefix_caching),
               "params": {"n": a.n, "temperature": a.temperature, "max_tokens": a.max_tokens,
                          "seed": a.seed}}
        child = self.child([sys.executable, str(self.root / "minimal_generate.py"),
                            json.dumps(cfg)], name)
        return child, self.finish(child), json.loads(result.read_text())


def parse_summary(output: str) -> dict[str, Any]:
    m = SUMMARY.search(output)
    if m is None:
        raise RuntimeError(f"no summary line in the CLI's output:\n{output[-2000:]}")
    rows, samples, tokens, secs = m.groups()
    return {"rows": int(rows), "samples": int(samples), "output_tokens": int(tokens),
            "gen_s": float(secs)}


def engine_lines(output: str) -> list[str]:
    """The engine's set-up log lines (KV pool, attention backend): equal for a fair race."""
    return [ln.strip() for ln in output.splitlines()
            if "KV cache:" in ln or "attention backend:" in ln]


def compare(label: str, out: Path, want: list[list[list[int]]], topics: list[str]
            ) -> dict[str, Any]:
    """Row-by-row comparison of a CLI run's shards with LLM.generate's tokens."""
    import pyarrow.parquet as pq

    got: dict[int, dict[str, Any]] = {}
    for f in sorted(out.glob("part-*.parquet")):
        t = pq.read_table(f, columns=["row_id", "topic", "num_prompt_tokens", "outputs"])
        for rid, topic, npt, outs in zip(*(t.column(c).to_pylist() for c in t.column_names)):
            assert rid not in got, f"{out}: row {rid} is in two shards"
            got[rid] = {"topic": topic, "num_prompt_tokens": npt, "tokens": [
                s["token_ids"] for s in sorted(outs, key=lambda s: s["index"])]}
    missing = sorted(set(range(len(want))) - set(got))
    extra = sorted(set(got) - set(range(len(want))))
    differ = [i for i in range(len(want)) if i in got and got[i]["tokens"] != want[i]]
    bad_topic = [i for i in range(len(want)) if i in got and got[i]["topic"] != topics[i]]
    res = {"run": label, "rows_checked": len(want), "identical_rows": len(want) - len(missing)
           - len(differ), "missing_rows": missing[:20], "extra_rows": extra[:20],
           "differing_rows": differ[:20], "num_differing_rows": len(differ),
           "extra_column_mismatch": bad_topic[:20],
           "output_tokens": sum(len(s) for r in got.values() for s in r["tokens"]),
           "prompt_tokens": sum(r["num_prompt_tokens"] for r in got.values()),
           "ok": not (missing or extra or differ or bad_topic)}
    if differ:
        i = differ[0]
        res["first_difference"] = {"row": i, "cli": got[i]["tokens"], "llm_generate": want[i]}
    shutil.rmtree(out)
    return res


# ---- the three parts ------------------------------------------------------------------------
def run_throughput(args: Any, runner: Runner, data: Path
                   ) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Parts 1 and 2: interleaved rounds of CLI / minimal script / timed CLI, fresh processes."""
    topics = [json.loads(line)["topic"] for line in data.open()]
    runs: dict[str, list[dict[str, Any]]] = {"cli": [], "minimal": [], "timed_cli": []}
    checks: list[dict[str, Any]] = []
    reference: list[list[list[int]]] = []
    for r in range(args.repeats):
        # 1. python -m batchgen generate: whole process, first shard, summary line
        out = runner.root / f"out-cli-{r}"
        child, first_shard_s = runner.launch_cli(data, out, f"cli-{r}"), None
        while first_shard_s is None and not child.poll():
            if (out / FIRST_SHARD).exists():
                first_shard_s = time.perf_counter() - child.t0
            elif time.perf_counter() - child.t0 > args.timeout:
                child.kill()
            time.sleep(POLL_S)
        output = runner.finish(child)
        if first_shard_s is None and (out / FIRST_SHARD).exists():
            first_shard_s = child.wall_s  # appeared between the last poll and the exit
        summary = parse_summary(output)
        runs["cli"].append({"process_s": child.wall_s, "cpu_s": child.cpu_s,
                            "summary_gen_s": summary["gen_s"], "first_shard_s": first_shard_s,
                            "maxrss_kib": child.maxrss_kib, "summary": summary,
                            "engine": engine_lines(output)})
        # 2. the minimal LLM.generate script (dumps its tokens in the first round only)
        mchild, output, m = runner.minimal(data, f"minimal-{r}", dump=r == 0)
        if r == 0:
            reference = m.pop("token_ids")
        runs["minimal"].append({"process_s": mchild.wall_s, "cpu_s": mchild.cpu_s,
                                "maxrss_kib": mchild.maxrss_kib, "dumped_tokens": r == 0,
                                "engine": engine_lines(output), **m})
        # 3. the CLI's main() with generate_dataset timed precisely
        tout = runner.root / f"out-timed-{r}"
        tchild, output, t = runner.timed_cli(data, tout, f"timed-cli-{r}", args.n,
                                             args.max_tokens)
        if t.get("calls") != 1:
            raise RuntimeError("the timed CLI did not go through batchgen.data.runner."
                               "generate_dataset: update TIMED_CLI_SCRIPT")
        runs["timed_cli"].append({"process_s": tchild.wall_s, "cpu_s": tchild.cpu_s,
                                  "gen_s": t["gen_s"], "summary": parse_summary(output),
                                  "engine": engine_lines(output)})
        checks += [compare(f"cli-{r}", out, reference, topics),
                   compare(f"timed-cli-{r}", tout, reference, topics)]
        runner.drop_caches()
        c, mm, tt = runs["cli"][-1], runs["minimal"][-1], runs["timed_cli"][-1]
        fs = "-" if c["first_shard_s"] is None else f"{c['first_shard_s']:.2f}"
        print(f"  round {r + 1}/{args.repeats}: CLI process {c['process_s']:.2f} s (cpu "
              f"{c['cpu_s']:.1f} s; summary {c['summary_gen_s']:.1f} s, first shard {fs} s); "
              f"script process {mm['process_s']:.2f} s (cpu {mm['cpu_s']:.1f} s; llm.generate "
              f"{mm['gen_s']:.2f} s); timed CLI generate_dataset {tt['gen_s']:.2f} s", flush=True)
    return runs, checks


def run_rss(args: Any, runner: Runner) -> list[dict[str, Any]]:
    """Part 3: one fresh timed-CLI process per row count; os.wait4's ru_maxrss."""
    out: list[dict[str, Any]] = []
    for rows in args.rss_rows:
        data, dest = runner.root / f"rss-{rows}.jsonl", runner.root / f"out-rss-{rows}"
        write_jsonl(data, rows, args, args.seed + 1)
        child, output, t = runner.timed_cli(data, dest, f"rss-{rows}", args.rss_n,
                                            args.rss_max_tokens)
        summary = parse_summary(output)
        assert summary["rows"] == rows, f"RSS run over {rows} rows reported {summary['rows']}"
        out.append({"rows": rows, "peak_rss_kib": child.maxrss_kib,
                    "peak_rss_through_generate_dataset_kib": t["rss_after_gen_kib"],
                    "process_s": child.wall_s, "cpu_s": child.cpu_s, "gen_s": t["gen_s"],
                    "shards": len(list(dest.glob("part-*.parquet"))), "summary": summary})
        shutil.rmtree(dest)
        data.unlink()
        runner.drop_caches()
        print(f"  {rows:,} rows: peak RSS {child.maxrss_kib / 1024:,.0f} MiB (through "
              f"generate_dataset {t['rss_after_gen_kib'] / 1024:,.0f} MiB), "
              f"{child.wall_s:.1f} s, {out[-1]['shards']} shards", flush=True)
    return out


def run_profile(args: Any, runner: Runner, data: Path) -> list[str]:
    """One more timed-CLI run with cProfile around generate_dataset; the top functions."""
    import pstats

    dest = runner.root / "out-profile"
    runner.timed_cli(data, dest, "profile", args.n, args.max_tokens,
                     profile=args.profile.resolve())
    shutil.rmtree(dest)
    buf = io.StringIO()
    pstats.Stats(str(args.profile), stream=buf).sort_stats("cumulative").print_stats(30)
    return buf.getvalue().splitlines()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    info = h.start(args)  # its --threads: the children's, through OMP_NUM_THREADS
    with tempfile.TemporaryDirectory(prefix="batchgen-dataset-bench-") as tmp, \
            h.prepare_model_dir(args, 1024, tokenizer=True, eos_boost=args.eos_boost) as model:
        runner, data = Runner(args, Path(tmp), model), Path(tmp) / "input.jsonl"
        write_jsonl(data, args.rows, args, args.seed)
        print(h.model_line(args) + f", eos_boost {args.eos_boost}")
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
        cli_command = ["python", "-m", "batchgen", *runner.cli_argv(
            Path("INPUT.jsonl"), Path("OUT"), args.n, args.max_tokens)]

    # ---- figures
    cli, mini, timed = runs["cli"], runs["minimal"], runs["timed_cli"]
    tokens = mini[0]["output_tokens"]
    best = {"timed_cli_gen_s": min(x["gen_s"] for x in timed),
            "cli_summary_gen_s": min(x["summary_gen_s"] for x in cli),
            "llm_generate_s": min(x["gen_s"] for x in mini),
            "cli_process_s": min(x["process_s"] for x in cli),
            "minimal_process_s": min(x["process_s"] for x in mini)}
    first = [x["first_shard_s"] for x in cli if x["first_shard_s"] is not None]
    gen_ratio = best["llm_generate_s"] / best["timed_cli_gen_s"]  # CLI tok/s over generate's
    proc_ratio = best["minimal_process_s"] / best["cli_process_s"]
    mismatched = [c for c in checks if not c["ok"]]
    summary: dict[str, Any] = {
        "output_tokens": tokens, "prompt_tokens": mini[0]["prompt_tokens"],
        "samples": mini[0]["samples"], **best,
        # the summary line rounds to 0.1 s: may be 0.0
        **{k.removesuffix("_s") + "_output_tok_s": tokens / v if v > 0 else None
           for k, v in best.items()},
        "generation_phase_cli_over_llm_generate": gen_ratio,
        "generation_phase_cli_slowdown_pct": 100 * (1 / gen_ratio - 1),
        "whole_process_cli_over_script": proc_ratio,
        "whole_process_cli_slowdown_pct": 100 * (1 / proc_ratio - 1),
        "first_shard_s": min(first) if first else None, "first_shard_bar_s": FIRST_SHARD_BAR_S,
        "first_shard_bar_met": bool(first) and min(first) < FIRST_SHARD_BAR_S,
        "generation_phase_within_10pct": 1 / gen_ratio - 1 <= GEN_SLOWDOWN_TOLERANCE,
        "tokens_identical": not mismatched,
        "token_counts_equal": all(x["summary"]["output_tokens"] == tokens for x in cli + timed)
        and all(x["output_tokens"] == tokens for x in mini),
        "engine_setup_equal": all(x["engine"] == mini[0]["engine"] for x in cli + mini + timed)}
    if rss:
        lo, hi = min(rss, key=lambda x: x["rows"]), max(rss, key=lambda x: x["rows"])
        summary.update(rss_ratio=hi["peak_rss_kib"] / lo["peak_rss_kib"], rss_bar=RSS_BAR,
                       rss_ratio_through_generate_dataset=(
                           hi["peak_rss_through_generate_dataset_kib"]
                           / lo["peak_rss_through_generate_dataset_kib"]))
        summary["rss_bar_met"] = summary["rss_ratio"] < RSS_BAR

    # ---- report
    rep = f" (best of {args.repeats})" if args.repeats > 1 else ""
    print()
    print(h.markdown_table(
        ["system", f"generation s{rep}", "output tok/s", f"whole process s{rep}",
         "output tok/s (process)"],
        [[name, f"{best[gen]:.2f}", f"{tokens / best[gen]:.0f}", f"{best[proc]:.2f}",
          f"{tokens / best[proc]:.0f}"] for name, gen, proc in (
            ("batchgen generate (CLI)", "timed_cli_gen_s", "cli_process_s"),
            ("LLM.generate script", "llm_generate_s", "minimal_process_s"))]))
    print(f"CLI / LLM.generate output tok/s: generation phase "
          f"{h.fmt_ratio(best['llm_generate_s'], best['timed_cli_gen_s'])}, whole process "
          f"{h.fmt_ratio(best['minimal_process_s'], best['cli_process_s'])}")
    print(f"{tokens} output tokens, {mini[0]['samples']} samples, {mini[0]['prompt_tokens']} "
          f"prompt tokens; CLI's own summary line: best {best['cli_summary_gen_s']:.1f} s "
          f"generation")
    print(f"CLI time vs LLM.generate: generation phase "
          f"{summary['generation_phase_cli_slowdown_pct']:+.1f}% "
          f"({'within' if summary['generation_phase_within_10pct'] else 'OVER'} the "
          f"+{GEN_SLOWDOWN_TOLERANCE:.0%} allowed), whole process "
          f"{summary['whole_process_cli_slowdown_pct']:+.1f}%")
    fs = summary["first_shard_s"]
    all_fs = ", ".join("-" if x["first_shard_s"] is None else f"{x['first_shard_s']:.2f}"
                       for x in cli)
    print("time to first shard: " + ("never appeared" if fs is None else f"{fs:.2f} s")
          + f" (all runs: {all_fs}); bar < {FIRST_SHARD_BAR_S:.0f} s: "
          + ("met" if summary["first_shard_bar_met"] else "NOT met"))
    if rss:
        print(h.markdown_table(
            ["rows", "peak RSS MiB (process)", "peak RSS MiB (through generate_dataset)",
             "process s", "shards"],
            [[f"{x['rows']}", f"{x['peak_rss_kib'] / 1024:.0f}",
              f"{x['peak_rss_through_generate_dataset_kib'] / 1024:.0f}",
              f"{x['process_s']:.1f}", f"{x['shards']}"] for x in rss]))
        print(f"peak RSS {hi['rows']:,} / {lo['rows']:,} rows: {summary['rss_ratio']:.2f}x "
              f"(through generate_dataset {summary['rss_ratio_through_generate_dataset']:.2f}x);"
              f" bar < {RSS_BAR:.0f}x: {'met' if summary['rss_bar_met'] else 'NOT met'}")
    print(f"tokens: {len(checks) - len(mismatched)}/{len(checks)} CLI runs identical to "
          f"LLM.generate row by row; token counts equal: {summary['token_counts_equal']}; "
          f"engine set-up equal: {summary['engine_setup_equal']}")
    if mismatched:
        print(f"\n{'!' * 78}\nMISMATCH: the CLI's tokens differ from LLM.generate's with the "
              "same row seeds (a bug):", file=sys.stderr)
        for c in mismatched:
            print(f"  {c['run']}: {c['num_differing_rows']} rows differ (first "
                  f"{c['differing_rows'][:5]}), missing {c['missing_rows'][:5]}, extra "
                  f"{c['extra_rows'][:5]}, extra column wrong {c['extra_column_mismatch'][:5]}; "
                  f"first difference {c.get('first_difference')}", file=sys.stderr)
        print("!" * 78, file=sys.stderr)
    if not summary["engine_setup_equal"]:
        print("WARNING: the processes set the engine up differently:", file=sys.stderr)
        for x in cli + mini + timed:
            print(f"  {x['engine']}", file=sys.stderr)
    if profile is not None:
        print(f"\ncProfile of one CLI generate_dataset call ({args.profile}):")
        print("\n".join(profile))
    payload = h.finish(args, info, {"command": [sys.executable, *sys.argv], "summary": summary,
                                    "runs": runs, "token_checks": checks, "rss": rss,
                                    "cli_command": cli_command}, note=None)
    if mismatched or not summary["token_counts_equal"]:
        raise SystemExit(1)
    return payload


if __name__ == "__main__":
    main()

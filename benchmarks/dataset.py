"""Dataset jobs: `batchgen generate` (the CLI, Parquet shards) vs `LLM.generate` on the same rows.

Issue 11's bars, on the benchmarks' random Llama with the tiny BPE tokenizer and
``--eos-boost``, over a JSONL of English-like sentences of 4-16 words (``prompt``) and a
``topic`` column; n=``--n``, temperature 1. Fresh processes, interleaved (CLI, script, timed
CLI; again), best of ``--repeats``:

1. **Throughput**: ``python -m batchgen generate`` vs a minimal script (load ``LLM``, read the
   JSONL, one ``llm.generate`` with the same per-row seeded params and engine flags; every
   process's KV-pool and backend log lines checked equal): (a) generation phase: the CLI's
   ``generate_dataset`` call timed in a wrapper around ``batchgen.cli.main`` ("timed CLI"; the
   CLI's own 0.1 s summary beside it) vs the script's ``llm.generate``; (b) whole process,
   launch to exit (a fresh ``datasets`` cache each). Every CLI run's shards must hold the
   script's tokens row by row and sample by sample (and the topic column), else exit 1.
2. **Time to first shard**: launch until ``part-00000.parquet`` appears. Bar: < 10 s.
3. **Peak RSS** over each of ``--rss-rows`` rows (n=1, ``--rss-max-tokens``), a fresh timed CLI
   each: ``ru_maxrss`` from ``os.wait4``, and up to the end of ``generate_dataset``. Bar: the
   largest row count's peak < 2x the smallest's.

    PYTHONPATH=. python benchmarks/dataset.py --json /tmp/dataset_bench.json
"""

import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common as h

FIRST_SHARD, FIRST_SHARD_BAR_S, RSS_BAR = "part-00000.parquet", 10.0, 2.0
GEN_TOLERANCE = 0.10  # the CLI's generation phase may be this much slower than LLM.generate
TOPICS = ["travel", "history", "science", "cooking", "sports", "music", "nature", "letters"]
SUMMARY = re.compile(r"batchgen: (\d+) rows, (\d+) samples, (\d+) output tokens in .* "
                     r"\(([\d.]+) s this run\)")


# ---- the children: this file with --child KIND CFG [CLI ARGS] ------------------------------
def child_minimal(cfg: dict) -> int:
    """What a user would write: load, read the JSONL, one llm.generate call (timed), exit."""
    from batchgen import LLM, SamplingParams
    from batchgen.data.rows import row_params

    llm = LLM(cfg["model"], **cfg["llm"])
    with open(cfg["input"]) as f:
        rows = [json.loads(line) for line in f]
    params = SamplingParams(**cfg["params"])
    per_row = [row_params(params, cfg["seed"], i) for i in range(len(rows))]
    t0 = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in rows], per_row, use_tqdm=False)
    result = {"gen_s": time.perf_counter() - t0, "samples": sum(len(o.outputs) for o in outs),
              "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
              "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs)}
    if cfg["dump"]:
        result["token_ids"] = [[list(c.token_ids) for c in o.outputs] for o in outs]
    Path(cfg["result"]).write_text(json.dumps(result))
    return 0


def child_timed_cli(cfg: dict, argv: list[str]) -> int:
    """``batchgen.cli.main(argv)`` with its generate_dataset call timed, and the peak RSS up to
    that call's end."""
    import resource

    import batchgen.data.runner as runner
    from batchgen.cli import main

    inner, timing = runner.generate_dataset, {"calls": 0}

    def timed_generate_dataset(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            timing.update(gen_s=time.perf_counter() - t0, calls=timing["calls"] + 1,
                          rss_after_gen_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)

    runner.generate_dataset = timed_generate_dataset
    rc = main(argv)
    Path(cfg["result"]).write_text(json.dumps(timing))
    return rc


# ---- the parent -----------------------------------------------------------------------------
def launch(args, root: Path, argv: list[str], name: str) -> h.Child:
    """A fresh process: offline, its own datasets cache, the torch threads of --threads."""
    env = {"HF_DATASETS_CACHE": str(root / f"hf-datasets-{name}")}
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return h.Child([sys.executable, *argv], h.child_env(**env), root / f"{name}.log")


def finish_child(child: h.Child, args, root: Path, name: str) -> str:
    """Its output once it exited with 0 (killed after --timeout); its datasets cache gone."""
    output = child.check(args.timeout)
    shutil.rmtree(root / f"hf-datasets-{name}", ignore_errors=True)
    return output


def run_child(args, root: Path, name: str, kind: str, cfg: dict, argv: list[str] = ()
              ) -> tuple[h.Child, str, dict]:
    """This file as a ``kind`` child, run to its end: its process, output and figures."""
    cfg = {**cfg, "result": str(root / f"{name}.json")}
    child = launch(args, root, [__file__, "--child", kind, json.dumps(cfg), *argv], name)
    output = finish_child(child, args, root, name)
    return child, output, json.loads(Path(cfg["result"]).read_text())


def cli_argv(args, data: Path, out: Path, n: int, max_tokens: int) -> list[str]:
    argv = ["generate", "--model", str(args.model), "--input", str(data), "--n", str(n),
            "--max-tokens", str(max_tokens), "--temperature", "1.0", "--output", str(out),
            "--quiet", "--block-size", str(args.block_size), "--max-num-seqs",
            str(args.max_num_seqs), "--dtype", args.dtype, "--device", args.device,
            "--seed", str(args.seed)]
    for flag in ("max_num_batched_tokens", "num_kv_blocks", "rows_per_shard"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + ["--no-prefix-caching"] * args.no_prefix_caching


def timed_cli(args, root: Path, data: Path, name: str, n: int, max_tokens: int
              ) -> tuple[h.Child, str, dict, Path]:
    out = root / f"out-{name}"
    child, output, t = run_child(args, root, name, "timed-cli", {},
                                 cli_argv(args, data, out, n, max_tokens))
    if t["calls"] != 1:
        raise RuntimeError("the timed CLI did not go through batchgen.data.runner."
                           "generate_dataset: update child_timed_cli")
    return child, output, {**t, "summary": parse_summary(output)}, out


def parse_summary(output: str) -> dict:
    m = SUMMARY.search(output)
    if m is None:
        raise RuntimeError(f"no summary line in the CLI's output:\n{output[-2000:]}")
    return dict(zip(("rows", "samples", "output_tokens"), map(int, m.groups()[:3])),
                gen_s=float(m.group(4)))


def engine_lines(output: str) -> list[str]:
    """The engine's set-up log lines (KV pool, attention backend): equal for a fair race."""
    return [ln.strip() for ln in output.splitlines()
            if "KV cache:" in ln or "attention backend:" in ln]


def compare(label: str, out: Path, want: list[list[list[int]]], topics: list[str]) -> dict:
    """A CLI run's shards against LLM.generate's tokens and the input's topics, row by row."""
    import pyarrow.parquet as pq

    got = {}
    for f in sorted(out.glob("part-*.parquet")):
        for row in pq.read_table(f, columns=["row_id", "topic", "outputs"]).to_pylist():
            assert row["row_id"] not in got, f"{out}: row {row['row_id']} is in two shards"
            got[row["row_id"]] = (row["topic"], [s["token_ids"] for s in sorted(
                row["outputs"], key=lambda s: s["index"])])
    ref = {i: (topic, toks) for i, (topic, toks) in enumerate(zip(topics, want))}
    differ = sorted(i for i in set(got) | set(ref) if got.get(i) != ref.get(i))
    shutil.rmtree(out)
    first = {"row": differ[0], "cli": got.get(differ[0]),
             "llm_generate": ref.get(differ[0])} if differ else None
    return {"run": label, "rows_checked": len(ref), "num_differing_rows": len(differ),
            "differing_rows": differ[:20], "ok": not differ, "first_difference": first}


def run_round(args, root: Path, data: Path, r: int, runs: dict, checks: list, ref: list) -> None:
    """CLI (polled for its first shard), minimal script, timed CLI; the shards checked."""
    out = root / f"out-cli-{r}"
    child, first = launch(args, root, ["-m", "batchgen", *cli_argv(
        args, data, out, args.n, args.max_tokens)], f"cli-{r}"), None
    while first is None and not child.poll():
        if (out / FIRST_SHARD).exists():
            first = time.perf_counter() - child.t0
        elif time.perf_counter() - child.t0 > args.timeout:
            child.kill()
        time.sleep(0.05)
    output = finish_child(child, args, root, f"cli-{r}")
    if first is None and (out / FIRST_SHARD).exists():
        first = child.wall_s  # appeared between the last poll and the exit
    runs["cli"].append({"process_s": child.wall_s, "cpu_s": child.cpu_s, "first_shard_s": first,
                        "maxrss_kib": child.maxrss_kib, "summary": parse_summary(output),
                        "engine": engine_lines(output)})
    cfg = {"model": str(args.model), "input": str(data), "seed": args.seed, "dump": r == 0,
           "llm": h.engine_kwargs(args, enable_prefix_caching=not args.no_prefix_caching),
           "params": {"n": args.n, "temperature": 1.0, "max_tokens": args.max_tokens,
                      "seed": args.seed}}
    mchild, output, m = run_child(args, root, f"minimal-{r}", "minimal", cfg)
    ref += m.pop("token_ids", [])  # the first round's tokens: the reference
    runs["minimal"].append({"process_s": mchild.wall_s, "cpu_s": mchild.cpu_s,
                            "engine": engine_lines(output), **m})
    tchild, output, t, tout = timed_cli(args, root, data, f"timed-cli-{r}", args.n,
                                        args.max_tokens)
    runs["timed_cli"].append({"process_s": tchild.wall_s, "cpu_s": tchild.cpu_s,
                              "engine": engine_lines(output), **t})
    topics = [json.loads(line)["topic"] for line in data.open()]
    checks += [compare(f"cli-{r}", out, ref, topics), compare(f"timed-cli-{r}", tout, ref, topics)]
    print(f"  round {r + 1}/{args.repeats}: CLI process {child.wall_s:.2f} s (summary "
          f"{runs['cli'][-1]['summary']['gen_s']:.1f} s, first shard "
          f"{'-' if first is None else f'{first:.2f}'} s); script process {mchild.wall_s:.2f} s "
          f"(llm.generate {m['gen_s']:.2f} s); timed CLI generate_dataset {t['gen_s']:.2f} s",
          flush=True)


def run_rss(args, root: Path) -> list[dict]:
    """Part 3: one fresh timed-CLI process per row count; os.wait4's ru_maxrss."""
    out = []
    for rows in args.rss_rows:
        data = root / f"rss-{rows}.jsonl"
        write_jsonl(data, rows, args.seed + 1)
        child, _, t, dest = timed_cli(args, root, data, f"rss-{rows}", 1, args.rss_max_tokens)
        assert t["summary"]["rows"] == rows, f"RSS run over {rows} rows: {t['summary']}"
        out.append({"rows": rows, "peak_rss_kib": child.maxrss_kib,
                    "peak_rss_through_generate_dataset_kib": t["rss_after_gen_kib"],
                    "process_s": child.wall_s, "gen_s": t["gen_s"],
                    "shards": len(list(dest.glob("part-*.parquet")))})
        shutil.rmtree(dest)
        data.unlink()
        print(f"  {rows:,} rows: peak RSS {child.maxrss_kib / 1024:,.0f} MiB", flush=True)
    return out


def write_jsonl(path: Path, rows: int, seed: int) -> None:
    """``rows`` lines of {"prompt": a sentence, "topic": a word}; seeded."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for text in h.sentences(rows, 4, 16, seed):
            f.write(json.dumps({"prompt": text, "topic": rng.choice(TOPICS)}) + "\n")


def parse_args(argv: list[str] | None):
    p = h.parser(__doc__, model={}, run={"repeats": 3},
                 engine={"max_num_batched_tokens": None})
    p.add_argument("--eos-boost", type=float, default=0.06,
                   help="make_tiny_model's eos_boost: EOS ends some samples early")
    p.add_argument("--rows", type=int, default=2000, help="rows of the JSONL input")
    p.add_argument("--n", type=int, default=4, help="samples per row")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the weights, the prompts and the job (row seeds derive from it)")
    p.add_argument("--rows-per-shard", type=int, default=None,
                   help="the CLI's --rows-per-shard (default: the CLI's own, 256)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--rss-rows", default="1000,100000",
                   help="comma-separated row counts of part 3, one fresh CLI process each")
    p.add_argument("--rss-max-tokens", type=int, default=4)
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds any one child process may run")
    args = h.check_args(p, p.parse_args(argv), "rows", "n", "max_tokens", "rss_max_tokens",
                        "rows_per_shard")
    args.rss_rows = [] if args.skip_rss else h.parse_int_list(p, args.rss_rows, "--rss-rows")
    return args


def report(args, runs: dict, checks: list[dict], rss: list[dict]) -> dict:
    """The tables and bars; the summary."""
    cli, mini, timed = runs["cli"], runs["minimal"], runs["timed_cli"]
    tokens = mini[0]["output_tokens"]
    best = {"timed_cli_gen_s": min(x["gen_s"] for x in timed),
            "llm_generate_s": min(x["gen_s"] for x in mini),
            "cli_summary_gen_s": min(x["summary"]["gen_s"] for x in cli),
            "cli_process_s": min(x["process_s"] for x in cli),
            "minimal_process_s": min(x["process_s"] for x in mini)}
    first = [x["first_shard_s"] for x in cli if x["first_shard_s"] is not None]
    slow_gen = best["timed_cli_gen_s"] / best["llm_generate_s"] - 1  # the CLI's extra time
    slow_proc = best["cli_process_s"] / best["minimal_process_s"] - 1
    s = {"output_tokens": tokens, "prompt_tokens": mini[0]["prompt_tokens"],
         "samples": mini[0]["samples"], **best,
         "generation_phase_cli_over_llm_generate": 1 / (1 + slow_gen),
         "generation_phase_cli_slowdown_pct": 100 * slow_gen,
         "generation_phase_within_10pct": slow_gen <= GEN_TOLERANCE,
         "whole_process_cli_over_script": 1 / (1 + slow_proc),
         "whole_process_cli_slowdown_pct": 100 * slow_proc,
         "first_shard_s": min(first, default=None),
         "first_shard_bar_met": bool(first) and min(first) < FIRST_SHARD_BAR_S,
         "tokens_identical": all(c["ok"] for c in checks),
         "token_counts_equal": all(x["summary"]["output_tokens"] == tokens for x in cli + timed)
         and all(x["output_tokens"] == tokens for x in mini),
         "engine_setup_equal": all(x["engine"] == mini[0]["engine"] for x in cli + mini + timed)}
    rep = f" (best of {args.repeats})" if args.repeats > 1 else ""
    h.table(["system", f"generation s{rep}", "output tok/s", f"whole process s{rep}",
             "output tok/s (process)"],
            [[name, f"{best[gen]:.2f}", f"{tokens / best[gen]:.0f}", f"{best[proc]:.2f}",
              f"{tokens / best[proc]:.0f}"] for name, gen, proc in (
                 ("batchgen generate (CLI)", "timed_cli_gen_s", "cli_process_s"),
                 ("LLM.generate script", "llm_generate_s", "minimal_process_s"))])
    print(f"CLI / LLM.generate output tok/s: generation phase "
          f"{s['generation_phase_cli_over_llm_generate']:.2f}x, whole process "
          f"{s['whole_process_cli_over_script']:.2f}x")
    print(f"{tokens} output tokens, {s['samples']} samples, {s['prompt_tokens']} prompt tokens; "
          f"CLI's own summary line: best {best['cli_summary_gen_s']:.1f} s generation")
    print(f"CLI time vs LLM.generate: generation phase {100 * slow_gen:+.1f}% "
          f"({'within' if s['generation_phase_within_10pct'] else 'OVER'} the "
          f"+{GEN_TOLERANCE:.0%} allowed), whole process {100 * slow_proc:+.1f}%")
    all_fs = ", ".join("-" if x["first_shard_s"] is None else f"{x['first_shard_s']:.2f}"
                       for x in cli)
    print("time to first shard: " + (f"{min(first):.2f} s" if first else "never appeared")
          + f" (all runs: {all_fs}); bar < {FIRST_SHARD_BAR_S:.0f} s: "
          + ("met" if s["first_shard_bar_met"] else "NOT met"))
    if rss:
        lo, hi = min(rss, key=lambda x: x["rows"]), max(rss, key=lambda x: x["rows"])
        s["rss_ratio"] = hi["peak_rss_kib"] / lo["peak_rss_kib"]
        s["rss_ratio_through_generate_dataset"] = (hi["peak_rss_through_generate_dataset_kib"]
                                                   / lo["peak_rss_through_generate_dataset_kib"])
        s["rss_bar_met"] = s["rss_ratio"] < RSS_BAR
        h.table(["rows", "peak RSS MiB (process)", "peak RSS MiB (through generate_dataset)",
                 "process s", "shards"],
                [[x["rows"], f"{x['peak_rss_kib'] / 1024:.0f}",
                  f"{x['peak_rss_through_generate_dataset_kib'] / 1024:.0f}",
                  f"{x['process_s']:.1f}", x["shards"]] for x in rss])
        print(f"peak RSS {hi['rows']:,} / {lo['rows']:,} rows: {s['rss_ratio']:.2f}x (through "
              f"generate_dataset {s['rss_ratio_through_generate_dataset']:.2f}x); bar < "
              f"{RSS_BAR:.0f}x: {'met' if s['rss_bar_met'] else 'NOT met'}")
    print(f"tokens: {sum(c['ok'] for c in checks)}/{len(checks)} CLI runs identical to "
          f"LLM.generate row by row; token counts equal: {s['token_counts_equal']}; "
          f"engine set-up equal: {s['engine_setup_equal']}")
    for c in checks:
        if not c["ok"]:
            print(f"MISMATCH (a bug): {c['run']}: {c['num_differing_rows']} rows differ from "
                  f"LLM.generate's with the same row seeds; first {c['first_difference']}",
                  file=sys.stderr)
    if not s["engine_setup_equal"]:
        print("WARNING: the processes set the engine up differently: "
              f"{[x['engine'] for x in cli + mini + timed]}", file=sys.stderr)
    return s


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    info = h.start(args)  # its --threads: the children's, through OMP_NUM_THREADS
    runs, checks, ref = {"cli": [], "minimal": [], "timed_cli": []}, [], []
    with tempfile.TemporaryDirectory(prefix="batchgen-dataset-bench-") as tmp, \
            h.prepare_model_dir(args, 1024, tokenizer=True, eos_boost=args.eos_boost) as model:
        root, args.model = Path(tmp), model
        write_jsonl(root / "input.jsonl", args.rows, args.seed)
        print(h.model_line(args) + f", eos_boost {args.eos_boost}")
        cli_command = ["python", "-m", "batchgen", *cli_argv(
            args, Path("INPUT.jsonl"), Path("OUT"), args.n, args.max_tokens)]
        print(f"workload: {args.rows} rows of 4-16 words (+ a topic column), n={args.n}, "
              f"max_tokens {args.max_tokens}, temperature 1.0, seed {args.seed}; CLI: "
              f"{' '.join(cli_command)}", flush=True)
        for r in range(args.repeats):
            run_round(args, root, root / "input.jsonl", r, runs, checks, ref)
        rss = run_rss(args, root)
    summary = report(args, runs, checks, rss)
    payload = h.finish(args, info, {"summary": summary, "runs": runs, "token_checks": checks,
                                    "rss": rss, "cli_command": cli_command}, note=None)
    if not (summary["tokens_identical"] and summary["token_counts_equal"]):
        raise SystemExit(1)
    return payload


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        kind, cfg = sys.argv[2], json.loads(sys.argv[3])
        sys.exit(child_minimal(cfg) if kind == "minimal" else child_timed_cli(cfg, sys.argv[4:]))
    main()

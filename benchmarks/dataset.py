"""Dataset jobs: `batchgen generate` (the CLI, Parquet shards) vs `LLM.generate` on the same rows.

Issue 11's bars (throughput, time to the first shard, peak RSS over ``--rss-rows``) on the
random Llama with the tiny tokenizer, in fresh processes: the CLI, a minimal ``llm.generate``
script and the CLI with its ``generate_dataset`` call timed, interleaved. Every CLI run's shards
must hold the script's tokens row by row (else exit 1), every engine set-up the same.

    PYTHONPATH=. python benchmarks/dataset.py --json /tmp/dataset_bench.json
"""

import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common as h

FIRST_SHARD, FIRST_SHARD_BAR_S, RSS_BAR = "part-00000.parquet", 10.0, 2.0
GEN_TOLERANCE = 0.10  # the CLI's generation phase may be this much slower than LLM.generate
EOS_BOOST, TIMEOUT_S = 0.06, 3600.0  # EOS ends some samples early; any one child's limit
TOPICS = ["travel", "history", "science", "cooking", "sports", "music", "nature", "letters"]
SUMMARY = re.compile(r"batchgen: (\d+) rows, (\d+) samples, (\d+) output tokens in .* "
                     r"\(([\d.]+) s this run\)")
RESULT = "\nbenchmark result: "  # a child's last line: its figures as JSON


# ---- the children: this file with --child KIND CFG [CLI ARGS] ------------------------------
def child_minimal(cfg: dict) -> dict:
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
    return result


def child_timed_cli(argv: list[str]) -> dict:
    """``batchgen.cli.main(argv)``, its generate_dataset timed, peak RSS up to its end."""
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
    if main(argv) != 0 or timing["calls"] != 1:
        raise SystemExit("the CLI failed or did not go through batchgen.data.runner."
                         "generate_dataset (update child_timed_cli)")
    return timing


# ---- the parent -----------------------------------------------------------------------------
def launch(args, root: Path, name: str, argv: list[str]) -> h.Child:
    """A fresh process: offline, its own datasets cache, the torch threads of --threads."""
    env = {"HF_DATASETS_CACHE": str(root / f"hf-datasets-{name}")}
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return h.Child([sys.executable, *argv], h.child_env(**env), root / f"{name}.log")


def cli_argv(args, data: Path, out: Path, n: int, max_tokens: int) -> list[str]:
    flags = {"model": args.model, "input": data, "n": n, "max-tokens": max_tokens,
             "temperature": 1.0, "output": out, **{k.replace("_", "-"): v for k, v in
                                                   h.engine_kwargs(args).items()}}
    return ["generate", "--quiet"] + [x for k, v in flags.items() if v is not None
                                      for x in (f"--{k}", str(v))]


def run_child(args, root: Path, name: str, kind: str, argv: list[str]) -> dict:
    """This file as a ``kind`` child, run to its end: its figures, process and log facts."""
    child = launch(args, root, name, [__file__, "--child", kind, *argv])
    output = child.check(TIMEOUT_S)
    figures = json.loads(output.rsplit(RESULT, 1)[1].split("\n", 1)[0])
    return {**figures, "process_s": child.wall_s, "cpu_s": child.cpu_s,
            "maxrss_kib": child.maxrss_kib, **facts(output, cli=kind != "minimal")}


def facts(output: str, cli: bool = True) -> dict:
    """The engine's set-up log lines (equal for a fair race) and the CLI's summary line."""
    out = {"engine": [ln.strip() for ln in output.splitlines()
                      if "KV cache:" in ln or "attention backend:" in ln]}
    if cli:
        if (m := SUMMARY.search(output)) is None:
            raise RuntimeError(f"no summary line in the CLI's output:\n{output[-2000:]}")
        out["summary"] = dict(zip(("rows", "samples", "output_tokens"), map(int, m.groups()[:3])),
                              gen_s=float(m.group(4)))
    return out


def compare(label: str, out: Path, want: list[list[list[int]]], topics: list[str]) -> dict:
    """A CLI run's shards against LLM.generate's tokens and the input's topics, row by row."""
    import pyarrow.parquet as pq

    got = {}
    for f in sorted(out.glob("part-*.parquet")):
        for row in pq.read_table(f, columns=["row_id", "topic", "outputs"]).to_pylist():
            assert row["row_id"] not in got, f"{out}: row {row['row_id']} is in two shards"
            got[row["row_id"]] = (row["topic"], [s["token_ids"] for s in sorted(
                row["outputs"], key=lambda s: s["index"])])
    ref = dict(enumerate(zip(topics, want)))
    differ = sorted(i for i in set(got) | set(ref) if got.get(i) != ref.get(i))
    first = {"row": differ[0], "cli": got.get(differ[0]),
             "llm_generate": ref.get(differ[0])} if differ else None
    return {"run": label, "rows_checked": len(ref), "num_differing_rows": len(differ),
            "differing_rows": differ[:20], "ok": not differ, "first_difference": first}


def run_round(args, root: Path, data: Path, r: int, runs: dict, checks: list, ref: list) -> None:
    """CLI (polled for its first shard), minimal script, timed CLI; the shards checked."""
    out, tout = root / f"out-cli-{r}", root / f"out-timed-cli-{r}"
    child, first = launch(args, root, f"cli-{r}", ["-m", "batchgen", *cli_argv(
        args, data, out, args.n, args.max_tokens)]), None
    while first is None and not child.poll():
        if (out / FIRST_SHARD).exists():
            first = time.perf_counter() - child.t0
        elif time.perf_counter() - child.t0 > TIMEOUT_S:
            child.kill()
        time.sleep(0.05)
    output = child.check(TIMEOUT_S)
    if first is None and (out / FIRST_SHARD).exists():
        first = child.wall_s  # appeared between the last poll and the exit
    runs["cli"].append({"process_s": child.wall_s, "cpu_s": child.cpu_s, "first_shard_s": first,
                        "maxrss_kib": child.maxrss_kib, **facts(output)})
    cfg = {"model": str(args.model), "input": str(data), "seed": args.seed, "dump": r == 0,
           "llm": h.engine_kwargs(args),
           "params": {"n": args.n, "temperature": 1.0, "max_tokens": args.max_tokens,
                      "seed": args.seed}}
    m = run_child(args, root, f"minimal-{r}", "minimal", [json.dumps(cfg)])
    ref[:] = m.pop("token_ids", ref)  # the first round's tokens: the reference
    t = run_child(args, root, f"timed-cli-{r}", "timed-cli",
                  cli_argv(args, data, tout, args.n, args.max_tokens))
    runs["minimal"].append(m)
    runs["timed_cli"].append(t)
    topics = [json.loads(line)["topic"] for line in data.open()]
    checks += [compare(f"cli-{r}", out, ref, topics), compare(f"timed-cli-{r}", tout, ref, topics)]
    print(f"  round {r + 1}/{args.repeats}: CLI process {child.wall_s:.2f} s (summary "
          f"{runs['cli'][-1]['summary']['gen_s']:.1f} s, first shard "
          f"{'-' if first is None else f'{first:.2f}'} s); script process {m['process_s']:.2f} s"
          f" (llm.generate {m['gen_s']:.2f} s); timed CLI generate_dataset {t['gen_s']:.2f} s",
          flush=True)


def run_rss(args, root: Path) -> list[dict]:
    """Part 3: one fresh timed-CLI process per row count; os.wait4's ru_maxrss."""
    out = []
    for rows in args.rss_rows:
        data, dest = root / f"rss-{rows}.jsonl", root / f"out-rss-{rows}"
        write_jsonl(data, rows, args.seed + 1)
        t = run_child(args, root, f"rss-{rows}", "timed-cli",
                      cli_argv(args, data, dest, 1, args.rss_max_tokens))
        assert t["summary"]["rows"] == rows, f"RSS run over {rows} rows: {t['summary']}"
        out.append({"rows": rows, **t, "shards": len(list(dest.glob("part-*.parquet")))})
        print(f"  {rows:,} rows: peak RSS {t['maxrss_kib'] / 1024:,.0f} MiB", flush=True)
    return out


def write_jsonl(path: Path, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for text in h.sentences(rows, 4, 16, seed):
            f.write(json.dumps({"prompt": text, "topic": rng.choice(TOPICS)}) + "\n")


def parse_args(argv: list[str] | None):
    p = h.parser(__doc__, model={}, run={"repeats": 3},
                 engine={"max_num_batched_tokens": None})
    h.add_ints(p, rows=2000, n=4, max_tokens=16, seed=0, rss_max_tokens=4)
    p.add_argument("--rss-rows", type=h.int_list, default="1000,100000",
                   help="comma-separated row counts of part 3, one fresh CLI process each")
    p.add_argument("--skip-rss", action="store_true")
    args = h.check_args(p, p.parse_args(argv), "rows", "n", "max_tokens", "rss_max_tokens")
    args.rss_rows = [] if args.skip_rss else args.rss_rows
    return args


def report(args, runs: dict, checks: list[dict], rss: list[dict]) -> dict:
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
    s = {"output_tokens": tokens, **best, "cli_slowdown_pct": {
        "generation_phase": 100 * slow_gen, "whole_process": 100 * slow_proc},
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
    print(f"CLI / LLM.generate output tok/s: generation phase {1 / (1 + slow_gen):.2f}x, whole "
          f"process {1 / (1 + slow_proc):.2f}x")
    print(f"{tokens} output tokens, {mini[0]['samples']} samples, {mini[0]['prompt_tokens']} "
          f"prompt tokens; CLI's own summary line: best {best['cli_summary_gen_s']:.1f} s")
    print(f"CLI time vs LLM.generate: generation phase {100 * slow_gen:+.1f}% "
          f"({'within' if slow_gen <= GEN_TOLERANCE else 'OVER'} the +{GEN_TOLERANCE:.0%} "
          f"allowed), whole process {100 * slow_proc:+.1f}%")
    all_fs = ", ".join("-" if x["first_shard_s"] is None else f"{x['first_shard_s']:.2f}"
                       for x in cli)
    print("time to first shard: " + (f"{min(first):.2f} s" if first else "never appeared")
          + f" (all runs: {all_fs}); bar < {FIRST_SHARD_BAR_S:.0f} s: "
          + ("met" if s["first_shard_bar_met"] else "NOT met"))
    if rss:
        lo, hi = min(rss, key=lambda x: x["rows"]), max(rss, key=lambda x: x["rows"])
        s["rss_ratio"] = hi["maxrss_kib"] / lo["maxrss_kib"]
        s["rss_ratio_through_generate_dataset"] = hi["rss_after_gen_kib"] / lo[
            "rss_after_gen_kib"]
        h.table(["rows", "peak RSS MiB (process)", "peak RSS MiB (through generate_dataset)",
                 "process s", "shards"],
                [[x["rows"], f"{x['maxrss_kib'] / 1024:.0f}",
                  f"{x['rss_after_gen_kib'] / 1024:.0f}", f"{x['process_s']:.1f}",
                  x["shards"]] for x in rss])
        print(f"peak RSS {hi['rows']:,} / {lo['rows']:,} rows: {s['rss_ratio']:.2f}x (through "
              f"generate_dataset {s['rss_ratio_through_generate_dataset']:.2f}x); bar < "
              f"{RSS_BAR:.0f}x: {'met' if s['rss_ratio'] < RSS_BAR else 'NOT met'}")
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
            h.prepare_model_dir(args, 1024, tokenizer=True, eos_boost=EOS_BOOST) as model:
        root, args.model = Path(tmp), model
        write_jsonl(root / "input.jsonl", args.rows, args.seed)
        print(h.model_line(args) + f", eos_boost {EOS_BOOST}")
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
                                    "rss": rss, "cli_command": cli_command})
    if not (summary["tokens_identical"] and summary["token_counts_equal"]):
        raise SystemExit(1)
    return payload


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        kind, argv = sys.argv[2], sys.argv[3:]
        result = child_minimal(json.loads(argv[0])) if kind == "minimal" else child_timed_cli(
            argv)
        print(RESULT + json.dumps(result), flush=True)
    else:
        main()

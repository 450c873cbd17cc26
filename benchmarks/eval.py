"""lm-evaluation-harness on batchgen against lm-eval's own `hf` backend, same weights, one run.

The local tasks of ``tests/eval_tasks`` through ``HFLM`` and ``batchgen.eval.BatchgenLM`` (a
cold prefix cache each run; ``--no-cache-too``: also without), in interleaved rounds: the
metrics (they must agree to ``RTOL``, else exit 1), the model's and lm-eval's seconds.

    PYTHONPATH=. python benchmarks/eval.py --model smollm2 --no-cache-too --repeats 3
"""

import os
import sys
import time

from benchmarks import common as h

TASKS, FEWSHOT_TASKS, RTOL = ["bg_mc", "bg_gen", "bg_ppl"], ("bg_mc", "bg_gen"), 1e-3
TASKS_DIR = h.ROOT / "tests" / "eval_tasks"


def clock(lm):
    """``lm`` with its request methods timed into ``lm.model_s`` (the model's own seconds)."""
    lm.model_s = 0.0

    def timed(method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                lm.model_s += time.perf_counter() - start
        return call

    for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        setattr(lm, name, timed(getattr(lm, name)))
    return lm


def evaluate(lm, task: str, args, manager, limit: int | None) -> dict:
    """One task on ``lm``: its metrics, seconds (lm-eval's, the model's), batchgen's hits."""
    import lm_eval

    if hasattr(lm, "llm"):  # batchgen: a cold prefix cache (no hit from an earlier run)
        lm.llm.reset_prefix_cache()
    before, old = lm.model_s, os.getcwd()
    os.chdir(TASKS_DIR)
    try:
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model=lm, tasks=[task], limit=limit, task_manager=manager,
            num_fewshot=args.num_fewshot if task in FEWSHOT_TASKS else None)
        row = {"lm_eval_s": time.perf_counter() - start, "model_s": lm.model_s - before}
    finally:
        os.chdir(old)
    row["metrics"] = {k: float(v) for k, v in out["results"][task].items()
                      if "," in k and "stderr" not in k}
    if hasattr(lm, "llm"):
        stats = lm.llm.kv_stats()
        row.update(prefix_hit_tokens=stats.prefix_hit_tokens,
                   prompt_tokens_computed=stats.prompt_tokens_computed)
    return row


def run(args) -> dict:
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from batchgen.eval import BatchgenLM

    folder, systems = h.resolve_model(args.model), {}
    for name, cache in [("batchgen", True), ("batchgen, no prefix cache", False)][
            :1 + args.no_cache_too]:
        systems[name] = clock(BatchgenLM(str(folder), device="cpu", dtype="float32",
                                         max_length=args.max_length, enable_prefix_caching=cache,
                                         max_num_seqs=256))
    systems = {"hf": clock(HFLM(pretrained=str(folder), dtype="float32", device="cpu",
                                batch_size=args.hf_batch_size,
                                max_length=systems["batchgen"].max_length)), **systems}
    # lm-eval's built-in tasks are indexed (~30 s) only when --tasks names one
    manager = TaskManager(include_path=str(TASKS_DIR),
                          include_defaults=not set(args.tasks) <= set(TASKS))
    for lm in systems.values():  # warm-up, untimed: first forwards, lazy initialisation
        evaluate(lm, args.tasks[0], args, manager, limit=1)
    tasks = {}
    for task in args.tasks:
        rows = {name: [] for name in systems}
        h.interleaved_repeats([h.Contender(n, lambda lm=lm, t=task, out=rows[n]: out.append(
            evaluate(lm, t, args, manager, args.limit))) for n, lm in systems.items()],
            args.repeats)
        tasks[task] = {n: min(rs, key=lambda r: r["model_s"]) for n, rs in rows.items()}
    return {"max_length": systems["batchgen"].max_length, "tasks": tasks}


def report(result: dict, rtol: float) -> bool:
    rows, ok = [], True
    names = list(next(iter(result["tasks"].values())))
    for task, r in result["tasks"].items():
        ref, others = r["hf"]["metrics"], [r[n]["metrics"] for n in names[1:]]
        for metric in sorted(set(ref).union(*others)):
            a, bs = ref.get(metric), [m.get(metric) for m in others]
            rel, good = None, False
            if a is not None and None not in bs:
                rel = max(abs(b - a) / max(abs(a), 1e-12) for b in bs)
                good = rel <= rtol or max(abs(b - a) for b in bs) <= 1e-9
            ok &= good
            rows.append([task, metric, *(f"{v:.6g}" if v is not None else "-" for v in [a, *bs]),
                         f"{rel:.1e}" if rel is not None else "-", "yes" if good else "NO"])
    h.table(["task", "metric", *names, "rel. diff", f"<= {rtol:g}"], rows)
    totals = {n: {k: sum(r[n][k] for r in result["tasks"].values())
                  for k in ("model_s", "lm_eval_s")} for n in names}
    h.table(["task", "system", "model s", "hf / system", "lm-eval s", "prefix-hit tokens",
             "prompt tokens computed"],
            [[task, n, f"{r[n]['model_s']:.2f}", h.fmt_ratio(r["hf"]["model_s"], r[n]["model_s"]),
              f"{r[n]['lm_eval_s']:.2f}", r[n].get("prefix_hit_tokens", "-"),
              r[n].get("prompt_tokens_computed", "-")]
             for task, r in [*result["tasks"].items(), ("all", totals)] for n in names])
    print("metrics agree" if ok else "METRICS DISAGREE")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, run={"device": None})
    p.add_argument("--model", default="smollm2", help="a folder, 'smollm2' or 'tiny'")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    h.add_ints(p, limit=None, num_fewshot=None, max_length=None, hf_batch_size=8)
    p.add_argument("--no-cache-too", action="store_true",
                   help="also run batchgen with its prefix cache off (what the cache saves)")
    args = h.check_args(p, p.parse_args(argv), "limit")
    args.tasks = [t for t in args.tasks.split(",") if t]
    info = h.start(args)
    result = run(args)
    ok = report(result, RTOL)
    h.finish(args, info, {**result, "agree": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

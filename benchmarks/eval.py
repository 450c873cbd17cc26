"""lm-evaluation-harness on batchgen against lm-eval's own `hf` backend, same weights, one run.

The local tasks in ``tests/eval_tasks`` (``bg_mc`` multiple choice: acc, acc_norm; ``bg_gen``
generation with ``until``: exact_match; ``bg_ppl`` rolling perplexity: word / byte perplexity,
bits per byte) run task by task through ``lm_eval.simple_evaluate`` twice: with the ``hf``
backend (``HFLM``, float32, ``--hf-batch-size``) and with ``batchgen.eval.BatchgenLM`` (float32,
the prefix cache on; with ``--no-cache-too`` also with it off). The models are loaded and
warmed up (one untimed document) before the clock starts; the same ``max_length`` is given to
all, so rolling windows and truncation are the same; ``--repeats`` runs the systems in rounds
and keeps each one's fastest. Printed: every metric side by
side with its relative difference (they must agree to ``--rtol``, else exit code 1), each
task's time inside each backend's request methods (the model's own work) and their ratio, the
wall time of each whole ``simple_evaluate`` call (lm-eval's task building and metrics included),
and batchgen's prefix-cache hits and prompt tokens computed per task.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/eval.py --model smollm2
    PYTHONPATH=. python benchmarks/eval.py --model tiny --limit 4 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    fmt_ratio,
    machine_info,
    machine_line,
    markdown_table,
    quiet_logging,
    resolve_model,
    write_json,
)

TASKS_DIR = Path(__file__).resolve().parents[1] / "tests" / "eval_tasks"
TASKS = ["bg_mc", "bg_gen", "bg_ppl"]


class ModelClock:
    """Seconds spent inside an LM's request methods (loglikelihood, loglikelihood_rolling,
    generate_until): the backend's own time, without lm-eval's task building and metrics."""

    METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")

    def __init__(self, lm: Any) -> None:
        self.seconds = 0.0
        for name in self.METHODS:
            setattr(lm, name, self._timed(getattr(lm, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def evaluate(model: Any, task: str, args: argparse.Namespace, manager: Any
             ) -> tuple[dict[str, float], float, float]:
    """One task through lm-eval on `model` (an lm-eval LM instance): its metrics (stderr
    left out), the wall time of the whole call and the time inside the model's request
    methods. Runs in the tasks' folder (relative data files)."""
    import lm_eval

    clock = model.clock
    if hasattr(model, "llm"):  # batchgen: a cold prefix cache (no hit from an earlier run)
        model.llm.reset_prefix_cache()
    before = clock.seconds
    old = os.getcwd()
    os.chdir(args.tasks_dir)
    try:
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=model, tasks=[task], limit=args.limit,
                                      num_fewshot=args.num_fewshot if task in args.fewshot_tasks
                                      else None, task_manager=manager)
        seconds = time.perf_counter() - start
    finally:
        os.chdir(old)
    metrics = {k: float(v) for k, v in out["results"][task].items()
               if "," in k and "stderr" not in k}
    return metrics, seconds, clock.seconds - before


def load_models(folder: Path, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float]]:
    """The systems by name (hf; batchgen; batchgen without its prefix cache with
    --no-cache-too) and their load seconds: float32 all, one max_length."""
    from lm_eval.models.huggingface import HFLM

    from batchgen.eval import BatchgenLM

    kinds = [("batchgen", True)] + ([("batchgen, no prefix cache", False)]
                                    if args.no_cache_too else [])
    systems, load = {}, {}
    for name, cache in kinds:
        t0 = time.perf_counter()
        systems[name] = BatchgenLM(str(folder), device="cpu", dtype="float32",
                                   max_length=args.max_length, max_num_seqs=args.max_num_seqs,
                                   enable_prefix_caching=cache)
        load[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    systems["hf"] = HFLM(pretrained=str(folder), dtype="float32", device="cpu",
                         batch_size=args.hf_batch_size,
                         max_length=systems["batchgen"].max_length)
    load["hf"] = time.perf_counter() - t0
    return {"hf": systems.pop("hf"), **systems}, load


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every task on every system: metrics, model and lm-eval times, batchgen's prefix hits."""
    from lm_eval.tasks import TaskManager

    systems, load = load_models(resolve_model(args.model), args)
    for lm in systems.values():
        lm.clock = ModelClock(lm)
    manager = TaskManager(include_path=str(args.tasks_dir))  # indexes lm-eval's tasks: once
    for lm in systems.values():  # warm-up, untimed: first forwards, lazy initialisation
        evaluate(lm, args.tasks[0], argparse.Namespace(**{**vars(args), "limit": 1}), manager)
    tasks = {task: _task(systems, task, args, manager) for task in args.tasks}
    return {"load_s": load, "max_length": systems["batchgen"].max_length, "tasks": tasks}


def _task(systems: dict[str, Any], task: str, args: argparse.Namespace, manager: Any
          ) -> dict[str, Any]:
    """One task on every system, `--repeats` rounds (A B C, A B C: each system samples the
    same quiet and busy spells of a shared machine); the fastest run of each is kept."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, lm in systems.items():
            metrics, lm_eval_s, model_s = evaluate(lm, task, args, manager)
            row = {"metrics": metrics, "model_s": model_s, "lm_eval_s": lm_eval_s}
            if name != "hf":  # the task's last batchgen call (its one request type)
                stats = lm.llm.kv_stats()
                row |= {"prefix_hit_tokens": stats.prefix_hit_tokens,
                        "prompt_tokens_computed": stats.prompt_tokens_computed}
            runs[name].append(row)
    return {name: min(rows, key=lambda r: r["model_s"]) for name, rows in runs.items()}


def agreement(result: dict[str, Any], rtol: float) -> tuple[list[list[str]], bool]:
    """Table rows (task, metric, hf, each batchgen run, worst relative difference, ok) and
    whether every metric agrees."""
    rows, ok = [], True
    for task, r in result["tasks"].items():
        ref = r["hf"]["metrics"]
        others = [s["metrics"] for name, s in r.items() if name != "hf"]
        for name in sorted(set(ref).union(*others)):
            a, bs = ref.get(name), [m.get(name) for m in others]
            if a is None or None in bs:
                rel, good = None, False
            else:
                rel = max(abs(b - a) / max(abs(a), 1e-12) for b in bs)
                good = rel <= rtol or max(abs(b - a) for b in bs) <= 1e-9
            ok &= good
            rows.append([task, name, *(f"{v:.6g}" if v is not None else "-" for v in [a, *bs]),
                         f"{rel:.1e}" if rel is not None else "-", "yes" if good else "NO"])
    return rows, ok


def print_result(result: dict[str, Any], rtol: float) -> bool:
    """The metrics side by side, then the times; returns whether the metrics agree."""
    rows, ok = agreement(result, rtol)
    names = list(next(iter(result["tasks"].values())))
    print(markdown_table(["task", "metric", *names, "rel. diff", f"<= {rtol:g}"], rows))
    times = []
    for task, r in [*result["tasks"].items(), ("all", _totals(result, names))]:
        for name in names:
            s = r[name]
            times.append([task, name, f"{s['model_s']:.2f}",
                          fmt_ratio(r["hf"]["model_s"], s["model_s"]),
                          f"{s['lm_eval_s']:.2f}", s.get("prefix_hit_tokens", "-"),
                          s.get("prompt_tokens_computed", "-")])
    print(markdown_table(["task", "system", "model s", "hf / system", "lm-eval s",
                          "prefix-hit tokens", "prompt tokens computed"], times))
    load = ", ".join(f"{k} {v:.1f} s" for k, v in result["load_s"].items())
    print(f"load (not timed above): {load}; max_length {result['max_length']}")
    print("metrics agree" if ok else "METRICS DISAGREE")
    return ok


def _totals(result: dict[str, Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per system, its model and lm-eval seconds summed over the tasks."""
    return {n: {k: sum(r[n][k] for r in result["tasks"].values())
                for k in ("model_s", "lm_eval_s")} for n in names}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a folder, 'smollm2' or 'tiny'")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    p.add_argument("--tasks-dir", type=Path, default=TASKS_DIR,
                   help="folder of the task YAMLs and their data (lm-eval's --include_path)")
    p.add_argument("--limit", type=int, default=None, help="documents per task (lm-eval's)")
    p.add_argument("--num-fewshot", type=int, default=None,
                   help="few-shot examples per question (lm-eval's; longer shared contexts)")
    p.add_argument("--fewshot-tasks", default="bg_mc,bg_gen",
                   help="the tasks --num-fewshot applies to (not rolling perplexity)")
    p.add_argument("--max-length", type=int, default=None,
                   help="both backends' max_length (default: batchgen's max_model_len - 2)")
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--no-cache-too", action="store_true",
                   help="also run batchgen with its prefix cache off (what the cache saves)")
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each task per system (after one untimed warm-up); the "
                        "fastest is reported")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.fewshot_tasks = [t for t in args.fewshot_tasks.split(",") if t]
    args.tasks_dir = args.tasks_dir.resolve()
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_logging()
    info = machine_info("cpu")
    print(machine_line(info))
    result = run(args)
    ok = print_result(result, args.rtol)
    if args.json:
        write_json(args.json, {"args": vars(args) | {"json": None}, "machine": info,
                               **result, "agree": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Issue 42's real-model check: a best-of-8 `batchgen generate` job on the real
SmolLM2-135M-Instruct (generator) with SmolLM2 + a seeded random one-label
`LlamaForSequenceClassification` head (reward model), on arithmetic chat prompts.

1. The job runs uninterrupted into `whole/`.
2. The same job into `killed/`: SIGKILLed in the generate stage (shards closed early by
   --shard-seconds, one renamed into place but not listed), resumed and SIGKILLed in the score
   stage, resumed and SIGKILLed in the select stage, resumed to the end. Every file of
   `killed/` (shards and manifests) must have the SHA-256 of its `whole/` twin.
3. `--select top:2 --resume` on `whole/`: tokens generated and candidates scored are counted
   (around `LLM.generate_stream` and `RewardModel.classify` in that process) and must be 0;
   `generate/` and `score/` must be untouched.

Each run is its own process (`python -m batchgen generate ...` through `--child`); the kill is
a SIGKILL the process sends itself just before the N-th manifest write of a stage's folder, so
it lands at the same point on every machine.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/best_of_n_kill_check.py [--rows 16] [--n 8]
        [--max-tokens 32] [--model smollm2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILLS = (("generate", 2, False), ("score", 4, True), ("selected", 4, True))


def child(stage: str, at: int, count: bool, argv: list[str]) -> int:
    """One run of `batchgen generate argv`, SIGKILLed before the `at`-th manifest write of
    `stage` (at 0: never); with `count`, prints the tokens generated and candidates scored."""
    from batchgen.cli import main
    from batchgen.data import shards

    listed, seen = shards.ShardStore._write_manifest, [0]

    def dying(store, complete):
        seen[0] += store.dir.name == stage
        if at and seen[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return listed(store, complete)
    shards.ShardStore._write_manifest = dying
    counts = {"tokens_generated": 0, "candidates_scored": 0}
    if count:
        _count(counts)
    code = main(argv)
    if count:
        print("COUNTS " + json.dumps(counts))
    return code


def _count(counts: dict[str, int]) -> None:
    """Count tokens out of every LLM.generate_stream and candidates into RewardModel.classify."""
    from batchgen.llm import LLM
    from batchgen.pooling.scorer import RewardModel

    stream, classify = LLM.generate_stream, RewardModel.classify

    def counted_stream(self, *a, **k):
        for i, out in stream(self, *a, **k):
            counts["tokens_generated"] += sum(len(c.token_ids) for c in out.outputs)
            yield i, out

    def counted_classify(self, prompts, *a, **k):
        counts["candidates_scored"] += len(prompts)
        return classify(self, prompts, *a, **k)
    LLM.generate_stream, RewardModel.classify = counted_stream, counted_classify


def rows_file(path: Path, rows: int) -> Path:
    """`rows` arithmetic questions as chat messages (sums and products, seeded)."""
    rng, lines = random.Random(0), []
    for i in range(rows):
        a, b = rng.randint(2, 60), rng.randint(2, 30)
        op = "*" if i % 3 == 2 else "+"
        q = f"What is {a} {op} {b}? Answer with the number, then one sentence on how."
        lines.append(json.dumps({"messages": [{"role": "user", "content": q}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run(argv: list[str], stage: str = "", at: int = 0, count: bool = False
        ) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, __file__, "--child", stage, str(at), str(int(count)), "--", *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return proc, round(time.perf_counter() - t0, 1)


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def job_argv(gen: Path, rm: Path, data: Path, out: Path, args: argparse.Namespace,
             *extra: str) -> list[str]:
    return ["generate", "--model", str(gen), "--input", str(data), "--messages-column",
            "messages", "--n", str(args.n), "--max-tokens", str(args.max_tokens),
            "--temperature", "0.8", "--seed", "0", "--score-model", str(rm), "--rows-per-shard",
            str(args.rows_per_shard), "--shard-seconds", "1", "--num-kv-blocks", "512",
            "--output", str(out), "--quiet", *extra]


def check(gen: Path, rm: Path, tmp: Path, args: argparse.Namespace) -> dict:
    """Steps 1-3; returns the figures (and raises SystemExit on a mismatch)."""
    data = rows_file(tmp / "rows.jsonl", args.rows)
    figures: dict = {}
    proc, figures["uninterrupted_s"] = run(job_argv(gen, rm, data, tmp / "whole", args,
                                                    "--select", "best"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage, at, resume in KILLS:
        extra = ("--select", "best") + (("--resume",) if resume else ())
        proc, secs = run(job_argv(gen, rm, data, tmp / "killed", args, *extra), stage, at)
        assert proc.returncode == -signal.SIGKILL, (stage, proc.stderr[-3000:])
        listed = json.loads((tmp / "killed" / stage / "_manifest.json").read_text())
        figures[f"killed_in_{stage}"] = {"s": secs, "shards_listed": len(
            listed["shards"]), "files": sorted(p.name for p in (tmp / "killed" / stage).iterdir())}
    proc, figures["final_resume_s"] = run(job_argv(gen, rm, data, tmp / "killed", args,
                                                   "--select", "best", "--resume"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole, killed = hashes(tmp / "whole"), hashes(tmp / "killed")
    figures["files"] = len(whole)
    figures["differing"] = sorted(k for k in set(whole) | set(killed)
                                  if whole.get(k) != killed.get(k))
    before = {k: v for k, v in whole.items() if not k.startswith("selected/")}
    proc, figures["reselect_s"] = run(job_argv(gen, rm, data, tmp / "whole", args,
                                               "--select", "top:2", "--resume"), count=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures.update(json.loads(proc.stdout.split("COUNTS ", 1)[1]))
    after = hashes(tmp / "whole")
    figures["generate_and_score_untouched"] = all(after.get(k) == v for k, v in before.items())
    figures["selected_changed"] = any(after[k] != whole[k] for k in after
                                      if k.startswith("selected/part-"))
    return figures


def summary(tmp: Path) -> dict:
    """What the job wrote: candidates per row, scores present, the selection."""
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp / "whole" / "selected").to_pylist()
    return {"rows": len(rows), "candidates": sum(len(r["outputs"]) for r in rows),
            "all_scored": all(isinstance(c["score"], float) for r in rows for c in r["outputs"]),
            "selected_top2": all(len(r["selected"]) == 2 for r in rows)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        stage, at, count = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
        sys.exit(child(stage, at, count, sys.argv[6:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a folder, or smollm2 (made once)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rows-per-shard", type=int, default=4)
    ap.add_argument("--keep", type=Path, default=None, help="work here (kept) instead of a "
                    "temporary folder")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.best_of_n import reward_folder
    from benchmarks.common import resolve_model

    gen = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as t:
        tmp = args.keep or Path(t)
        tmp.mkdir(parents=True, exist_ok=True)
        rm = reward_folder(gen, tmp / "rm")
        figures = check(gen, rm, tmp, args)
        figures.update(summary(tmp))
    print(json.dumps(figures, indent=1))
    ok = (not figures["differing"] and figures["tokens_generated"] == 0
          and figures["candidates_scored"] == 0 and figures["generate_and_score_untouched"])
    print("OK: every file byte-identical after kills in each stage; reselect generated and "
          "scored nothing" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

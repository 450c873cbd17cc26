"""Best-of-n as one dataset job (issue 42) on the real SmolLM2-135M-Instruct, with SmolLM2 plus
a random one-label classification head as the reward model:

  job      generate_dataset(score=RM, select="best"): generate, the generator asleep while the
           reward model scores every candidate, select; one call, resumable per stage.
  2 passes generate_dataset into shards, then a second pass that loads the reward model and
           scores the shards' (prompt + candidate) texts with RewardModel.reward.
  until    on few-shot arithmetic prompts of three difficulties with a verifier (the first
           integer of the completion equals the sum/product): select="until:k" in rounds of 2
           (budget 8) against a fixed n=8 with select="threshold:1", for k = 1 and 2:
           candidates spent and rows with k verified answers.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/best_of_n.py [--model smollm2] [--rows 6] [--n 4]
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import datasets
import torch

from benchmarks.common import resolve_model

POOL = 512  # KV blocks of each model (16 tokens each)


def reward_folder(src: Path, dst: Path) -> Path:
    """`src` with a random one-label sequence-classification head (a stand-in reward model)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(src)
    config.num_labels, config.pad_token_id = 1, config.pad_token_id or 0
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(src, config=config,
                                                               dtype="float32")
    model.save_pretrained(dst)
    for f in src.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, dst / f.name)
    return dst


def chat_rows(rows: int) -> datasets.Dataset:
    topics = ["the moon", "rivers", "bread", "a lighthouse", "winter", "bees", "maps", "tea"]
    return datasets.Dataset.from_list([{"messages": [{"role": "user", "content":
                                        f"Write one sentence about {topics[i % 8]}."}]}
                                       for i in range(rows)])


def one_job(gen: Path, rm: Path, out: Path, data: datasets.Dataset, params) -> tuple[float, list]:
    """The best-of-n job: generate, score (the generator asleep), select; one call."""
    from batchgen import LLM
    from batchgen.data import generate_dataset

    t0 = time.perf_counter()
    llm = LLM(gen, seed=0, enable_sleep_mode=True, num_kv_blocks=POOL)
    ds = generate_dataset(llm, data, params, messages_column="messages", score=rm,
                          select="best", output_dir=out, use_tqdm=False)
    return time.perf_counter() - t0, [c["score"] for r in ds for c in r["outputs"]]


def two_passes(gen: Path, rm: Path, out: Path, data: datasets.Dataset, params
               ) -> tuple[float, list]:
    """Generate into shards; then load the reward model and score the shards' texts."""
    from batchgen import LLM
    from batchgen.data import generate_dataset
    from batchgen.pooling.scorer import RewardModel

    t0 = time.perf_counter()
    llm = LLM(gen, seed=0, num_kv_blocks=POOL)
    plain = generate_dataset(llm, data, params, messages_column="messages", output_dir=out,
                             use_tqdm=False)
    del llm
    scorer = RewardModel(rm, seed=0)  # default pool, as the job's scorer
    tok = scorer.llm.get_tokenizer()
    prompts = [tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
               for r in plain]
    texts = [p + c["text"] for p, r in zip(prompts, plain) for c in r["outputs"]]
    return time.perf_counter() - t0, [o.outputs.probs[0] for o in scorer.reward(texts)]


def job_vs_two_passes(gen: Path, rm: Path, tmp: Path, rows: int, n: int, tokens: int) -> None:
    """Both ways twice, alternating (the first of each pays the cold start)."""
    from batchgen import LLM, SamplingParams
    from batchgen.data import generate_dataset

    data, params = chat_rows(rows), SamplingParams(n=n, temperature=0.8, max_tokens=tokens)
    for rep in range(2):
        t_job, s_job = one_job(gen, rm, tmp / f"job{rep}", data, params)
        t_two, s_two = two_passes(gen, rm, tmp / f"gen{rep}", data, params)
        diff = max(abs(a - b) for a, b in zip(s_job, s_two))
        print(f"run {rep + 1}: best-of-{n}, {rows} rows, {tokens} tokens: one job {t_job:.1f} s, "
              f"generate then score in two passes {t_two:.1f} s (job / two passes "
              f"{t_job / t_two:.2f}x); max |score diff| {diff:.1e}")
    t0 = time.perf_counter()
    llm = LLM(gen, seed=0, enable_sleep_mode=True, num_kv_blocks=POOL)
    generate_dataset(llm, data, params, messages_column="messages", score=rm, select="top:2",
                     output_dir=tmp / "job1", resume=True, use_tqdm=False)
    print(f"select changed to top:2 with resume: {time.perf_counter() - t0:.1f} s "
          "(model load + selection; nothing generated or scored)")


def arithmetic_rows(rows: int) -> tuple[datasets.Dataset, dict[str, int]]:
    """Few-shot arithmetic in three difficulties, alternating: one-digit sums (easy for
    SmolLM2-135M), two-digit sums, two-digit products (rarely right)."""
    rng, out, answers = random.Random(0), [], {}
    for i in range(rows):
        kind = i % 3
        lo, hi = ((1, 9), (10, 99), (13, 99))[kind]
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        op, value = ("*", a * b) if kind == 2 else ("+", a + b)
        q = f"2 + 3 = 5\n14 + 21 = 35\n6 * 7 = 42\n{a} {op} {b} ="
        answers[q] = value
        out.append({"prompt": q})
    return datasets.Dataset.from_list(out), answers


def until_vs_fixed(gen: Path, rows: int, tokens: int) -> None:
    from batchgen import LLM, SamplingParams
    from batchgen.data import generate_dataset

    data, answers = arithmetic_rows(rows)

    def verify(prompt: str, text: str) -> float:
        m = re.search(r"-?\d+", text)
        return float(m is not None and int(m.group()) == answers[prompt])

    llm = LLM(gen, seed=0, num_kv_blocks=POOL)
    for k in (1, 2):
        runs = {}
        for name, n, kw in ((f"fixed n=8, threshold:1 (k={k})", 8,
                             dict(select="threshold:1")),
                            (f"until:{k}, rounds of 2, budget 8", 2,
                             dict(select=f"until:{k}", threshold=1.0, max_candidates=8))):
            t0 = time.perf_counter()
            ds = generate_dataset(llm, data, SamplingParams(n=n, temperature=0.8,
                                                            max_tokens=tokens),
                                  score=verify, use_tqdm=False, **kw)
            runs[name] = (sum(len(r["outputs"]) for r in ds),
                          sum(len(r["selected"]) >= k for r in ds),
                          time.perf_counter() - t0, [len(r["outputs"]) for r in ds])
        for name, (spent, accepted, secs, per_row) in runs.items():
            print(f"{name}: {spent} candidates, {accepted}/{rows} rows with >= {k} verified, "
                  f"{secs:.1f} s; per row (easy, medium, hard) {per_row}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--arith-rows", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a shared 2-core VM: 2 threads wait on each other
    gen = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        rm = reward_folder(gen, Path(tmp) / "rm")
        job_vs_two_passes(gen, rm, Path(tmp), args.rows, args.n, args.max_tokens)
    until_vs_fixed(gen, args.arith_rows, 4)


if __name__ == "__main__":
    main()

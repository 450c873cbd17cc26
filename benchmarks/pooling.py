"""Reward scoring throughput: batchgen's RewardModel (paged engine, prefix sharing) against HF's
padded batched `*ForSequenceClassification` forward, and against itself with prefix caching
off, on the same random llama reward model and a best-of-n workload (P prompts x N
candidates sharing each prompt). Ratios are candidates/s over HF's.

    python benchmarks/pooling.py [--prompts 8] [--n 8] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch


def build(root: Path, hidden: int, layers: int) -> Path:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from batchgen.tools.make_tiny_model import make_tiny_model

    src = make_tiny_model(root / "lm", family="llama", hidden_size=hidden,
                          intermediate_size=2 * hidden, num_hidden_layers=layers)
    config = AutoConfig.from_pretrained(src)
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(root / "rm")
    for f in src.iterdir():
        if "token" in f.name:
            shutil.copy(f, root / "rm" / f.name)
    return root / "rm"


def workload(prompts: int, n: int) -> list[str]:
    rng = random.Random(0)
    words = "the a moon sun river stone light quick slow blue red answer is".split()
    out = []
    for p in range(prompts):
        head = f"Question {p}: " + " ".join(rng.choice(words) for _ in range(60)) + " Answer:"
        out += [head + " " + " ".join(rng.choice(words) for _ in range(rng.randint(4, 20)))
                for _ in range(n)]
    return out


def hf_scores(folder: Path, texts: list[str], batch: int) -> tuple[float, list[float]]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token_id = 0
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype="float32").eval()
    start, scores = time.perf_counter(), []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], return_tensors="pt", padding=True)
            scores += hf(**enc).logits[:, 0].tolist()
    return time.perf_counter() - start, scores


def ours(folder: Path, texts: list[str], prefix: bool) -> tuple[float, list[float], int]:
    from batchgen.pooling.scorer import RewardModel

    rm = RewardModel(folder, seed=0, enable_prefix_caching=prefix)
    rm.reward(texts[:2])  # warm-up
    rm.llm.reset_prefix_cache()
    start = time.perf_counter()
    scores = [o.outputs.probs[0] for o in rm.reward(texts)]
    return time.perf_counter() - start, scores, rm.llm.kv_stats().prefix_hit_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp), args.hidden, args.layers)
        texts = workload(args.prompts, args.n)
        t_hf, s_hf = hf_scores(folder, texts, batch=args.n)
        t_on, s_on, hits = ours(folder, texts, prefix=True)
        t_off, s_off, _ = ours(folder, texts, prefix=False)
    diff = max(abs(a - b) for a, b in zip(s_hf, s_on))
    print(f"candidates {len(texts)}; HF padded batched forward {len(texts) / t_hf:.1f}/s")
    print(f"batchgen, prefix sharing: {len(texts) / t_on:.1f}/s ({t_hf / t_on:.2f}x HF), "
          f"prefix hit tokens {hits}")
    print(f"batchgen, no prefix caching: {len(texts) / t_off:.1f}/s ({t_hf / t_off:.2f}x HF)")
    print(f"max |reward - HF| {diff:.2e}; with vs without sharing max diff "
          f"{max(abs(a - b) for a, b in zip(s_on, s_off)):.2e}")


if __name__ == "__main__":
    main()

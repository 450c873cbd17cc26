"""Reward scoring throughput: batchgen's RewardModel (paged engine, prefix sharing) against HF's
padded batched `*ForSequenceClassification` forward, and against itself with prefix caching
off, on the same random llama reward model and a best-of-n workload (P prompts x N
candidates sharing each prompt). Ratios are candidates/s over HF's.

Embeddings (`--task embed`): batchgen's PoolingLLM.embed (last-token and mean pooling) against
HF's padded batched `AutoModel` forward + the same pooling, on the same random backbone and
texts of mixed lengths that open with one shared instruction (as Qwen3-Embedding queries do).

    python benchmarks/pooling.py [--task all|reward|embed] [--prompts 8] [--n 8]
        [--texts 64] [--hidden 256] [--layers 4]
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


def embed_texts(count: int) -> list[str]:
    rng = random.Random(1)
    words = "the a moon sun river stone light quick slow blue red answer is".split()
    head = "Instruct: given a question, retrieve passages that answer it\nQuery: "
    return [head + " ".join(rng.choice(words) for _ in range(rng.randint(8, 80)))
            for _ in range(count)]


def hf_embeddings(folder: Path, texts: list[str], batch: int, mean: bool
                  ) -> tuple[float, torch.Tensor]:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token_id, tok.padding_side = 0, "right"
    hf = AutoModel.from_pretrained(folder, dtype="float32").eval()
    start, out = time.perf_counter(), []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], return_tensors="pt", padding=True)
            states, mask = hf(**enc).last_hidden_state, enc["attention_mask"]
            if mean:
                v = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            else:
                v = states[torch.arange(len(states)), mask.sum(1) - 1]
            out.append(torch.nn.functional.normalize(v, dim=-1))
    return time.perf_counter() - start, torch.cat(out)


def ours_embed(folder: Path, texts: list[str], kind: str, prefix: bool
               ) -> tuple[float, torch.Tensor, int]:
    from batchgen.pooling.llm import PoolingLLM

    llm = PoolingLLM(folder, seed=0, pooler_config={"pooling_type": kind},
                     enable_prefix_caching=prefix)
    llm.embed(texts[:2])  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    vecs = torch.tensor([o.outputs.embedding for o in llm.embed(texts)])
    return time.perf_counter() - start, vecs, llm.kv_stats().prefix_hit_tokens


def embed_main(args: argparse.Namespace, root: Path) -> None:
    from transformers import AutoModel

    src = build(root, args.hidden, args.layers).parent / "lm"
    folder = root / "emb"
    AutoModel.from_pretrained(src, dtype="float32").save_pretrained(folder)
    for f in src.iterdir():
        if "token" in f.name:
            shutil.copy(f, folder / f.name)
    texts = embed_texts(args.texts)
    print(f"embedding {len(texts)} texts (HF padded batches of 16)")
    for kind in ("LAST", "MEAN"):
        t_hf, v_hf = hf_embeddings(folder, texts, 16, kind == "MEAN")
        print(f"  {kind}: HF padded batched AutoModel forward {len(texts) / t_hf:.1f}/s")
        for prefix in (True, False):
            t, v, hits = ours_embed(folder, texts, kind, prefix)
            print(f"  {kind}: batchgen embed, prefix caching {'on' if prefix else 'off'}: "
                  f"{len(texts) / t:.1f}/s ({t_hf / t:.2f}x HF), prefix hit tokens {hits}, "
                  f"max |emb - HF| {(v - v_hf).abs().max():.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--task", choices=("all", "reward", "embed"), default="all")
    args = ap.parse_args()
    if args.task != "reward":
        with tempfile.TemporaryDirectory() as tmp:
            embed_main(args, Path(tmp))
    if args.task == "embed":
        return
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

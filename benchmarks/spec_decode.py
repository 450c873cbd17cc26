"""ngram speculative decoding (batchgen/speculative) against plain decoding and HF generate's
prompt lookup, greedy, on a random Llama and a repetitive workload:

  batchgen            every prompt at once, no speculation
  batchgen + ngram    the same with speculative_config={"method": "ngram", ...}
  HF generate         one prompt at a time (prompt lookup takes batch 1)
  HF prompt lookup    generate(prompt_lookup_num_tokens=k), one prompt at a time

On the random Llama, prompts are a random pattern repeated (the copy-heavy shape prompt lookup
is for); its greedy text loops now and then, so acceptance is what it is. With --model (a
folder, or smollm2: the real SmolLM2-135M-Instruct) prompts are chat requests to copy a list
with one change, where drafts from the prompt are what the model writes. Every system's
tokens are compared with HF's plain greedy ones.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/spec_decode.py [--num-prompts 16]
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/spec_decode.py --model smollm2
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import common as h

DOC = __doc__


def repetitive_prompts(args: Any) -> list[list[int]]:
    """Per prompt a random pattern of --pattern-len ids, repeated --repeat times."""
    rng = random.Random(args.seed)
    return [[rng.randrange(h.FIRST_REGULAR_ID, args.vocab_size)
             for _ in range(args.pattern_len)] * args.repeat for _ in range(args.num_prompts)]


ITEMS = ["apples", "bread", "cheese", "dates", "eggs", "flour", "grapes", "honey", "ice",
         "jam", "kale", "lemons"]


def copy_requests(args: Any, tokenizer: Any) -> list[list[int]]:
    """Chat requests to copy a numbered list with one item changed (a real model's copy)."""
    rng = random.Random(args.seed)
    texts = []
    for _ in range(args.num_prompts):
        items = rng.sample(ITEMS, 8)
        listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        texts.append(f"Copy this shopping list exactly, but write 'milk' instead of "
                     f"'{items[3]}':\n{listing}")
    return h.chat_prompts(tokenizer, texts)


@contextlib.contextmanager
def workload(args: Any) -> Iterator[tuple[Path, list[list[int]]]]:
    """The model folder and token prompts: --model's with copy requests, else the random
    Llama with repeated patterns."""
    if args.model:
        from transformers import AutoTokenizer

        folder = h.resolve_model(args.model)
        yield folder, copy_requests(args, AutoTokenizer.from_pretrained(folder))
        return
    with h.prepare_model_dir(args, args.pattern_len * args.repeat + args.output_len) as folder:
        yield folder, repetitive_prompts(args)


def hf_one_by_one(model: torch.nn.Module, prompts: list[list[int]], n: int,
                  lookup: int | None) -> list[list[int]]:
    """HF greedy per prompt (EOS banned until n: min_new_tokens), with prompt lookup when
    set."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, **kw)
        out.append(got[0, len(p):].tolist())
    return out


def main(argv: list[str] | None = None) -> dict:
    p = h.parser(DOC, model={"hidden_size": 256, "num_layers": 4, "vocab_size": 4096},
                 workload={"num_prompts": 16, "min_prompt_len": None, "max_prompt_len": None,
                           "output_len": 64}, run={"repeats": 1}, engine={})
    h.add_ints(p.add_argument_group("speculation"), pattern_len=6, repeat=4, k=3,
               lookup_min=1, lookup_max=3)
    p.add_argument("--model", default=None, help="a model folder or smollm2 (default: the "
                   "random Llama of the model flags)")
    args = h.check_args(p, p.parse_args(argv), "pattern_len", "repeat", "k")
    info = h.start(args)
    n = args.output_len
    ngram = {"method": "ngram", "num_speculative_tokens": args.k,
             "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    with workload(args) as (folder, prompts):
        from batchgen import LLM, SamplingParams

        hf = h.load_hf_model(folder, h.DTYPES[args.dtype], args.device)
        plain = LLM(str(folder), **h.engine_kwargs(args))
        spec = LLM(str(folder), **h.engine_kwargs(args), speculative_config=ngram)
        ids = h.token_prompts(prompts)
        params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)  # HF's min_new_tokens
        systems = {"batchgen": lambda: h.bg_tokens(plain, prompts, params),
                   "batchgen + ngram": lambda: h.bg_tokens(spec, prompts, params),
                   "HF generate": lambda: hf_one_by_one(hf, prompts, n, None),
                   f"HF prompt lookup (k={args.k})": lambda: hf_one_by_one(hf, prompts, n,
                                                                            args.k)}
        plain.generate(ids[:2], h.greedy(4), use_tqdm=False)  # warm-ups
        spec.generate(ids[:2], h.greedy(4), use_tqdm=False)
        runs = h.interleaved_repeats([h.Contender(k, f) for k, f in systems.items()],
                                     args.repeats, args.device)
        stats = spec.kv_stats()
    ref = runs[2][0]
    rows, results = [], {}
    for name, (tokens, walls) in zip(systems, runs):
        wall = min(walls)
        same = sum(a == b for a, b in zip(tokens, ref))
        rows.append([name, f"{wall:.2f}", f"{len(prompts) * n / wall:.0f}",
                     f"{same}/{len(prompts)}"])
        results[name] = {"wall_s": wall, "agree_with_hf": same}
    rate = stats.spec_accepted_tokens / max(stats.spec_draft_tokens, 1)
    h.table(["system", "wall s", "tok/s", "greedy = HF"], rows)
    w = {k: v["wall_s"] for k, v in results.items()}
    print(f"\nbatchgen ngram vs plain: {h.fmt_ratio(w['batchgen'], w['batchgen + ngram'])}; "
          f"HF lookup vs plain: {h.fmt_ratio(w['HF generate'], w[rows[3][0]])}; "
          f"acceptance {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} draft tokens "
          f"({h.pct(rate)}), {stats.spec_drafts} drafts (last timed call)")
    print(f"model: {args.model}" if args.model else h.model_line(args))
    return h.finish(args, info, {"results": results, "acceptance": rate,
                                 "drafts": stats.spec_drafts})


if __name__ == "__main__":
    main()

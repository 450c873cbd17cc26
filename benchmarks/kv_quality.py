"""What an fp8 KV cache costs in quality: greedy tokens and logprobs with an fp8 (e4m3, scales
1.0) pool against a bfloat16 pool, both against a float32 pool, on the same random Llama.

Per pair: requests with identical greedy tokens, the mean common prefix, and the mean and max
|Δ logprob| of the chosen tokens where the sequences still agree. ``--model-dir`` takes a
trained model (with a tokenizer: natural chat prompts instead of random ids).

    PYTHONPATH=. python benchmarks/kv_quality.py
    PYTHONPATH=. python benchmarks/kv_quality.py --model-dir SMOLLM2   # a trained model folder
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common as h  # noqa: E402

KV_DTYPES = ("float32", "bfloat16", "fp8")
# With a trained model (--model-dir holding one with a tokenizer), natural prompts: random token
# ids would make it guess among near-ties, where any rounding flips the greedy token.
TEXT_PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.",
    "Explain why the sky is blue in two sentences.", "def fibonacci(n):",
    "List three uses of a paperclip:", "The mitochondria is the powerhouse of",
    "Translate to French: Good morning, how are you?", "Once upon a time, in a small village,",
    "What is 17 times 23? Answer:", "The three primary colors are",
    "Summarize the plot of Romeo and Juliet.", "import numpy as np\n\ndef normalize(x):",
    "A haiku about autumn leaves:", "The largest planet in the solar system is",
    "Give me a recipe for pancakes. Ingredients:", "Photosynthesis converts",
]


def run(model_dir: Path, prompts: list[list[int]], args: Any, kv: str
        ) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs with a ``kv`` pool."""
    from batchgen import LLM, SamplingParams

    llm = LLM(str(model_dir), kv_cache_dtype=kv, dtype=args.dtype, device=args.device,
              enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, logprobs=0, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(h.token_prompts(prompts), sp, use_tqdm=False)]
    return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for c in outs]


def compare(ref: list[tuple[list[int], list[float]]], got: list[tuple[list[int], list[float]]]
            ) -> dict[str, float]:
    agree = h.agreement([t for t, _ in ref], [t for t, _ in got])
    deltas = []
    for (ta, la), (tb, lb) in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        deltas += [abs(x - y) for x, y in zip(la[:n], lb[:n])]
    return {"identical": agree["identical"] / len(ref), "mean_prefix": agree["mean_prefix_frac"],
            "mean_abs_dlogprob": sum(deltas) / max(len(deltas), 1),
            "max_abs_dlogprob": max(deltas, default=0.0)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = h.parser(__doc__)
    h.add_model_args(p)
    h.add_workload_args(p, num_prompts=64, min_prompt_len=16, max_prompt_len=256, output_len=32)
    h.add_run_args(p, repeats=None)
    args = h.check_args(p, p.parse_args(argv))
    info = h.start(args)
    prompts = h.workload_prompts(args)
    with h.prepare_model_dir(args, args.max_prompt_len + args.output_len) as model_dir:
        if (Path(model_dir) / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            prompts = h.chat_prompts(AutoTokenizer.from_pretrained(model_dir), TEXT_PROMPTS)
        runs = {kv: run(model_dir, prompts, args, kv) for kv in KV_DTYPES}
    rows, results = [], {}
    for i, kv in enumerate(KV_DTYPES[1:], 1):
        for ref in KV_DTYPES[:i]:
            r = results[f"{kv}_vs_{ref}"] = compare(runs[ref], runs[kv])
            rows.append([f"{kv} vs {ref} pool", h.pct(r["identical"]), h.pct(r["mean_prefix"]),
                         f"{r['mean_abs_dlogprob']:.2e}", f"{r['max_abs_dlogprob']:.2e}"])
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.output_len} greedy tokens, model {args.dtype}")
    print(h.markdown_table(["KV cache", "identical greedy outputs", "mean common prefix",
                            "mean |Δ logprob| (agreeing positions)", "max |Δ logprob|"], rows))
    return h.finish(args, info, {"results": results}, note=None)


if __name__ == "__main__":
    main()

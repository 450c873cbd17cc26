"""What an fp8 KV cache costs in quality: greedy tokens and logprobs with an fp8 (e4m3, scales
1.0) pool and a bfloat16 pool, each against a float32 pool, on the same model.

``--model-dir`` takes a trained model; with a tokenizer the prompts are ``common.QUESTIONS``.

    PYTHONPATH=. python benchmarks/kv_quality.py --model-dir SMOLLM2   # a trained model folder
"""

from pathlib import Path

from batchgen import LLM
from benchmarks import common as h

KV_DTYPES = ("float32", "bfloat16", "fp8")


def run(model_dir: Path, prompts: list[list[int]], args, kv: str) -> list[tuple[list, list]]:
    llm = LLM(str(model_dir), kv_cache_dtype=kv, dtype=args.dtype, device=args.device,
              enable_prefix_caching=False)
    outs = llm.generate(h.token_prompts(prompts), h.greedy(args.output_len, logprobs=0),
                        use_tqdm=False)
    return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outs)]


def compare(ref: list[tuple[list, list]], got: list[tuple[list, list]]) -> dict[str, float]:
    agree = h.agreement([t for t, _ in ref], [t for t, _ in got])
    deltas = []
    for (ta, la), (tb, lb) in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        deltas += [abs(x - y) for x, y in zip(la[:n], lb[:n])]
    return {"identical": agree["identical"] / len(ref), "mean_prefix": agree["mean_prefix_frac"],
            "mean_abs_dlogprob": sum(deltas) / max(len(deltas), 1),
            "max_abs_dlogprob": max(deltas, default=0.0)}


def main(argv: list[str] | None = None) -> dict:
    p = h.parser(__doc__, model={}, run={"repeats": None}, workload={
        "num_prompts": 64, "min_prompt_len": 16, "max_prompt_len": 256, "output_len": 32})
    args = h.check_args(p, p.parse_args(argv))
    info = h.start(args)
    prompts = h.workload_prompts(args)
    with h.prepare_model_dir(args, args.max_prompt_len + args.output_len) as model_dir:
        if (Path(model_dir) / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            prompts = h.chat_prompts(AutoTokenizer.from_pretrained(model_dir), h.QUESTIONS)
        runs = {kv: run(model_dir, prompts, args, kv) for kv in KV_DTYPES}
    rows, results = [], {}
    for i, kv in enumerate(KV_DTYPES[1:], 1):
        for ref in KV_DTYPES[:i]:
            r = results[f"{kv}_vs_{ref}"] = compare(runs[ref], runs[kv])
            rows.append([f"{kv} vs {ref} pool", h.pct(r["identical"]), h.pct(r["mean_prefix"]),
                         f"{r['mean_abs_dlogprob']:.2e}", f"{r['max_abs_dlogprob']:.2e}"])
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.output_len} greedy tokens, model {args.dtype}")
    h.table(["KV cache", "identical greedy outputs", "mean common prefix",
             "mean |Δ logprob| (agreeing positions)", "max |Δ logprob|"], rows)
    return h.finish(args, info, {"results": results})


if __name__ == "__main__":
    main()

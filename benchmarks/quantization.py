"""Quantized weights and an fp8 KV pool on one model: each CPU-runnable method's weight bytes as
loaded, the KV tokens a fixed memory budget leaves, greedy tokens/s, and greedy agreement with
the full-precision model; then an fp8 KV pool with and without the checkpoint's k/v scales
against the full-precision pool (token agreement, logprob error). Prompts: the examples' chat
questions through the model's chat template.

The quantized variants are made from `--model` with each library's own API (the builders
of tests/quant_models.py); a GGUF file (`--gguf`, e.g. the SmolLM2 Q4_1 that
`python -m batchgen.tools.smollm2` starts from) runs too.

    PYTHONPATH=. python benchmarks/quantization.py --model smollm2 --gguf FILE.gguf
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path
from typing import Any

from batchgen import LLM
from batchgen.quantization import weight_bytes
from benchmarks import common as h
from tests import quant_models

# method → (packages it needs, how its LLM is made from (folder, scratch dir, args))
METHODS: dict[str, tuple[tuple[str, ...], Any]] = {
    "full precision": ((), lambda m, d, a: {"model": m}),
    "compressed-tensors int8": (("compressed_tensors",), lambda m, d, a: {
        "model": quant_models.compressed_tensors(m, d / "ct", "int8")}),
    "bitsandbytes 8-bit": (("bitsandbytes",), lambda m, d, a: {
        "model": quant_models.bitsandbytes(m, d / "bnb8", 8)}),
    "bitsandbytes nf4 (online)": (("bitsandbytes",), lambda m, d, a: {
        "model": m, "quantization": "bitsandbytes"}),
    "torchao int8 (online)": (("torchao",), lambda m, d, a: {
        "model": m, "quantization": "torchao"}),
    "gguf (file)": (("gguf",), lambda m, d, a: {"model": a.gguf, "tokenizer": m}),
}


def run_method(kw: dict[str, Any], prompts: list[list[int]], args: argparse.Namespace
               ) -> dict[str, Any]:
    """One method: its LLM, weight bytes, KV tokens in the budget, a timed greedy run."""
    llm = LLM(str(kw.pop("model")), dtype=args.dtype, enable_prefix_caching=False,
              num_kv_blocks=h.blocks_for(args.max_prompt_len + args.output_len, 16)
              * args.num_prompts, **kw)
    weights = weight_bytes(llm.model)
    beta = llm.cache_config.bytes_per_token
    kv_tokens = max(0, int(args.budget_gib * 2**30 * 0.9) - weights) // beta
    llm.generate(h.token_prompts(prompts[:2]), h.greedy(4), use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = llm.generate(h.token_prompts(prompts), h.greedy(args.output_len), use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"weight_bytes": weights, "kv_tokens": kv_tokens, "wall_s": wall,
            "tok_s": sum(map(len, tokens)) / wall, "tokens": tokens}


def kv_runs(model: Path, scratch: Path, prompts: list[list[int]], calibration: list[list[int]],
            args: argparse.Namespace) -> dict[str, Any]:
    """An fp8 pool without scales and with scales calibrated on other prompts (|K|, |V| maxima
    / 448, written into a copy of the folder under llm-compressor's names), each against the
    model-dtype pool."""
    import shutil

    from transformers import AutoModelForCausalLM

    scaled = shutil.copytree(model, scratch / "kv-scaled")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype="float32").eval()
    amax = quant_models._kv_amax(hf, prompts=calibration)
    quant_models._write_kv_scales(scaled, amax, None)
    results = {}
    for name, folder, kv in (("auto", model, "auto"), ("fp8, scales 1.0", model, "fp8"),
                             ("fp8, checkpoint scales", scaled, "fp8"),
                             ("fp8_e5m2, scales 1.0", model, "fp8_e5m2"),
                             ("fp8_e5m2, checkpoint scales", scaled, "fp8_e5m2")):
        llm = LLM(str(folder), dtype=args.dtype, kv_cache_dtype=kv, enable_prefix_caching=False)
        outs = llm.generate(h.token_prompts(prompts), h.greedy(args.output_len, logprobs=0),
                            use_tqdm=False)
        results[name] = [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                         for c in (o.outputs[0] for o in outs)]
    return results


def logprob_error(ref: list, got: list) -> tuple[float, float]:
    """Mean and max |Δ logprob| over each row's tokens up to where the two first part."""
    deltas = []
    for (ta, la), (tb, lb) in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        deltas += [abs(x - y) for x, y in zip(la[:n], lb[:n])]
    return sum(deltas) / max(len(deltas), 1), max(deltas, default=0.0)


def main(argv: list[str] | None = None) -> dict:
    p = h.parser(__doc__, run={"repeats": None}, workload={
        "num_prompts": 16, "min_prompt_len": None, "max_prompt_len": 128, "output_len": 32})
    p.add_argument("--model", type=h.resolve_model, default="smollm2",
                   help="a full-precision model folder, or 'smollm2' / 'tiny' (made once)")
    p.add_argument("--gguf", type=Path, default=None, help="a .gguf of the same model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--budget-gib", type=float, default=1.0,
                   help="device memory the KV tokens are counted in (0.9 of it, less weights)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    args = h.check_args(p, p.parse_args(argv))
    info = h.start(args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)  # the examples' chat questions
    prompts = h.chat_prompts(tokenizer, h.QUESTIONS[:args.num_prompts])
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.methods.split(","):
            needs, make = METHODS[name]
            if any(importlib.util.find_spec(n) is None for n in needs) or (
                    name.startswith("gguf") and args.gguf is None):
                print(f"{name}: skipped (not installed, or no --gguf)")
                continue
            rows[name] = run_method(make(args.model, Path(tmp), args), prompts, args)
        full = rows.get("full precision")
        for name, r in rows.items():
            agree = h.agreement(full["tokens"], r["tokens"]) if full else None
            r["agreement"] = agree
            print(f"{name}: weights {r['weight_bytes'] / 2**20:.1f} MiB, KV tokens in "
                  f"{args.budget_gib:g} GiB: {r['kv_tokens']:,}, {r['tok_s']:.1f} tok/s"
                  + (f" ({r['tok_s'] / full['tok_s']:.2f}x), greedy vs full: "
                     f"{agree['identical']}/{agree['of']} identical, prefix "
                     f"{100 * agree['mean_prefix_frac']:.0f}%" if full else ""))
        calibration = h.chat_prompts(tokenizer, h.QUESTIONS[args.num_prompts:])
        kv = kv_runs(args.model, Path(tmp), prompts, calibration or prompts, args)
    ref = kv.pop("auto")
    for name, got in kv.items():
        agree = h.agreement([t for t, _ in ref], [t for t, _ in got])
        mean, worst = logprob_error(ref, got)
        rows[f"kv {name}"] = {"agreement": agree, "mean_abs_dlogprob": mean,
                              "max_abs_dlogprob": worst}
        print(f"KV {name} vs the model-dtype pool: {agree['identical']}/{agree['of']} "
              f"identical, prefix {100 * agree['mean_prefix_frac']:.0f}%, |dlogprob| mean "
              f"{mean:.4f} max {worst:.4f}")
    for r in rows.values():
        r.pop("tokens", None)
    return h.finish(args, info, {"results": rows})


if __name__ == "__main__":
    main()

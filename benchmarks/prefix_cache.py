"""Prefix caching on a shared-system-prompt workload: batchgen with caching on and off, and HF
`generate`, on the same random-weight Llama model, in one process.

Workload (defaults): 200 requests = one 512-token system prompt + a 32-64 token question each,
32 output tokens (greedy, EOS ignored). Reports requests/s, the prompt tokens each system ran
through the model, and the ratios; asserts that caching on and off give identical tokens.

    PYTHONPATH=. python benchmarks/prefix_cache.py            # full run
    PYTHONPATH=. python benchmarks/prefix_cache.py --num-prompts 20 --skip-hf   # quick look
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    DTYPES,
    FIRST_REGULAR_ID,
    Result,
    add_model_args,
    add_run_args,
    args_dict,
    fmt_ratio,
    hf_generate_all,
    load_hf_model,
    machine_info,
    machine_line,
    markdown_table,
    parse_int_list,
    prepare_model_dir,
    quiet_logging,
    timed_repeats,
    write_json,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    add_run_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--system-len", type=int, default=512)
    g.add_argument("--min-question-len", type=int, default=32)
    g.add_argument("--max-question-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--hf-batch-sizes", default="8,32")
    g.add_argument("--skip-hf", action="store_true")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.output_len < 1 or args.system_len < 1:
        p.error("--num-prompts, --output-len and --system-len must be >= 1")
    if not 1 <= args.min_question_len <= args.max_question_len:
        p.error("need 1 <= --min-question-len <= --max-question-len")
    args.hf_batch_sizes = parse_int_list(p, args.hf_batch_sizes, "--hf-batch-sizes")
    return args


def make_workload(args: argparse.Namespace) -> list[list[int]]:
    """One shared system prompt + a random question per request (seeded)."""
    rng = random.Random(args.seed)
    system = [rng.randrange(FIRST_REGULAR_ID, args.vocab_size) for _ in range(args.system_len)]
    return [system + [rng.randrange(FIRST_REGULAR_ID, args.vocab_size)
                      for _ in range(rng.randint(args.min_question_len, args.max_question_len))]
            for _ in range(args.num_prompts)]


def run_batchgen(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace,
                 caching: bool) -> tuple[Result, list[list[int]]]:
    """A fresh engine per timed run, so every run starts with an empty prefix cache."""
    from batchgen import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    stats = []

    def go() -> list[list[int]]:
        llm = LLM(str(model_dir), block_size=args.block_size, dtype=args.dtype,
                  device=args.device, enable_prefix_caching=caching, seed=args.seed)
        outs = llm.generate(reqs, sp, use_tqdm=False)
        stats.append(llm.kv_stats())
        return [list(o.outputs[0].token_ids) for o in outs]

    warm = LLM(str(model_dir), block_size=args.block_size, dtype=args.dtype, device=args.device)
    warm.generate(reqs[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    del warm
    tokens, walls = timed_repeats(go, args.repeats, args.device)
    s = stats[0]
    name = "batchgen, prefix caching " + ("on" if caching else "off")
    res = Result(name, f"block {args.block_size}", min(walls),
                 sum(map(len, tokens)), sum(map(len, prompts)),
                 {"prompt_tokens_computed": s.prompt_tokens_computed,
                  "prefix_hit_tokens": s.prefix_hit_tokens, "peak_blocks": s.peak_blocks_in_use,
                  "num_blocks": s.num_blocks, "preemptions": s.preemptions, "walls": walls})
    return res, tokens


def run_hf(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace
           ) -> list[tuple[Result, list[list[int]]]]:
    """HF generate, left-padded batches in input order; every prompt is computed in full."""
    model = load_hf_model(model_dir, DTYPES[args.dtype], args.device)
    L = args.output_len
    runs = []
    for bs in args.hf_batch_sizes:
        def go(bs: int = bs) -> list[list[int]]:
            return hf_generate_all(model, prompts, bs, L, args.device, 1, do_sample=False)

        with torch.inference_mode():
            hf_generate_all(model, prompts[:2], 2, 2, args.device, 1, do_sample=False)
        tokens, walls = timed_repeats(go, args.repeats, args.device)
        runs.append((Result("HF generate", f"sdpa, batch {bs}, left-padded", min(walls),
                            sum(map(len, tokens)), sum(map(len, prompts)),
                            {"batch_size": bs, "prompt_tokens_computed": len(prompts)
                             * max(map(len, prompts)), "walls": walls}), tokens))
    return runs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    quiet_logging()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = make_workload(args)
    n_prompt = sum(map(len, prompts))
    questions = n_prompt - args.system_len * len(prompts)
    ideal = args.system_len + questions
    info = machine_info(args.device)
    print(f"workload: {len(prompts)} requests = {args.system_len}-token system prompt + "
          f"{args.min_question_len}-{args.max_question_len} token question "
          f"({n_prompt} prompt tokens, {ideal} distinct), {args.output_len} output tokens",
          flush=True)
    results: list[Result] = []
    outputs: dict[str, list[list[int]]] = {}
    with prepare_model_dir(args, args.system_len + args.max_question_len + args.output_len
                           ) as model_dir:
        for caching in (True, False):
            res, toks = run_batchgen(model_dir, prompts, args, caching)
            results.append(res)
            outputs[res.system] = toks
            print(f"  {res.system}: {res.wall_s:.2f} s", flush=True)
            gc.collect()
        if not args.skip_hf:
            for res, toks in run_hf(model_dir, prompts, args):
                results.append(res)
                outputs[f"{res.system} {res.config}"] = toks
                print(f"  {res.system} ({res.config}): {res.wall_s:.2f} s", flush=True)

    on, off = results[0], results[1]
    assert outputs[on.system] == outputs[off.system], "caching changed the greedy tokens"
    expected = len(prompts) * args.output_len
    assert all(r.output_tokens == expected for r in results)
    rows = []
    for r in results:
        rps = len(prompts) / r.wall_s
        rows.append([r.system, r.config, f"{r.wall_s:.2f}", f"{rps:.1f}",
                     str(r.extra["prompt_tokens_computed"]), fmt_ratio(on.wall_s ** -1,
                                                                      r.wall_s ** -1)])
    print()
    wall_head = "wall s" if args.repeats == 1 else f"wall s (best of {args.repeats})"
    print(markdown_table(["system", "config", wall_head, "requests/s", "prompt tokens run",
                          "caching on / this"], rows))
    computed = on.extra["prompt_tokens_computed"]
    print(f"\ncaching on / off: {off.wall_s / on.wall_s:.2f}x requests/s; prompt tokens run "
          f"with caching: {computed} = {computed / ideal:.3f} x (system + questions = {ideal}); "
          f"prefix hits {on.extra['prefix_hit_tokens']} tokens")
    print(machine_line(info))
    payload = {"machine": info, "args": args_dict(args), "prompt_tokens": n_prompt,
               "distinct_prompt_tokens": ideal, "results": [r.to_dict() for r in results],
               "summary": {"on_over_off": off.wall_s / on.wall_s,
                           "computed_over_ideal": computed / ideal}}
    if args.json is not None:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()

"""Preemption by swap vs by recompute (`swap_space`): n samples and wide beams over long prompts
in a KV pool too small to hold every group, on a random-weight Llama, in one process.

Workload (defaults): 8 prompts of 256-384 tokens; n=8 samples (temperature 1, seeded) and beam
search of width 8, 64 new tokens each (EOS ignored). The pool is ``--pool-factor`` times the
largest request's exact admission bound (``request_peak_blocks``): one group always fits, all
of them never do, so groups preempt each other. Three engines per workload, each a fresh
``LLM`` per timed run (empty prefix cache): a roomy pool (no preemption: the reference tokens),
the tight pool with ``preemption_mode="recompute"``, and the tight pool with a host pool of
``--swap-factor`` times the device pool (``swap_space`` in GiB). Reports wall time (best of
``--repeats``, runs interleaved), preemptions, swaps, blocks moved and the prompt tokens the
model ran (a recompute runs a group's prompt again, and its generated tokens as a prompt too);
asserts that swap gives the reference's tokens (a recompute reruns generated tokens through
prefill tiles, whose last bits differ: a near tie among sampled tokens can flip, so its
sequences identical to the reference are counted instead).

    PYTHONPATH=. python benchmarks/swap.py
    PYTHONPATH=. python benchmarks/swap.py --num-prompts 4 --output-len 16 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Contender,
    add_model_args,
    add_run_args,
    add_workload_args,
    args_dict,
    check_workload_args,
    interleaved_repeats,
    machine_info,
    machine_line,
    make_prompts,
    markdown_table,
    prepare_model_dir,
    quiet_logging,
    write_json,
)

GIB = 2**30


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    add_run_args(p)
    add_workload_args(p, num_prompts=8, min_prompt_len=256, max_prompt_len=384, output_len=64)
    g = p.add_argument_group("swap")
    g.add_argument("--n", type=int, default=8, help="samples per prompt")
    g.add_argument("--beam-width", type=int, default=8)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--pool-factor", type=float, default=1.5,
                   help="device pool = this x the largest request's exact bound (>= 1)")
    g.add_argument("--swap-factor", type=float, default=4.0,
                   help="host pool = this x the device pool's blocks")
    g.add_argument("--no-prefix-caching", action="store_true")
    args = p.parse_args(argv)
    check_workload_args(p, args)
    if args.pool_factor < 1 or args.swap_factor <= 0 or args.n < 1 or args.beam_width < 1:
        p.error("need --pool-factor >= 1, --swap-factor > 0, --n >= 1, --beam-width >= 1")
    return args


def pool_blocks(prompts: list[list[int]], width: int, args: argparse.Namespace) -> int:
    """The tight pool: --pool-factor x the largest request's admission bound."""
    from batchgen.engine.kv_manager import request_peak_blocks

    bound = max(request_peak_blocks(len(p), width, args.output_len, args.block_size)
                for p in prompts)
    return int(bound * args.pool_factor)


def contender(model_dir: Path, name: str, engine: dict[str, Any], kind: str, reqs: list,
              params: Any, args: argparse.Namespace) -> Contender:
    """One engine setting: a fresh LLM per run (every run starts from an empty prefix cache);
    its last run's kv_stats are kept for the report."""
    from batchgen import LLM

    kw = dict(block_size=args.block_size, dtype=args.dtype, device=args.device,
              enable_prefix_caching=not args.no_prefix_caching, seed=args.seed, **engine)
    stats: list[Any] = []

    def run() -> list[list[int]]:
        llm = LLM(str(model_dir), **kw)
        if kind == "samples":
            outs = llm.generate(reqs, params, use_tqdm=False)
            tokens = [list(c.token_ids) for o in outs for c in o.outputs]
        else:
            outs = llm.beam_search(reqs, params, use_tqdm=False)
            tokens = [list(s.token_ids) for o in outs for s in o.sequences]
        stats[:] = [llm.kv_stats()]
        return tokens

    def describe() -> tuple[str, dict[str, Any]]:
        s = stats[0]
        return name, {"preemptions": s.preemptions, "swap_outs": s.swap_outs,
                      "swap_ins": s.swap_ins, "blocks_swapped_out": s.blocks_swapped_out,
                      "prompt_tokens_computed": s.prompt_tokens_computed,
                      "prefix_hit_tokens": s.prefix_hit_tokens, "num_blocks": s.num_blocks,
                      "num_host_blocks": s.num_host_blocks,
                      "peak_blocks_in_use": s.peak_blocks_in_use}

    return Contender(name, run, describe)


def run_workload(model_dir: Path, kind: str, prompts: list[list[int]],
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    """Roomy, recompute and swap engines on one workload (samples or beams), interleaved."""
    from batchgen import LLM, BeamSearchParams, SamplingParams

    width = args.n if kind == "samples" else args.beam_width
    params = (SamplingParams(n=args.n, temperature=1.0, top_k=0, seed=args.seed,
                             max_tokens=args.output_len, ignore_eos=True) if kind == "samples"
              else BeamSearchParams(beam_width=width, max_tokens=args.output_len,
                                    ignore_eos=True))
    reqs = [{"prompt_token_ids": p} for p in prompts]
    tight = pool_blocks(prompts, width, args)
    beta = LLM(str(model_dir), block_size=args.block_size, dtype=args.dtype,
               num_kv_blocks=1, device=args.device).cache.bytes_per_token
    host_blocks = int(tight * args.swap_factor)
    gib = (host_blocks + 0.5) * args.block_size * beta / GIB
    roomy = 2 * len(prompts) * width * -(-(args.max_prompt_len + args.output_len)
                                         // args.block_size)
    engines = [("roomy pool (no preemption)", {"num_kv_blocks": roomy}),
               ("recompute", {"num_kv_blocks": tight, "preemption_mode": "recompute"}),
               ("swap", {"num_kv_blocks": tight, "swap_space": gib})]
    contenders = [contender(model_dir, name, kw, kind, reqs, params, args)
                  for name, kw in engines]
    warm = LLM(str(model_dir), block_size=args.block_size, dtype=args.dtype, device=args.device)
    warm.generate(reqs[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # untimed warm-up
    del warm
    runs = interleaved_repeats(contenders, args.repeats, args.device)
    ref = runs[0][0]
    rows = []
    for c, (tokens, walls) in zip(contenders, runs):
        same = sum(a == b for a, b in zip(tokens, ref))
        assert c.system != "swap" or same == len(ref), f"{kind}: swap changed the tokens"
        name, extra = c.describe()
        rows.append({"workload": f"{kind}, width {width}", "engine": name,
                     "wall_s": min(walls), "walls": walls, "same_as_roomy": same,
                     "sequences": len(ref), **extra})
    assert rows[0]["preemptions"] == 0 and rows[1]["preemptions"] > 0
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    quiet_logging()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                           args.vocab_size, args.seed)
    n_prompt = sum(map(len, prompts))
    info = machine_info(args.device)
    print(f"workload: {len(prompts)} prompts of {args.min_prompt_len}-{args.max_prompt_len} "
          f"tokens ({n_prompt} in all), {args.output_len} new tokens; n={args.n} samples and "
          f"beams of width {args.beam_width}; pool {args.pool_factor}x the largest request's "
          f"bound, host pool {args.swap_factor}x that", flush=True)
    rows: list[dict[str, Any]] = []
    with prepare_model_dir(args, args.max_prompt_len + args.output_len) as model_dir:
        for kind in ("samples", "beams"):
            rows += run_workload(model_dir, kind, prompts, args)
            gc.collect()
    head = "wall s" if args.repeats == 1 else f"wall s (best of {args.repeats})"
    table = [[r["workload"], r["engine"], r["num_blocks"], r["num_host_blocks"],
              f"{r['wall_s']:.2f}", r["preemptions"], r["swap_outs"], r["blocks_swapped_out"],
              r["prompt_tokens_computed"], f"{r['prompt_tokens_computed'] / n_prompt:.2f}",
              f"{r['same_as_roomy']}/{r['sequences']}"] for r in rows]
    print()
    print(markdown_table(["workload", "engine", "blocks", "host blocks", head, "preemptions",
                          "swap-outs", "blocks swapped out", "prompt tokens run",
                          "x prompt tokens", "sequences = roomy's"], table))
    print(f"\nswap gave the roomy pool's tokens; {n_prompt} prompt tokens in the workload")
    print(machine_line(info))
    payload = {"machine": info, "args": args_dict(args), "prompt_tokens": n_prompt,
               "results": rows}
    if args.json is not None:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()

"""Preemption by swap vs by recompute (`swap_space`): n samples and wide beams over long prompts
in a KV pool too small to hold every group, on a random-weight Llama, in one process.

A roomy pool (the reference tokens), and a tight one preempting by recompute and by swap, a fresh
``LLM`` per run, interleaved; swap must give the reference's tokens (asserted).

    PYTHONPATH=. python benchmarks/swap.py --repeats 2
"""

import gc
from pathlib import Path

from benchmarks import common as h

POOL_FACTOR, SWAP_FACTOR = 1.5, 4.0  # device pool / the largest bound, host pool / device pool


def run_workload(model_dir: Path, kind: str, prompts: list[list[int]], args) -> list[dict]:
    from batchgen import LLM, BeamSearchParams, SamplingParams

    width = args.n if kind == "samples" else args.beam_width
    params = (SamplingParams(n=args.n, temperature=1.0, top_k=0, seed=args.seed,
                             max_tokens=args.output_len, ignore_eos=True) if kind == "samples"
              else BeamSearchParams(beam_width=width, max_tokens=args.output_len,
                                    ignore_eos=True))

    def go(llm) -> list[list[int]]:
        if kind == "samples":
            return h.bg_tokens(llm, prompts, params)
        outs = llm.beam_search(h.token_prompts(prompts), params, use_tqdm=False)
        return [list(s.token_ids) for o in outs for s in o.sequences]

    tight = int(POOL_FACTOR * max(h.request_peak_blocks(
        len(p), width, args.output_len, args.block_size) for p in prompts))
    probe = LLM(str(model_dir), **h.engine_kwargs(args))
    gib = (int(tight * SWAP_FACTOR) + 0.5) * args.block_size * h.kv_bytes_per_token(
        probe) / 2**30
    roomy = 2 * len(prompts) * width * h.blocks_for(args.max_prompt_len + args.output_len,
                                                    args.block_size)
    h.bg_tokens(probe, prompts[:2], SamplingParams(max_tokens=2))  # warm-up
    del probe
    engines = [("roomy pool (no preemption)", {"num_kv_blocks": roomy}),
               ("recompute", {"num_kv_blocks": tight, "preemption_mode": "recompute"}),
               ("swap", {"num_kv_blocks": tight, "swap_space": gib})]
    runs = h.run_contenders([h.fresh_contender(
        name, model_dir, h.engine_kwargs(args, **kw), go,
        ", ".join(f"{k}={v:.4g}" for k, v in kw.items() if k != "preemption_mode"))
        for name, kw in engines], args, sum(map(len, prompts)))
    ref, rows = runs[0][1], []
    for r, tokens in runs:
        same = sum(a == b for a, b in zip(tokens, ref))
        assert r.system != "swap" or same == len(ref), f"{kind}: swap changed the tokens"
        rows.append({"workload": f"{kind}, width {width}", "engine": r.system,
                     "wall_s": r.wall_s, "walls": r.extra.pop("wall_s_all"),
                     "same_as_roomy": same, "sequences": len(ref), **r.extra})
    assert rows[0]["preemptions"] == 0 and rows[1]["preemptions"] > 0
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = h.parser(__doc__, model={}, run={}, workload={
        "num_prompts": 8, "min_prompt_len": 256, "max_prompt_len": 384, "output_len": 64})
    h.add_ints(p, n=8, beam_width=8, block_size=16)
    args = h.check_args(p, p.parse_args(argv), "n", "beam_width")
    info = h.start(args)
    prompts = h.workload_prompts(args)
    n_prompt = sum(map(len, prompts))
    print(h.workload_line(args, prompts, f"{args.output_len} new tokens; n={args.n} samples "
                          f"and beams of width {args.beam_width}; pool {POOL_FACTOR}x the "
                          f"largest request's bound, host pool {SWAP_FACTOR}x that"))
    rows = []
    with h.prepare_model_dir(args, args.max_prompt_len + args.output_len) as model_dir:
        for kind in ("samples", "beams"):
            rows += run_workload(model_dir, kind, prompts, args)
            gc.collect()
    h.table(["workload", "engine", "blocks", "host blocks", h.wall_head(args.repeats),
             "preemptions", "swap-outs", "blocks swapped out", "prompt tokens run",
             "x prompt tokens", "prefix-hit tokens", "sequences = roomy's"],
            [[r["workload"], r["engine"], r["num_blocks"], r["num_host_blocks"],
              f"{r['wall_s']:.2f}", r["preemptions"], r["swap_outs"], r["blocks_swapped_out"],
              r["prompt_tokens_computed"], f"{r['prompt_tokens_computed'] / n_prompt:.2f}",
              r["prefix_hit_tokens"], f"{r['same_as_roomy']}/{r['sequences']}"] for r in rows])
    print(f"\nswap gave the roomy pool's tokens; {n_prompt} prompt tokens in the workload")
    return h.finish(args, info, {"prompt_tokens": n_prompt, "results": rows})


if __name__ == "__main__":
    main()

"""Prefix caching on a shared-system-prompt workload: batchgen with caching on and off, and HF
`generate`, on the same random-weight Llama model, in one process.

Defaults: 200 requests = one 512-token system prompt + a 32-64 token question, 32 greedy tokens
(EOS ignored); a fresh ``LLM`` per batchgen run (timed; an empty cache each time). Reports
requests/s, the prompt tokens each system ran and the ratios; caching on and off must give the
same tokens (asserted).

    PYTHONPATH=. python benchmarks/prefix_cache.py
    PYTHONPATH=. python benchmarks/prefix_cache.py --num-prompts 20 --skip-hf   # quick look
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common as h  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = h.parser(__doc__)
    h.add_model_args(p)
    h.add_run_args(p)
    h.add_hf_args(p, generate_batch=False)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--system-len", type=int, default=512)
    g.add_argument("--min-question-len", type=int, default=32)
    g.add_argument("--max-question-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    args = h.check_args(p, p.parse_args(argv))
    if args.system_len < 1 or not 1 <= args.min_question_len <= args.max_question_len:
        p.error("need --system-len >= 1 and 1 <= --min-question-len <= --max-question-len")
    return args


def make_workload(args: Any) -> list[list[int]]:
    """One shared system prompt + a random question per request (seeded)."""
    rng = random.Random(args.seed)
    system = [rng.randrange(h.FIRST_REGULAR_ID, args.vocab_size) for _ in range(args.system_len)]
    return [system + [rng.randrange(h.FIRST_REGULAR_ID, args.vocab_size)
                      for _ in range(rng.randint(args.min_question_len, args.max_question_len))]
            for _ in range(args.num_prompts)]


def batchgen(model_dir: Path, prompts: list[list[int]], args: Any, caching: bool
             ) -> h.Contender:
    """A fresh engine per run (an empty prefix cache); the last run's kv_stats reported."""
    from batchgen import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llms: list[Any] = []

    def run() -> list[list[int]]:
        llms[:] = [LLM(str(model_dir), **h.engine_kwargs(args, enable_prefix_caching=caching))]
        return h.bg_tokens(llms[0], prompts, sp)

    h.warm_up(lambda ps, k: h.bg_tokens(LLM(str(model_dir), **h.engine_kwargs(args)), ps,
                                        SamplingParams(max_tokens=k)), prompts, 2)
    return h.Contender(f"batchgen, prefix caching {'on' if caching else 'off'}", run,
                       lambda: (f"block {args.block_size}", h.kv_describe(llms[0])[1]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    info = h.start(args)
    prompts = make_workload(args)
    n_prompt = sum(map(len, prompts))
    ideal = args.system_len + n_prompt - args.system_len * len(prompts)  # distinct tokens
    print(f"workload: {len(prompts)} requests = {args.system_len}-token system prompt + "
          f"{args.min_question_len}-{args.max_question_len} token question "
          f"({n_prompt} prompt tokens, {ideal} distinct), {args.output_len} output tokens",
          flush=True)
    max_len = args.system_len + args.max_question_len + args.output_len
    with h.prepare_model_dir(args, max_len) as model_dir:
        contenders = [batchgen(model_dir, prompts, args, caching) for caching in (True, False)]
        if not args.skip_hf:
            hf = h.load_hf_model(model_dir, h.DTYPES[args.dtype], args.device)
            contenders += h.hf_contenders(hf, prompts, args, args.output_len, do_sample=False)
        runs = h.run_contenders(contenders, args, n_prompt)
    (on, on_toks), (off, off_toks) = runs[:2]
    assert on_toks == off_toks, "caching changed the greedy tokens"
    results = [r for r, _ in runs]
    for r, toks in runs:
        h.check_lengths(r.system, toks, len(prompts), args.output_len)
        if "batch_size" in r.extra:  # HF computes every (padded) prompt position
            r.extra["prompt_tokens_computed"] = len(prompts) * max(map(len, prompts))
    rows = [[r.system, r.config, f"{r.wall_s:.2f}", f"{len(prompts) / r.wall_s:.1f}",
             str(r.extra["prompt_tokens_computed"]), h.fmt_ratio(r.wall_s, on.wall_s)]
            for r in results]
    print()
    print(h.markdown_table(["system", "config", h.wall_head(args.repeats), "requests/s",
                            "prompt tokens run", "caching on / this"], rows))
    computed = on.extra["prompt_tokens_computed"]
    print(f"\ncaching on / off: {off.wall_s / on.wall_s:.2f}x requests/s; prompt tokens run "
          f"with caching: {computed} = {computed / ideal:.3f} x (system + questions = {ideal}); "
          f"prefix hits {on.extra['prefix_hit_tokens']} tokens")
    return h.finish(args, info, {
        "prompt_tokens": n_prompt, "distinct_prompt_tokens": ideal,
        "results": [r.to_dict() for r in results],
        "summary": {"on_over_off": off.wall_s / on.wall_s, "computed_over_ideal": computed / ideal}})


if __name__ == "__main__":
    main()

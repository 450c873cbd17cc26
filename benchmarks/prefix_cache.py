"""Prefix caching on a shared-system-prompt workload: batchgen with caching on and off (a fresh
``LLM`` per run; their tokens must agree), and HF `generate`, on the random Llama.

    PYTHONPATH=. python benchmarks/prefix_cache.py
"""

import random

from batchgen import LLM
from benchmarks import common as h


def main(argv: list[str] | None = None) -> dict:
    p = h.parser(__doc__, model={}, run={}, hf={"generate_batch": False})
    g = p.add_argument_group("workload")
    for flag, default in (("--num-prompts", 200), ("--system-len", 512), ("--output-len", 32),
                          ("--min-question-len", 32), ("--max-question-len", 64),
                          ("--seed", 0), ("--block-size", 16)):
        g.add_argument(flag, type=int, default=default)
    args = h.check_args(p, p.parse_args(argv), "system_len", "min_question_len")
    if args.min_question_len > args.max_question_len:
        p.error("need --min-question-len <= --max-question-len")
    info = h.start(args)
    rng = random.Random(args.seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(h.FIRST_REGULAR_ID, args.vocab_size) for _ in range(k)]

    system = ids(args.system_len)  # + a question per request
    prompts = [system + ids(rng.randint(args.min_question_len, args.max_question_len))
               for _ in range(args.num_prompts)]
    n_prompt, L = sum(map(len, prompts)), args.output_len
    ideal = args.system_len + n_prompt - args.system_len * len(prompts)  # distinct tokens
    print(f"workload: {len(prompts)} requests = {args.system_len}-token system prompt + "
          f"{args.min_question_len}-{args.max_question_len} token question "
          f"({n_prompt} prompt tokens, {ideal} distinct), {L} output tokens", flush=True)
    with h.prepare_model_dir(args, args.system_len + args.max_question_len + L) as model_dir:
        h.warm_up(lambda ps, k: h.bg_tokens(LLM(str(model_dir), **h.engine_kwargs(args)), ps,
                                            h.greedy(k)), prompts, 2)
        contenders = [h.fresh_contender(
            f"batchgen, prefix caching {'on' if on else 'off'}", model_dir,
            h.engine_kwargs(args, enable_prefix_caching=on),
            lambda llm: h.bg_tokens(llm, prompts, h.greedy(L)), f"block {args.block_size}")
            for on in (True, False)]
        if not args.skip_hf:
            hf = h.load_hf_model(model_dir, h.DTYPES[args.dtype], args.device)
            contenders += h.hf_contenders(hf, prompts, args, L, do_sample=False)
        runs = h.run_contenders(contenders, args, n_prompt, expect=(len(prompts), L))
    (on, on_toks), (off, off_toks) = runs[:2]
    assert on_toks == off_toks, "caching changed the greedy tokens"
    for r, _ in runs:
        if "batch_size" in r.extra:  # HF computes every (padded) prompt position
            r.extra["prompt_tokens_computed"] = len(prompts) * max(map(len, prompts))
    h.table(["system", "config", h.wall_head(args.repeats), "requests/s", "prompt tokens run",
             "caching on / this"],
            [[r.system, r.config, f"{r.wall_s:.2f}", f"{len(prompts) / r.wall_s:.1f}",
              r.extra["prompt_tokens_computed"], h.fmt_ratio(r.wall_s, on.wall_s)]
             for r, _ in runs])
    computed = on.extra["prompt_tokens_computed"]
    print(f"\ncaching on / off: {off.wall_s / on.wall_s:.2f}x requests/s; prompt tokens run "
          f"with caching: {computed} = {computed / ideal:.3f} x (system + questions = {ideal}); "
          f"prefix hits {on.extra['prefix_hit_tokens']} tokens")
    return h.finish(args, info, {
        "prompt_tokens": n_prompt, "distinct_prompt_tokens": ideal,
        "results": [r.to_dict() for r, _ in runs],
        "summary": {"on_over_off": off.wall_s / on.wall_s,
                    "computed_over_ideal": computed / ideal}})


if __name__ == "__main__":
    main()

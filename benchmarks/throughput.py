"""Offline throughput: batchgen vs HF ``generate`` vs HF ``generate_batch`` (continuous batching).

Greedy, exactly ``--output-len`` tokens each (EOS ignored), interleaved rounds, greedy tokens
compared with batchgen's (prefix caching off: the repeats reuse the prompts).

    PYTHONPATH=. python benchmarks/throughput.py --repeats 3
"""

from batchgen import LLM
from benchmarks import common as h


def main(argv: list[str] | None = None) -> dict:
    p = h.parser(__doc__, model={}, workload={}, run={}, engine={}, hf={})
    args = h.check_args(p, p.parse_args(argv))
    info = h.start(args)
    prompts, L = h.workload_prompts(args), args.output_len
    n_prompt, expected = sum(map(len, prompts)), len(prompts) * L
    with h.prepare_model_dir(args, args.max_prompt_len + L) as model_dir:
        n_params = h.count_params(model_dir)
        print(h.model_line(args, n_params))
        print(h.workload_line(args, prompts, f"{L} output tokens each = {expected} output "
                                             "tokens, greedy, EOS ignored"), flush=True)
        llm = LLM(str(model_dir), **h.engine_kwargs(args, enable_prefix_caching=False))
        contenders = [h.batchgen_contender(llm, prompts, h.greedy, L)]
        if not args.skip_hf:
            hf = h.load_hf_model(model_dir, h.DTYPES[args.dtype], args.device)
            contenders += h.hf_contenders(hf, prompts, args, L, do_sample=False)
        if not args.skip_generate_batch:
            contenders.append(h.generate_batch_contender(model_dir, prompts, args, L,
                                                         do_sample=False))
        runs = h.run_contenders(contenders, args, n_prompt, expect=(len(prompts), L))
    results = [r for r, _ in runs]
    labels, summary, line = h.versus(results)
    h.table(["system", "batch / config", h.wall_head(args.repeats), "output tok/s",
             "batchgen / this"],
            [[label, r.config, f"{r.wall_s:.2f}", f"{r.output_tok_s:.1f}",
              h.fmt_ratio(results[0].output_tok_s, r.output_tok_s)]
             for label, r in zip(labels, results)])
    print("\n" + line)
    agree = {}
    for r, toks in runs[1:]:
        name = r.system + (f" bs={r.extra['batch_size']}" if "batch_size" in r.extra else "")
        agree[name] = h.agreement(runs[0][1], toks)
        print(h.agreement_line("batchgen", name, agree[name]))
    return h.finish(args, info, {
        "model_params": n_params, "prompt_tokens": n_prompt, "expected_output_tokens": expected,
        "results": [r.to_dict() for r in results], "summary": summary,
        "greedy_agreement_vs_batchgen": agree})


if __name__ == "__main__":
    main()

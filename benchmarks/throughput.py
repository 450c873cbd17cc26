"""Offline throughput: batchgen vs HF ``generate`` vs HF ``generate_batch`` (continuous batching).

One process, one random-weight Llama, ``--num-prompts`` token-id prompts of uniform random
length, exactly ``--output-len`` greedy tokens each (EOS ignored; counts asserted). Every
system is warmed up, then timed in ``--repeats`` interleaved rounds (fastest run kept); greedy
outputs are compared with batchgen's. batchgen: ``LLM.generate``, ``temperature=0``, prefix
caching off (the repeats reuse the prompts). HF generate: sdpa, left-padded batches of each of
``--hf-batch-sizes`` prompts in input order, ``min_new_tokens = max_new_tokens``; the best
batch size counts. HF generate_batch: see ``common.generate_batch_contender``.

    PYTHONPATH=. python benchmarks/throughput.py --repeats 3
    PYTHONPATH=. python benchmarks/throughput.py --num-prompts 4 --output-len 8 --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common as h  # noqa: E402


def parse_args(argv: list[str] | None = None) -> Any:
    p = h.parser(__doc__)
    h.add_model_args(p)
    h.add_workload_args(p)
    h.add_run_args(p, verbose=True)
    h.add_engine_args(p)
    h.add_hf_args(p)
    return h.check_args(p, p.parse_args(argv))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from batchgen import LLM, SamplingParams

    args = parse_args(argv)
    info = h.start(args)
    prompts = h.workload_prompts(args)
    L, n_prompt = args.output_len, sum(map(len, prompts))
    expected = len(prompts) * L
    with h.prepare_model_dir(args, args.max_prompt_len + L) as model_dir:
        n_params = h.count_params(model_dir)
        print(h.model_line(args, n_params))
        print(f"workload: {len(prompts)} prompts, lengths {args.min_prompt_len}-"
              f"{args.max_prompt_len} (mean {n_prompt / len(prompts):.0f}, {n_prompt} prompt "
              f"tokens), {L} output tokens each = {expected} output tokens, greedy, EOS ignored",
              flush=True)
        llm = LLM(str(model_dir), **h.engine_kwargs(args, enable_prefix_caching=False))
        contenders = [h.batchgen_contender(llm, prompts, lambda k: SamplingParams(
            temperature=0, max_tokens=k, ignore_eos=True), L)]
        if not args.skip_hf:
            hf = h.load_hf_model(model_dir, h.DTYPES[args.dtype], args.device)
            contenders += h.hf_contenders(hf, prompts, args, L, do_sample=False)
        if not args.skip_generate_batch:
            contenders.append(h.generate_batch_contender(model_dir, prompts, args, L,
                                                         do_sample=False))
        runs = h.run_contenders(contenders, args, n_prompt)
    results = [r for r, _ in runs]
    for r, toks in runs:
        h.check_lengths(f"{r.system} ({r.config})", toks, len(prompts), L)

    labels, summary = h.versus(results)
    rows = [[label, r.config, f"{r.wall_s:.2f}", f"{r.output_tok_s:.1f}",
             h.fmt_ratio(results[0].output_tok_s, r.output_tok_s)]
            for label, r in zip(labels, results)]
    print()
    print(h.markdown_table(["system", "batch / config", h.wall_head(args.repeats),
                            "output tok/s", "batchgen / this"], rows))
    print()
    print(h.versus_line(summary))
    bg = results[0].extra
    print(f"batchgen KV: peak {bg['kv_peak_blocks']} of {bg['kv_num_blocks']} blocks x "
          f"{bg['kv_block_size']} tokens, {bg['preemptions']} preemptions")
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

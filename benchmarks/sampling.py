"""Parallel sampling (n > 1) and beam search: batchgen vs HF ``generate`` vs HF ``generate_batch``.

Exactly ``--output-len`` tokens per sample / beam (EOS ignored) on the random Llama, in
interleaved rounds. Beams: the best beam counts and is compared with HF's (mismatches rerun with
EOS ordinary in HF, as batchgen's ``ignore_eos`` has it); width 4 also with ``CONTROLS``. KV
memory: each batchgen peak against a contiguous cache and a paged one without sharing (the vLLM
paper's baseline), both holding every row at once; no run may preempt (asserted).

    PYTHONPATH=. python benchmarks/sampling.py --repeats 3

``--chat``: the prompts are ``--num-prompts`` English-like sentences through the model's chat
template (e.g. ``--model-dir`` SmolLM2-135M-Instruct) instead of random token ids.
"""

import copy
import gc

from transformers import AutoTokenizer

from batchgen import LLM, BeamSearchParams, SamplingParams
from benchmarks import common as h

# vLLM paper, sec. 6.3: KV blocks saved by sharing / blocks without sharing.
PAPER_SAVINGS = {"sampling": "6.1-9.8% Alpaca / 16.2-30.5% ShareGPT",
                 "beam": "37.6-55.2% Alpaca / 44.3-66.3% ShareGPT"}
CONTROLS = {"no_repeat_ngram_size": 3, "repetition_penalty": 1.2}  # HF's beam controls
CONTROLS_WIDTH = 4  # the beam width also run with them


def parse_args(argv: list[str] | None):
    p = h.parser(__doc__, model={}, workload={"num_prompts": 16}, run={},
                 engine={}, hf={"batch_sizes": "1,2,4"})
    p.add_argument("--n", type=int, default=8, help="samples per prompt (0 skips sampling)")
    p.add_argument("--beam-widths", default="4,16", help="comma-separated ('' or 0: none)",
                   type=lambda v: [] if v.strip() in ("", "0") else h.int_list(v))
    p.add_argument("--chat", action="store_true",
                   help="chat-templated sentences (the model's tokenizer) as prompts")
    args = h.check_args(p, p.parse_args(argv))
    if args.n < 0 or (args.n == 0 and not args.beam_widths):
        p.error("--n must be >= 0, and something must run (--n or --beam-widths)")
    if max(args.beam_widths, default=0) > args.max_num_seqs:
        p.error(f"--beam-widths must be <= --max-num-seqs ({args.max_num_seqs})")
    return args


def kv_extra(llm, prompts: list[list[int]], width: int, args) -> tuple[str, dict]:
    """batchgen's config and KV figures of its last run against the no-sharing baselines."""
    _, e = h.kv_describe(llm)
    assert e["preemptions"] == 0, (f"batchgen preempted {e['preemptions']} times with "
                                   f"{e['num_blocks']} KV blocks; raise --num-kv-blocks")
    L, bs = args.output_len, e["block_size"]
    contiguous = sum(width * (len(p) + L) for p in prompts)
    paged = sum(width * h.blocks_for(len(p) + L, bs) * bs for p in prompts)
    return f"block {bs}, peak {e['peak_blocks_in_use']}/{e['num_blocks']} blocks", {
        **e, "contiguous_tokens": contiguous, "paged_no_sharing_tokens": paged,
        "all_groups_concurrent": len(prompts) * width <= args.max_num_seqs,
        "saving_vs_contiguous": 1 - e["peak_tokens"] / contiguous,
        "saving_vs_paged_no_sharing": 1 - e["peak_tokens"] / paged}


def sampling_contenders(llm, hf, model_dir, prompts: list[list[int]], args) -> list[h.Contender]:
    n, L = args.n, args.output_len
    out = [h.batchgen_contender(llm, prompts, lambda k: SamplingParams(
        n=n, temperature=1.0, top_k=0, max_tokens=k, ignore_eos=True), L,
        lambda: kv_extra(llm, prompts, n, args))]
    sample = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    if not args.skip_hf:
        out += h.hf_contenders(hf, prompts, args, L, f"n={n}", n, n, num_return_sequences=n,
                               **sample)
    if not args.skip_generate_batch:
        out.append(h.generate_batch_contender(model_dir, prompts, args, L, n, **sample))
    return out


def hf_beams(width: int, controls: bool) -> dict:
    return dict(num_beams=width, num_return_sequences=1, do_sample=False, early_stopping=False,
                length_penalty=1.0, **(CONTROLS if controls else {}))


def run_beams(llm, hf, prompts: list[list[int]], width: int, args, controls: bool
              ) -> list[h.Result]:
    """One beam workload; HF's best beams against batchgen's (EOS recheck without controls)."""
    label, outs, L = f"W={width}" + (", +ngram3+rep1.2" if controls else ""), [], args.output_len

    def go(ps: list[list[int]], k: int) -> list[list[int]]:
        eos = dict(min_tokens=k, **CONTROLS) if controls else dict(ignore_eos=True)
        outs[:] = llm.beam_search(h.token_prompts(ps), BeamSearchParams(
            beam_width=width, max_tokens=k, length_penalty=1.0, early_stopping=False, **eos),
            use_tqdm=False)
        return [list(b.sequences[0].token_ids) for b in outs]

    def describe() -> tuple[str, dict]:
        assert all(len(b.sequences) == width for b in outs), "batchgen: hypotheses != width"
        assert all(s.score >= t.score for b in outs for s, t in zip(b.sequences, b.sequences[1:]))
        config, e = kv_extra(llm, prompts, width, args)
        return f"{label}, {config}", e

    h.warm_up(go, prompts, L)
    contenders = [h.Contender("batchgen", lambda: go(prompts, L), describe)]
    if not args.skip_hf:
        contenders += h.hf_contenders(hf, prompts, args, L, label, 1, width,
                                      **hf_beams(width, controls))
    runs = h.run_contenders(contenders, args, sum(map(len, prompts)), expect=(len(prompts), L))
    best, eos_ids = runs[0][1], set(h.engine_facts(llm)["eos_token_ids"])
    for r, toks in runs[1:]:
        bad = [i for i, (a, b) in enumerate(zip(best, toks)) if a != b]
        r.extra["best_beam_agreement"] = {
            **h.agreement(best, toks), "mismatched_prompts": bad,
            "mismatch_with_eos_in_batchgen_beam": sum(bool(set(best[i]) & eos_ids) for i in bad)}
    bad = sorted({i for r, _ in runs[1:] for i in r.extra["best_beam_agreement"]
                  ["mismatched_prompts"]})
    if bad and not controls:  # EOS ordinary in HF too: stop id outside the vocabulary
        cfg = copy.deepcopy(hf.generation_config)
        cfg.eos_token_id = hf.config.vocab_size
        again = h.hf_generate_all(hf, [prompts[i] for i in bad], 1, L, args.device,
                                  generation_config=cfg, **hf_beams(width, False))
        recheck = {"prompts": bad, "match": sum(a == best[i] for a, i in zip(again, bad))}
        for r, _ in runs[1:]:
            r.extra["best_beam_agreement"]["recheck_eos_as_token"] = recheck
    return [r for r, _ in runs]


def run_all(model_dir, prompts: list[list[int]], kv_blocks: int, args) -> dict:
    hf = None if args.skip_hf else h.load_hf_model(model_dir, h.DTYPES[args.dtype], args.device)
    llm = LLM(str(model_dir), **h.engine_kwargs(args, num_kv_blocks=kv_blocks))
    runs, L = {}, args.output_len
    if args.n:
        print(f"  sampling n={args.n}", flush=True)
        out = h.run_contenders(sampling_contenders(llm, hf, model_dir, prompts, args), args,
                               sum(map(len, prompts)), expect=(len(prompts) * args.n, L))
        runs[f"sampling n={args.n}"] = [r for r, _ in out]
    for width in args.beam_widths:
        for controls in [False, True] if width == CONTROLS_WIDTH else [False]:
            name = f"beam W={width}" + (" +ngram3+rep1.2" if controls else "")
            print(f"  {name}", flush=True)
            runs[name] = run_beams(llm, hf, prompts, width, args, controls)
            gc.collect()
    return runs


def report(runs: dict[str, list[h.Result]], args) -> dict:
    rows, summary = [], {}
    for name, rs in runs.items():
        labels, summary[name], line = h.versus(rs)
        summary[name]["line"] = line
        bs = summary[name].get("hf_generate_best_batch_size")
        best = next((r for r in rs if r.extra.get("batch_size", 0) == bs), None)
        if best is not None and "best_beam_agreement" in best.extra:
            summary[name]["best_beam_agreement"] = best.extra["best_beam_agreement"]
        for label, r in zip(labels, rs):
            ag = r.extra.get("best_beam_agreement")
            rows.append([name, label, r.config, f"{r.wall_s:.2f}", r.output_tokens,
                         f"{r.output_tok_s:.1f}", h.fmt_ratio(rs[0].output_tok_s, r.output_tok_s),
                         f"{ag['identical']}/{ag['of']}" if ag else ""])
    h.table(["workload", "system", "batch / config", h.wall_head(args.repeats), "output tokens",
             "output tok/s", "batchgen / this", "best beam = batchgen"], rows)
    print()
    for name, s in summary.items():
        if s["line"]:
            print(f"{name}: {s['line']}")
        if ag := s.get("best_beam_agreement"):
            rc = ag.get("recheck_eos_as_token")
            print(f"{name}: best beam identical to HF's (batch {s['hf_generate_best_batch_size']})"
                  f" for {ag['identical']}/{ag['of']} prompts, mean common prefix "
                  f"{h.pct(ag['mean_prefix_frac'])}; mismatches with EOS in batchgen's beam: "
                  f"{ag['mismatch_with_eos_in_batchgen_beam']}" + (
                      f"; with EOS ordinary in HF too (untimed, batch 1) {rc['match']}/"
                      f"{len(rc['prompts'])} of {rc['prompts']} match" if rc else ""))
        if "+ngram" in name:  # the controls' cost: wall time over the plain run's
            plain, ctl = runs[name.split(" +")[0]], runs[name]
            hf_c, hf_p = ([r.wall_s for r in x if r.system == "HF generate"] for x in (ctl, plain))
            print(f"{name}: cost of the controls: batchgen {ctl[0].wall_s:.2f} s vs "
                  f"{plain[0].wall_s:.2f} s ({ctl[0].wall_s / plain[0].wall_s:.2f}x)" + (
                      f"; HF generate (best batch) {min(hf_c):.2f} s vs {min(hf_p):.2f} s "
                      f"({min(hf_c) / min(hf_p):.2f}x); batchgen over HF with the controls "
                      f"{min(hf_c) / ctl[0].wall_s:.2f}x" if hf_c and hf_p else ""))
    kv = [(name, rs[0].extra, "" if rs[0].extra["all_groups_concurrent"] else " *")
          for name, rs in runs.items()]
    h.table(["workload", "peak blocks", "peak KV tokens", "contiguous HF-style tokens",
             "saving vs contiguous", "paged no-sharing tokens", "saving vs paged no-sharing",
             "COW copies", "preemptions", "vLLM paper sharing saving"],
            [[name, e["peak_blocks_in_use"], e["peak_tokens"], e["contiguous_tokens"],
              h.pct(e["saving_vs_contiguous"]) + star, e["paged_no_sharing_tokens"],
              h.pct(e["saving_vs_paged_no_sharing"]) + star, e["cow_copies"], e["preemptions"],
              PAPER_SAVINGS[name.split()[0]]] for name, e, star in kv])
    print("* more rows than max_num_seqs: the baselines, holding every row at once, overstate")
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    info = h.start(args)
    L = args.output_len
    widths = ([args.n] if args.n else []) + args.beam_widths  # pool: no sharing, + 1 per row
    with h.prepare_model_dir(args, args.max_prompt_len + L, tokenizer=args.chat) as model_dir:
        prompts = (h.chat_prompts(AutoTokenizer.from_pretrained(model_dir), h.sentences(
            args.num_prompts, 4, 16, args.seed)) if args.chat else h.workload_prompts(args))
        kv_blocks = args.num_kv_blocks or 1 + max(sum(
            w * (h.blocks_for(len(p) + L, args.block_size) + 1) for p in prompts)
            for w in widths)
        n_params = h.count_params(model_dir)
        print(h.model_line(args, n_params))
        print(h.workload_line(args, prompts, f"{L} new tokens per sample/beam, EOS ignored; "
                              f"n={args.n or '-'}, beam widths {args.beam_widths or '-'}"
                              + ("; chat prompts" if args.chat else "")))
        runs = run_all(model_dir, prompts, kv_blocks, args)
        gc.collect()
    return h.finish(args, info, {
        "model_params": n_params, "prompt_tokens": sum(map(len, prompts)),
        "kv_num_blocks": kv_blocks, "summary": report(runs, args),
        "results": {k: [r.to_dict() for r in rs] for k, rs in runs.items()}})


if __name__ == "__main__":
    main()

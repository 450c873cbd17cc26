"""Parallel sampling (n > 1) and beam search: batchgen vs HF ``generate`` vs HF ``generate_batch``.

The random Llama and prompt mix of ``throughput.py``, one process, exactly ``--output-len`` (L)
new tokens per sample / beam (EOS ignored); every system warmed up, each workload timed in
``--repeats`` interleaved rounds (fastest run kept).

1. **n-way sampling** (``--n``; temperature 1, no top-k / top-p): batchgen's n samples fork
   after one prefill; HF generate ``num_return_sequences=n`` at each of ``--hf-batch-sizes``;
   HF generate_batch with ``num_return_sequences=n`` (native). Every sample's tokens count.
2. **beam search** per ``--beam-widths`` (length_penalty 1, no early stopping): batchgen
   ``beam_search`` vs HF ``num_beams=W``; the best beam's tokens count and are compared with
   HF's. batchgen's ``ignore_eos`` keeps EOS an ordinary token where HF's ``min_new_tokens`` bans
   it: mismatched prompts are rerun (untimed, HF batch 1) with EOS ordinary in HF too, to check
   that this explains them. ``--controls-widths`` (default 4) reruns a width with HF's
   ``no_repeat_ngram_size`` / ``repetition_penalty`` in both (batchgen banning EOS with
   ``min_tokens=L`` as HF does: the same search) and reports the controls' cost.
3. **KV memory** of every batchgen run: peak KV tokens against a contiguous HF-style allocator
   (``sum width * (len + L)``) and a paged one without sharing (``sum width * ceil((len + L) /
   block) * block``, the vLLM paper's baseline, SOSP 2023 sec. 6.3), both holding the whole
   workload at once (overstated, marked *, when ``num_prompts * width > --max-num-seqs``). The
   pool is sized for the largest run without sharing (unless ``--num-kv-blocks``): no run
   preempts (asserted).

    PYTHONPATH=. python benchmarks/sampling.py --repeats 3
    PYTHONPATH=. python benchmarks/sampling.py --beam-widths 64 --skip-hf --skip-generate-batch
    PYTHONPATH=. python benchmarks/sampling.py --n 0 --beam-widths 4 --skip-generate-batch
"""

from __future__ import annotations

import copy
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common as h  # noqa: E402

# vLLM paper, sec. 6.3: KV blocks saved by sharing / blocks without sharing.
PAPER_SAVINGS = {"sampling": "6.1-9.8% Alpaca / 16.2-30.5% ShareGPT",
                 "beam": "37.6-55.2% Alpaca / 44.3-66.3% ShareGPT"}


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = h.parser(__doc__)
    h.add_model_args(p)
    h.add_workload_args(p, num_prompts=16)
    h.add_run_args(p, verbose=True)
    h.add_engine_args(p, num_kv_blocks_help="KV pool size in blocks (default: the no-sharing "
                                            "worst case of the largest run, so nothing preempts)")
    h.add_hf_args(p, batch_sizes="1,2,4")
    g = p.add_argument_group("sampling / beam search")
    g.add_argument("--n", type=int, default=8, help="samples per prompt (0 skips sampling)")
    g.add_argument("--beam-widths", default="4,16",
                   help="comma-separated beam widths ('' or 0 skips beam search)")
    g.add_argument("--controls-widths", default=None,
                   help="beam widths also run with the n-gram block and repetition penalty "
                        "('' or 0: none; default: 4 when it is among --beam-widths)")
    g.add_argument("--controls-first", action="store_true",
                   help="run the controls variant before the plain one")
    g.add_argument("--ngram", type=int, default=3, help="no_repeat_ngram_size of that run")
    g.add_argument("--rep-penalty", type=float, default=1.2, help="its repetition_penalty")
    args = h.check_args(p, p.parse_args(argv))
    if args.n < 0:
        p.error("--n must be >= 0 (0 skips sampling)")

    def widths(value: str, flag: str) -> list[int]:
        return [] if value.strip() in ("", "0") else h.parse_int_list(p, value, flag)

    args.beam_widths = widths(str(args.beam_widths), "--beam-widths")
    if args.beam_widths and max(args.beam_widths) > args.max_num_seqs:
        p.error(f"--beam-widths must be <= --max-num-seqs ({args.max_num_seqs})")
    default = "4" if 4 in args.beam_widths else ""
    args.controls_widths = widths(str(args.controls_widths or default), "--controls-widths")
    if set(args.controls_widths) - set(args.beam_widths):
        p.error("--controls-widths must be among --beam-widths")
    if args.n == 0 and not args.beam_widths:
        p.error("nothing to run: --n 0 and no --beam-widths")
    return args


# ---- KV accounting --------------------------------------------------------------------------
def kv_extra(llm: Any, prompts: list[list[int]], width: int, args: Any) -> dict[str, Any]:
    """batchgen's KV figures of its last run against the no-sharing baselines."""
    _, e = h.kv_describe(llm)
    assert e["preemptions"] == 0, (f"batchgen preempted {e['preemptions']} times with "
                                   f"{e['kv_num_blocks']} KV blocks; raise --num-kv-blocks")
    L, bs = args.output_len, e["kv_block_size"]
    contiguous = sum(width * (len(p) + L) for p in prompts)
    paged = sum(width * h.blocks_for(len(p) + L, bs) * bs for p in prompts)
    return {**e, "contiguous_tokens": contiguous, "paged_no_sharing_tokens": paged,
            "all_groups_concurrent": len(prompts) * width <= args.max_num_seqs,
            "saving_vs_contiguous": 1 - e["kv_peak_tokens"] / contiguous,
            "saving_vs_paged_no_sharing": 1 - e["kv_peak_tokens"] / paged}


def default_kv_blocks(prompts: list[list[int]], args: Any) -> int:
    """Pool size for the largest run with no sharing at all (+1 block of slack per sample)."""
    widths = ([args.n] if args.n else []) + list(args.beam_widths)
    return max(sum(w * (h.blocks_for(len(p) + args.output_len, args.block_size) + 1)
                   for p in prompts) for w in widths) + 1


# ---- the workloads --------------------------------------------------------------------------
def sampling_contenders(llm: Any, hf: Any, model_dir: Path, prompts: list[list[int]],
                        args: Any) -> list[h.Contender]:
    from batchgen import SamplingParams

    n, L = args.n, args.output_len

    def describe() -> tuple[str, dict[str, Any]]:
        e = kv_extra(llm, prompts, n, args)
        return f"n={n}, block {args.block_size}, peak {e['kv_peak_blocks']}/" \
               f"{e['kv_num_blocks']} blocks", e

    out = [h.batchgen_contender(llm, prompts, lambda k: SamplingParams(
        n=n, temperature=1.0, top_k=0, max_tokens=k, ignore_eos=True), L, describe)]
    sample = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    if not args.skip_hf:
        out += h.hf_contenders(hf, prompts, args, L, f"n={n}", n, n, num_return_sequences=n,
                               **sample)
    if not args.skip_generate_batch:
        out.append(h.generate_batch_contender(model_dir, prompts, args, L, n, **sample))
    return out


def beam_contenders(llm: Any, hf: Any, prompts: list[list[int]], width: int, args: Any,
                    controls: dict[str, Any] | None, last: dict[str, Any]
                    ) -> list[h.Contender]:
    """batchgen's beams (its outputs of the last run in ``last``) and HF generate's."""
    from batchgen import BeamSearchParams

    label = f"W={width}" + (f", {controls_label(controls)}" if controls else "")

    def go(ps: list[list[int]], k: int) -> list[list[int]]:
        eos = dict(min_tokens=k, **controls) if controls else dict(ignore_eos=True)
        bp = BeamSearchParams(beam_width=width, max_tokens=k, length_penalty=1.0,
                              early_stopping=False, **eos)
        last["outs"] = llm.beam_search(h.token_prompts(ps), bp, use_tqdm=False)
        return [list(b.sequences[0].token_ids) for b in last["outs"]]

    def describe() -> tuple[str, dict[str, Any]]:
        beams = last["outs"]
        assert all(len(b.sequences) == width for b in beams), "batchgen: hypotheses != width"
        ordered = all(all(b.sequences[k].score >= b.sequences[k + 1].score
                          for k in range(width - 1)) for b in beams)
        e = kv_extra(llm, prompts, width, args)
        return (f"{label}, block {args.block_size}, peak {e['kv_peak_blocks']}/"
                f"{e['kv_num_blocks']} blocks"), {**e, "width": width, "best_first": ordered,
                                                  "best_scores": [b.sequences[0].score
                                                                  for b in beams]}

    h.warm_up(go, prompts, args.output_len)
    out = [h.Contender("batchgen", lambda: go(prompts, args.output_len), describe)]
    if not args.skip_hf:
        out += h.hf_contenders(hf, prompts, args, args.output_len, label, 1, width,
                               num_beams=width, num_return_sequences=1, do_sample=False,
                               early_stopping=False, length_penalty=1.0, **(controls or {}))
    return out


def beam_agreement(bg: list[list[int]], hf: list[list[int]], eos_ids: Sequence[int]
                   ) -> dict[str, Any]:
    same = [a == b for a, b in zip(bg, hf)]
    return {**h.agreement(bg, hf), "mismatched_prompts": [i for i, s in enumerate(same) if not s],
            "mismatch_with_eos_in_batchgen_beam": sum(
                1 for a, s in zip(bg, same) if not s and set(a) & set(eos_ids))}


def recheck_eos_as_token(model: Any, prompts: list[list[int]], best: list[list[int]],
                         indices: list[int], width: int, args: Any) -> int:
    """Untimed: HF beam search (batch 1) on the mismatched prompts with EOS an ordinary token,
    as batchgen's ``ignore_eos`` has it (stop id outside the vocabulary, no
    ``min_new_tokens``); how many then match batchgen's best beam."""
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = model.config.vocab_size  # never generated: no stop, EOS not banned
    same = 0
    with torch.inference_mode():
        for i in indices:
            ids = torch.tensor([prompts[i]], dtype=torch.long, device=args.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=cfg, num_beams=width, num_return_sequences=1,
                                 max_new_tokens=args.output_len, do_sample=False,
                                 early_stopping=False, length_penalty=1.0, pad_token_id=h.PAD_ID)
            same += out[0, ids.shape[1]:].tolist() == best[i]
    return same


def controls_label(controls: dict[str, Any]) -> str:
    return f"+ngram{controls['no_repeat_ngram_size']}+rep{controls['repetition_penalty']:g}"


def controls_cost(name: str, runs: dict[str, list[h.Result]]) -> str:
    """One line: a controls run's wall time over its plain run's, in batchgen and best HF."""
    plain, ctl = runs[name.split(" +")[0]], runs[name]
    parts = [f"batchgen {ctl[0].wall_s:.2f} s vs {plain[0].wall_s:.2f} s "
             f"({ctl[0].wall_s / plain[0].wall_s:.2f}x)"]
    hf_c = [r.wall_s for r in ctl if r.system == "HF generate"]
    hf_p = [r.wall_s for r in plain if r.system == "HF generate"]
    if hf_c and hf_p:
        c, q = min(hf_c), min(hf_p)
        parts.append(f"HF generate (best batch) {c:.2f} s vs {q:.2f} s ({c / q:.2f}x); "
                     f"batchgen over HF with the controls {c / ctl[0].wall_s:.2f}x")
    return f"{name}: cost of the controls: " + "; ".join(parts)


def run_beams(llm: Any, hf: Any, prompts: list[list[int]], width: int, args: Any,
              controls: dict[str, Any] | None) -> list[h.Result]:
    """One beam workload; HF's best beams compared with batchgen's (rechecked if they differ,
    without the controls: with them both ban EOS alike and should agree exactly)."""
    last: dict[str, Any] = {}
    runs = h.run_contenders(beam_contenders(llm, hf, prompts, width, args, controls, last),
                            args, sum(map(len, prompts)))
    best = runs[0][1]
    h.check_lengths("batchgen best beams", best, len(prompts), args.output_len)
    eos_ids = h.engine_facts(llm)["eos_token_ids"]
    for r, toks in runs[1:]:
        r.extra["best_beam_agreement"] = beam_agreement(best, toks, eos_ids)
    bad = sorted({i for r, _ in runs[1:] for i in r.extra["best_beam_agreement"]
                  ["mismatched_prompts"]})
    if bad and not controls:
        ok = recheck_eos_as_token(hf, prompts, best, bad, width, args)
        for r, _ in runs[1:]:
            r.extra["best_beam_agreement"]["recheck_eos_as_token"] = {"prompts": bad, "match": ok}
        print(f"    recheck (HF batch 1, EOS as an ordinary token) on mismatched prompts {bad}: "
              f"{ok}/{len(bad)} match batchgen", flush=True)
    return [r for r, _ in runs]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from batchgen import LLM

    t_start = time.perf_counter()
    args = parse_args(argv)
    info = h.start(args)
    prompts = h.workload_prompts(args)
    L, n, N = args.output_len, args.n, len(prompts)
    n_prompt = sum(map(len, prompts))
    runs: dict[str, list[h.Result]] = {}  # workload -> [batchgen, HF ...]
    expected: dict[str, int] = {}
    with h.prepare_model_dir(args, args.max_prompt_len + L) as model_dir:
        n_params = h.count_params(model_dir)
        hf = None if args.skip_hf else h.load_hf_model(model_dir, h.DTYPES[args.dtype],
                                                       args.device)
        print(h.model_line(args, n_params))
        print(f"workload: {N} prompts, lengths {args.min_prompt_len}-{args.max_prompt_len} "
              f"(mean {n_prompt / N:.0f}, {n_prompt} prompt tokens), {L} new tokens per "
              f"sample/beam, EOS ignored; n={n or '-'}, beam widths "
              f"{args.beam_widths or '-'}", flush=True)
        kv_blocks = args.num_kv_blocks or default_kv_blocks(prompts, args)
        llm = LLM(str(model_dir), **h.engine_kwargs(args, num_kv_blocks=kv_blocks))
        print(f"batchgen KV pool: num_kv_blocks={kv_blocks} x {args.block_size} tokens "
              f"({'given' if args.num_kv_blocks else 'no-sharing worst case of the largest run'})",
              flush=True)
        if n:
            name = f"sampling n={n}"
            print(f"  {name}", flush=True)
            expected[name] = N * n * L
            out = h.run_contenders(sampling_contenders(llm, hf, model_dir, prompts, args),
                                   args, n_prompt)
            h.check_lengths("batchgen samples", out[0][1], N * n, L)
            out[0][0].extra["distinct_samples"] = sum(
                len({tuple(t) for t in out[0][1][i * n:(i + 1) * n]}) for i in range(N))
            runs[name] = [r for r, _ in out]
            gc.collect()
        for width in args.beam_widths:
            variants: list[Any] = [None]
            if width in args.controls_widths:
                variants.append({"no_repeat_ngram_size": args.ngram,
                                 "repetition_penalty": args.rep_penalty})
            for controls in variants[::-1] if args.controls_first else variants:
                name = f"beam W={width}" + (f" {controls_label(controls)}" if controls else "")
                print(f"  {name}", flush=True)
                expected[name] = N * L
                runs[name] = run_beams(llm, hf, prompts, width, args, controls)
                gc.collect()
        del llm, hf
        gc.collect()
    for name, rs in runs.items():
        for r in rs:
            assert r.output_tokens == expected[name], (
                f"{name}: {r.system} ({r.config}) counted {r.output_tokens} output tokens, "
                f"expected {expected[name]}")

    # ---- throughput table
    rows, summary = [], {}
    for name, rs in runs.items():
        labels, summary[name] = h.versus(rs)
        bs = summary[name].get("hf_generate_best_batch_size")
        best = next((r for r in rs if r.extra.get("batch_size", 0) == bs), None)
        if best is not None and "best_beam_agreement" in best.extra:
            summary[name]["best_beam_agreement"] = best.extra["best_beam_agreement"]
        for label, r in zip(labels, rs):
            ag = r.extra.get("best_beam_agreement")
            rows.append([name, label, r.config, f"{r.wall_s:.2f}", r.output_tokens,
                         f"{r.output_tok_s:.1f}", h.fmt_ratio(rs[0].output_tok_s, r.output_tok_s),
                         f"{ag['identical']}/{ag['of']}" if ag else ""])
    print()
    print(h.markdown_table(["workload", "system", "batch / config", h.wall_head(args.repeats),
                            "output tokens", "output tok/s", "batchgen / this",
                            "best beam = batchgen"], rows))
    print()
    print("output tokens: every sample for n-way sampling, the best beam only for beam search.")
    for name, s in summary.items():
        if h.versus_line(s):
            print(f"{name}: {h.versus_line(s)}")
        ag = s.get("best_beam_agreement")
        if ag:
            print(f"{name}: best beam identical to HF's (batch "
                  f"{s['hf_generate_best_batch_size']}) for {ag['identical']}/{ag['of']} prompts "
                  f"({h.pct(ag['identical'] / ag['of'])}), mean common prefix "
                  f"{h.pct(ag['mean_prefix_frac'])}; mismatches with EOS in batchgen's beam "
                  f"(ignore_eos vs HF min_new_tokens): {ag['mismatch_with_eos_in_batchgen_beam']}")
            rc = ag.get("recheck_eos_as_token")
            if rc:
                print(f"{name}: with EOS an ordinary token in HF too (untimed recheck, batch 1), "
                      f"{rc['match']}/{len(rc['prompts'])} of the mismatched prompts "
                      f"{rc['prompts']} match batchgen")
    for name in runs:
        if "+ngram" in name:
            print(controls_cost(name, runs))
    if n and not args.skip_generate_batch:
        print(f"HF generate_batch: num_return_sequences={n} supported natively in transformers "
              f"{info['transformers']} (prefill once, fork children), not emulated.")

    # ---- KV memory table
    kv_rows = []
    for name, rs in runs.items():
        e = rs[0].extra
        star = "" if e["all_groups_concurrent"] else " *"
        kv_rows.append([name, e["kv_peak_blocks"], e["kv_peak_tokens"], e["contiguous_tokens"],
                        h.pct(e["saving_vs_contiguous"]) + star, e["paged_no_sharing_tokens"],
                        h.pct(e["saving_vs_paged_no_sharing"]) + star, e["cow_copies"],
                        e["preemptions"], PAPER_SAVINGS[name.split()[0]]])
    print()
    print(f"KV memory (batchgen pool: num_kv_blocks={kv_blocks}, block size {args.block_size}; "
          "baselines hold the whole workload at once):")
    print(h.markdown_table(["workload", "peak blocks", "peak KV tokens",
                            "contiguous HF-style tokens", "saving vs contiguous",
                            "paged no-sharing tokens", "saving vs paged no-sharing",
                            "COW copies", "preemptions", "vLLM paper sharing saving"], kv_rows))
    print("contiguous HF-style = sum_prompts width * (len + L); paged no-sharing = sum_prompts "
          "width * ceil((len + L) / block) * block (the paper's baseline for its savings).")
    print("vLLM paper (OPT-13B, Alpaca / ShareGPT traces; savings vs paged no-sharing) is "
          "context only: its outputs are long relative to prompts, while here prompts dominate.")
    if any(not rs[0].extra["all_groups_concurrent"] for rs in runs.values()):
        print(f"* num_prompts x width > max_num_seqs ({args.max_num_seqs}): batchgen never holds "
              "every group at once, so this saving is overstated.")
    total_s = time.perf_counter() - t_start
    print(f"total wall time {total_s:.0f} s")
    return h.finish(args, info, {
        "model_params": n_params, "prompt_tokens": n_prompt,
        "prompt_lens": [len(p) for p in prompts], "kv_num_blocks": kv_blocks,
        "expected_output_tokens": expected, "summary": summary, "total_wall_s": total_s,
        "results": {k: [r.to_dict() for r in rs] for k, rs in runs.items()},
        "paper_sharing_savings": PAPER_SAVINGS})


if __name__ == "__main__":
    main()

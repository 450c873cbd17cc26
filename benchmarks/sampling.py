"""Parallel sampling (n > 1) and beam search: batchgen vs HF ``generate`` vs HF ``generate_batch``.

Same random-weight Llama folder and prompt mix as ``benchmarks/throughput.py`` (``--num-prompts``
token-id prompts, lengths uniform in [``--min-prompt-len``, ``--max-prompt-len``]), all systems
in one process, exactly ``--output-len`` new tokens per sample / beam (EOS ignored). Each system
gets one untimed warm-up on two prompts, then the whole workload is timed with
``time.perf_counter`` under ``torch.inference_mode`` ``--repeats`` times, keeping the fastest.

1. **n-way sampling** (``--n``, default 8; pure sampling, temperature 1, no top-k / top-p):

   * batchgen: ``SamplingParams(n=n, temperature=1.0, top_k=0, max_tokens=L, ignore_eos=True)``;
     the n samples fork after one prefill and share the prompt's KV blocks.
   * HF generate: ``do_sample=True, top_k=0, num_return_sequences=n, max_new_tokens =
     min_new_tokens = L`` on left-padded batches of ``--hf-batch-sizes`` prompts (n rows each),
     taken in input order; the best batch size is used for the ratio.
   * HF generate_batch (continuous batching, sdpa): ``num_return_sequences=n`` in its
     GenerationConfig, which transformers 5.x supports natively (each request is prefilled
     once, then forked into n - 1 children sharing its full KV pages); EOS disabled
     (``eos_token_id=None``) as in throughput.py, cache sized for the whole workload.

   Output tokens count every sample: ``num_prompts * n * L`` for every system (asserted).

2. **beam search** for each of ``--beam-widths`` (HF semantics, length_penalty 1, no early
   stopping):

   * batchgen: ``LLM.beam_search(..., BeamSearchParams(beam_width=W, max_tokens=L,
     ignore_eos=True))``.
   * HF generate: ``num_beams=W, num_return_sequences=1, do_sample=False, early_stopping=False,
     max_new_tokens = min_new_tokens = L`` (best of ``--hf-batch-sizes``).
   * HF generate_batch has no beam search.

   With ``--controls-widths`` (default 4), the same width runs again with HF's beam logits
   controls, ``no_repeat_ngram_size=--ngram`` (3) and ``repetition_penalty=--rep-penalty``
   (1.2), in both systems: batchgen ``BeamSearchParams(..., min_tokens=L)`` (EOS banned
   as HF's ``min_new_tokens=L`` bans it, so both run the same search) and HF generate with the
   same two controls. The report gives the controls' cost (controls run vs plain run) in each.

   Output tokens count the best beam only: ``num_prompts * L``. The best beams are compared
   with HF's (identical fraction, mean common prefix). Known source of (rare) differences:
   with ``ignore_eos`` batchgen treats EOS as an ordinary token, while HF's ``min_new_tokens``
   sets its log-prob to -inf; such prompts are counted, and every mismatched prompt is rerun
   (untimed, HF batch 1) with EOS an ordinary token in HF too (stop id moved outside the
   vocabulary, no ``min_new_tokens``) to check that this explains the difference.

3. **KV memory** of every batchgen run: ``peak_blocks_in_use * block_size`` (peak KV tokens)
   against (a) a contiguous, HF-style allocator where every sample / beam owns its prompt and
   ``L`` new tokens, ``sum_prompts width * (len + L)``, and (b) a paged allocator without
   sharing, ``sum_prompts width * ceil((len + L) / block_size)`` blocks, which is how the vLLM
   paper (Kwon et al., SOSP 2023, sec. 6.3) defines its sharing savings. Both baselines assume
   the whole workload is resident at once; when ``num_prompts * width > --max-num-seqs`` batchgen
   cannot run every group together and the saving is marked as overstated. batchgen's pool is
   sized (unless ``--num-kv-blocks``) for the no-sharing worst case of the largest run, so no
   run is preempted (asserted).

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/sampling.py
    PYTHONPATH=. python benchmarks/sampling.py --num-prompts 2 --output-len 8 --beam-widths 4
    PYTHONPATH=. python benchmarks/sampling.py --beam-widths 64 --skip-hf --skip-generate-batch
    PYTHONPATH=. python benchmarks/sampling.py --repeats 3   # on a busy machine
    PYTHONPATH=. python benchmarks/sampling.py --n 0 --beam-widths 4 --skip-generate-batch
        # beam W=4 plain and with no_repeat_ngram_size=3 + repetition_penalty=1.2, vs HF
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from batchgen.kv.block_manager import blocks_for  # noqa: E402
from benchmarks.common import (  # noqa: E402
    DTYPES,
    PAD_ID,
    Result,
    add_model_args,
    add_run_args,
    add_workload_args,
    args_dict,
    check_workload_args,
    common_prefix_frac,
    count_params,
    fmt_ratio,
    hf_generate_all,
    load_hf_model,
    machine_info,
    machine_line,
    make_prompts,
    markdown_table,
    parse_int_list,
    prepare_model_dir,
    quiet_logging,
    sync,
    timed_repeats,
    write_json,
)

WARMUP_PROMPTS = 2
WARMUP_TOKENS = 8

# vLLM paper (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention", SOSP 2023), sec. 6.3: KV blocks saved by sharing / blocks without sharing.
PAPER_SAVINGS = {"sampling": "6.1-9.8% Alpaca / 16.2-30.5% ShareGPT",
                 "beam": "37.6-55.2% Alpaca / 44.3-66.3% ShareGPT"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p)
    add_workload_args(p, num_prompts=16)
    add_run_args(p)
    g = p.add_argument_group("sampling / beam search")
    g.add_argument("--n", type=int, default=8, help="samples per prompt (0 skips sampling)")
    g.add_argument("--beam-widths", default="4,16",
                   help="comma-separated beam widths ('' or 0 skips beam search)")
    g.add_argument("--controls-widths", default=None,
                   help="beam widths also run with the n-gram block and repetition penalty "
                        "('' or 0: none; default: 4 when it is among --beam-widths)")
    g.add_argument("--controls-first", action="store_true",
                   help="run the controls variant before the plain one (a second run in the "
                        "other order brackets a drift in the machine's load)")
    g.add_argument("--ngram", type=int, default=3, help="no_repeat_ngram_size of that run")
    g.add_argument("--rep-penalty", type=float, default=1.2,
                   help="repetition_penalty of that run")
    g = p.add_argument_group("systems")
    g.add_argument("--block-size", type=int, default=16, help="batchgen KV block size")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="max running sequences (batchgen max_num_seqs, generate_batch "
                        "max_requests_per_batch)")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="per-step token budget (batchgen max_num_batched_tokens, generate_batch "
                        "max_batch_tokens)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="batchgen KV pool size in blocks (default: the no-sharing worst case "
                        "of the largest run, so nothing is preempted)")
    g.add_argument("--hf-batch-sizes", default="1,2,4",
                   help="comma-separated HF generate batch sizes in prompts (each prompt "
                        "expands to n or W rows); the best is reported")
    g.add_argument("--gb-page-size", type=int, default=256,
                   help="generate_batch page size in tokens (256 is transformers' default)")
    g.add_argument("--skip-hf", action="store_true", help="skip HF generate")
    g.add_argument("--skip-generate-batch", action="store_true", help="skip HF generate_batch")
    g.add_argument("--verbose", action="store_true", help="keep transformers/batchgen logging")
    args = p.parse_args(argv)
    check_workload_args(p, args)
    if args.n < 0:
        p.error("--n must be >= 0 (0 skips sampling)")
    widths = str(args.beam_widths).strip()
    args.beam_widths = ([] if widths in ("", "0") else
                        parse_int_list(p, widths, "--beam-widths"))
    if args.beam_widths and max(args.beam_widths) > args.max_num_seqs:
        p.error(f"--beam-widths must be <= --max-num-seqs ({args.max_num_seqs}): all beams of "
                "a prompt decode together in batchgen")
    cw = ("4" if 4 in args.beam_widths else "") if args.controls_widths is None \
        else str(args.controls_widths).strip()
    args.controls_widths = ([] if cw in ("", "0") else
                            parse_int_list(p, cw, "--controls-widths"))
    if set(args.controls_widths) - set(args.beam_widths):
        p.error("--controls-widths must be among --beam-widths")
    if args.n == 0 and not args.beam_widths:
        p.error("nothing to run: --n 0 and no --beam-widths")
    args.hf_batch_sizes = parse_int_list(p, args.hf_batch_sizes, "--hf-batch-sizes")
    for flag in ("block_size", "max_num_seqs", "max_num_batched_tokens", "gb_page_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        p.error("--num-kv-blocks must be >= 1")
    return args


# ---- KV accounting --------------------------------------------------------------------------
def kv_baselines(prompts: list[list[int]], width: int, L: int, block_size: int
                 ) -> dict[str, int]:
    """Token footprints without sharing: contiguous (HF-style) and paged (per-sample blocks)."""
    lens = [len(p) for p in prompts]
    return {"contiguous_tokens": sum(width * (n + L) for n in lens),
            "paged_no_sharing_tokens": sum(width * blocks_for(n + L, block_size) * block_size
                                           for n in lens)}


def default_kv_blocks(prompts: list[list[int]], args: argparse.Namespace) -> int:
    """Pool size for the largest run with no sharing at all (+1 block of slack per sample)."""
    widths = ([args.n] if args.n else []) + list(args.beam_widths)
    L, bs = args.output_len, args.block_size
    return max(sum(w * (blocks_for(len(p) + L, bs) + 1) for p in prompts) for w in widths) + 1


# ---- batchgen -------------------------------------------------------------------------------
def make_llm(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace):
    from batchgen import LLM

    blocks = args.num_kv_blocks or default_kv_blocks(prompts, args)
    return LLM(str(model_dir), block_size=args.block_size, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=blocks,
               dtype=args.dtype, device=args.device, seed=args.seed)


def kv_extra(llm, prompts: list[list[int]], width: int, args: argparse.Namespace
             ) -> dict[str, Any]:
    st = llm.kv_stats()
    assert st.preemptions == 0, (
        f"batchgen preempted {st.preemptions} times with {st.num_blocks} KV blocks; "
        "raise --num-kv-blocks")
    peak_tokens = st.peak_blocks_in_use * st.block_size
    base = kv_baselines(prompts, width, args.output_len, st.block_size)
    return {"kv_num_blocks": st.num_blocks, "kv_block_size": st.block_size,
            "kv_peak_blocks": st.peak_blocks_in_use, "kv_peak_tokens": peak_tokens,
            "cow_copies": st.cow_copies, "preemptions": st.preemptions,
            "all_groups_concurrent": len(prompts) * width <= args.max_num_seqs,
            **base,
            "saving_vs_contiguous": 1 - peak_tokens / base["contiguous_tokens"],
            "saving_vs_paged_no_sharing": 1 - peak_tokens / base["paged_no_sharing_tokens"]}


def run_batchgen_sampling(llm, prompts: list[list[int]], args: argparse.Namespace
                          ) -> Result:
    from batchgen import SamplingParams

    n, L = args.n, args.output_len

    def go(ps: list[list[int]], n_tokens: int) -> list[list[list[int]]]:
        sp = SamplingParams(n=n, temperature=1.0, top_k=0, max_tokens=n_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    with torch.inference_mode():
        go(prompts[:WARMUP_PROMPTS], min(L, WARMUP_TOKENS))
    samples, walls = timed_repeats(lambda: go(prompts, L), args.repeats, args.device)
    assert len(samples) == len(prompts), f"batchgen returned {len(samples)} of {len(prompts)}"
    bad = [i for i, s in enumerate(samples) if len(s) != n or any(len(t) != L for t in s)]
    assert not bad, (f"batchgen: prompts {bad[:5]} did not get {n} samples of {L} tokens "
                     f"(got {[[len(t) for t in samples[i]] for i in bad[:2]]})")
    distinct = sum(len({tuple(t) for t in s}) for s in samples)
    extra = {"wall_s_all": walls, "distinct_samples": distinct,
             **kv_extra(llm, prompts, n, args)}
    config = (f"n={n}, block {args.block_size}, peak {extra['kv_peak_blocks']}/"
              f"{extra['kv_num_blocks']} blocks")
    return Result("batchgen", config, min(walls), sum(len(t) for s in samples for t in s),
                  sum(map(len, prompts)), extra)


def run_batchgen_beam(llm, prompts: list[list[int]], width: int, args: argparse.Namespace,
                      controls: dict[str, Any] | None = None
                      ) -> tuple[Result, list[list[int]]]:
    """``controls``: HF's beam controls; then EOS is banned by ``min_tokens`` (HF's
    ``min_new_tokens``) instead of ignored, so the search is HF's exactly."""
    from batchgen import BeamSearchParams

    L = args.output_len

    def go(ps: list[list[int]], n_tokens: int):
        eos = dict(min_tokens=n_tokens, **controls) if controls else dict(ignore_eos=True)
        bp = BeamSearchParams(beam_width=width, max_tokens=n_tokens, length_penalty=1.0,
                              early_stopping=False, **eos)
        return llm.beam_search([{"prompt_token_ids": p} for p in ps], bp, use_tqdm=False)

    with torch.inference_mode():
        go(prompts[:WARMUP_PROMPTS], min(L, WARMUP_TOKENS))
    beams, walls = timed_repeats(lambda: go(prompts, L), args.repeats, args.device)
    assert len(beams) == len(prompts), f"batchgen returned {len(beams)} of {len(prompts)}"
    assert all(len(b.sequences) == width for b in beams), (
        f"batchgen beam_search returned {sorted({len(b.sequences) for b in beams})} "
        f"hypotheses per prompt, expected {width}")
    best = [list(b.sequences[0].token_ids) for b in beams]
    bad = [i for i, t in enumerate(best) if len(t) != L]
    assert not bad, f"batchgen best beams of prompts {bad[:5]} have {[len(best[i]) for i in bad[:5]]} tokens, not {L}"
    ordered = all(all(b.sequences[k].score >= b.sequences[k + 1].score
                      for k in range(len(b.sequences) - 1)) for b in beams)
    extra = {"wall_s_all": walls, "width": width, "best_first": ordered,
             "best_scores": [b.sequences[0].score for b in beams],
             **kv_extra(llm, prompts, width, args)}
    config = (f"W={width}{', ' + controls_label(controls) if controls else ''}, block "
              f"{args.block_size}, peak {extra['kv_peak_blocks']}/{extra['kv_num_blocks']} blocks")
    return Result("batchgen", config, min(walls), sum(map(len, best)),
                  sum(map(len, prompts)), extra), best


# ---- HF generate ----------------------------------------------------------------------------
def run_hf(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace,
           label: str, rows_per_prompt: int, width: int, **gen_kwargs: Any
           ) -> list[tuple[Result, list[list[int]]]]:
    """Time HF generate at every ``--hf-batch-sizes``; ``width`` rows per prompt are decoded
    (n samples or W beams), ``rows_per_prompt`` come back."""
    L = args.output_len
    with torch.inference_mode():
        hf_generate_all(model, prompts[:WARMUP_PROMPTS], WARMUP_PROMPTS, min(L, WARMUP_TOKENS),
                        args.device, rows_per_prompt, **gen_kwargs)
    runs = []
    for bs in args.hf_batch_sizes:
        torch.manual_seed(args.seed)
        tokens, walls = timed_repeats(
            lambda bs=bs: hf_generate_all(model, prompts, bs, L, args.device, rows_per_prompt,
                                          **gen_kwargs), args.repeats, args.device)
        res = Result("HF generate", f"{label}, batch {bs} ({bs * width} rows), "
                     "left-padded", min(walls), sum(map(len, tokens)), sum(map(len, prompts)),
                     {"batch_size": bs, "wall_s_all": walls})
        runs.append((res, tokens))
        print(f"    HF generate {label} batch {bs}: {res.wall_s:.2f} s", flush=True)
    return runs


# ---- HF generate_batch ----------------------------------------------------------------------
def run_generate_batch_sampling(model_dir: Path, prompts: list[list[int]],
                                args: argparse.Namespace) -> Result:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf_model(model_dir, DTYPES[args.dtype], args.device, "sdpa")
    n, L, page = args.n, args.output_len, args.gb_page_size
    # Room for every sample with no sharing at all (plus a page of slack each).
    num_blocks = sum(n * (math.ceil((len(p) + L) / page) + 1) for p in prompts)
    cb_config = ContinuousBatchingConfig(
        page_size=page, num_blocks=num_blocks, max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs, seed=args.seed)
    # eos_token_id=None: generate_batch turns it into -1 (no EOS); its CB logits processors
    # have no min_new_tokens. temperature 1 and top_k 0 create no processors: pure sampling.
    gen_config = GenerationConfig(max_new_tokens=L, do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, num_return_sequences=n, eos_token_id=None,
                                  pad_token_id=PAD_ID)

    def go(ps: list[list[int]], n_tokens: int) -> list[list[int]]:
        results = model.generate_batch(inputs=ps, generation_config=gen_config,
                                       continuous_batching_config=cb_config,
                                       max_new_tokens=n_tokens, persistent_manager=True)
        assert len(results) == len(ps) * n, (
            f"generate_batch returned {len(results)} results for {len(ps)} prompts x n={n}")
        bad = [rid for rid, r in results.items() if r.error is not None]
        assert not bad, f"generate_batch failed requests {bad}"
        return [list(r.generated_tokens) for r in results.values()]

    try:
        with torch.inference_mode():
            go(prompts[:WARMUP_PROMPTS], min(L, WARMUP_TOKENS))
        tokens, walls = timed_repeats(lambda: go(prompts, L), args.repeats, args.device)
        manager = getattr(model, "_cached_continuous_batching_manager", None)
        resolved = getattr(manager, "continuous_batching_config", cb_config)
    finally:
        model.destroy_cached_continuous_batching_manager()
    bad = sorted({len(t) for t in tokens} - {L})
    assert not bad, f"generate_batch produced samples of {bad} tokens, expected {L}"
    extra = {"wall_s_all": walls, "page_size": page, "num_blocks": resolved.num_blocks,
             "max_batch_tokens": resolved.max_batch_tokens,
             "max_requests_per_batch": resolved.max_requests_per_batch,
             "allow_block_sharing": resolved.allow_block_sharing,
             "num_return_sequences": n, "n_emulated_by_repeating": False}
    config = (f"num_return_sequences={n} (native fork), sdpa, page {page}, "
              f"{resolved.num_blocks} blocks")
    return Result("HF generate_batch", config, min(walls), sum(map(len, tokens)),
                  sum(map(len, prompts)), extra)


# ---- report ---------------------------------------------------------------------------------
def beam_agreement(bg: list[list[int]], hf: list[list[int]], eos_ids: Sequence[int]
                   ) -> dict[str, Any]:
    same = [a == b for a, b in zip(bg, hf)]
    eos_mismatch = sum(1 for a, b, s in zip(bg, hf, same) if not s and set(a) & set(eos_ids))
    return {"identical": sum(same), "of": len(bg),
            "mean_prefix_frac": sum(map(common_prefix_frac, bg, hf)) / max(len(bg), 1),
            "mismatch_with_eos_in_batchgen_beam": eos_mismatch,
            "mismatched_prompts": [i for i, s in enumerate(same) if not s]}


def recheck_eos_as_token(model: torch.nn.Module, prompts: list[list[int]], best: list[list[int]],
                         indices: list[int], width: int, args: argparse.Namespace) -> int:
    """Untimed: rerun HF beam search (batch 1) on the mismatched prompts with EOS made an
    ordinary token, as batchgen's ``ignore_eos`` does: the stop id is set to an id outside the
    vocabulary and ``min_new_tokens`` (which would set EOS to -inf) is dropped. Returns how many
    of them then match batchgen's best beam."""
    import copy

    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = model.config.vocab_size  # never generated: no stop, EOS not banned
    same = 0
    with torch.inference_mode():
        for i in indices:
            ids = torch.tensor([prompts[i]], dtype=torch.long, device=args.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=cfg, num_beams=width, num_return_sequences=1,
                                 max_new_tokens=args.output_len, do_sample=False,
                                 early_stopping=False, length_penalty=1.0, pad_token_id=PAD_ID)
            same += out[0, ids.shape[1]:].tolist() == best[i]
    return same


def controls_label(controls: dict[str, Any]) -> str:
    return (f"+ngram{controls['no_repeat_ngram_size']}"
            f"+rep{controls['repetition_penalty']:g}")


def controls_cost(name: str, runs: dict[str, list[Result]]) -> str:
    """One line: a controls run's wall time over its plain run's, in batchgen and best HF."""
    plain = runs[name.split(" +")[0]]
    ctl = runs[name]
    parts = [f"batchgen {ctl[0].wall_s:.2f} s vs {plain[0].wall_s:.2f} s "
             f"({ctl[0].wall_s / plain[0].wall_s:.2f}x)"]
    hf_c = [r for r in ctl if r.system == "HF generate"]
    hf_p = [r for r in plain if r.system == "HF generate"]
    if hf_c and hf_p:
        c, q = min(r.wall_s for r in hf_c), min(r.wall_s for r in hf_p)
        parts.append(f"HF generate (best batch) {c:.2f} s vs {q:.2f} s ({c / q:.2f}x); "
                     f"batchgen over HF with the controls {c / ctl[0].wall_s:.2f}x")
    return f"{name}: cost of the controls: " + "; ".join(parts)


def run_beam_workload(llm, hf_model, prompts: list[list[int]], width: int,
                      args: argparse.Namespace, eos_ids: list[int], name: str,
                      controls: dict[str, Any] | None) -> list[Result]:
    """batchgen, then HF generate at every batch size, on one beam workload; best beams
    compared (with controls both ban EOS the same way, so they should agree exactly)."""
    print(f"  {name}", flush=True)
    res, best = run_batchgen_beam(llm, prompts, width, args, controls)
    out = [res]
    print(f"    batchgen: {res.wall_s:.2f} s", flush=True)
    gc.collect()
    if args.skip_hf:
        return out
    label = f"W={width}" + (f" {controls_label(controls)}" if controls else "")
    for r, toks in run_hf(hf_model, prompts, args, label, 1, width, num_beams=width,
                          num_return_sequences=1, do_sample=False, early_stopping=False,
                          length_penalty=1.0, **(controls or {})):
        r.extra["best_beam_agreement"] = beam_agreement(best, toks, eos_ids)
        out.append(r)
    bad = sorted({i for r in out[1:] for i in r.extra["best_beam_agreement"]["mismatched_prompts"]})
    if bad and not controls:
        ok = recheck_eos_as_token(hf_model, prompts, best, bad, width, args)
        for r in out[1:]:
            r.extra["best_beam_agreement"]["recheck_eos_as_token"] = {"prompts": bad, "match": ok}
        print(f"    recheck (HF batch 1, EOS as an ordinary token) on mismatched "
              f"prompts {bad}: {ok}/{len(bad)} match batchgen", flush=True)
    gc.collect()
    return out


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    args = parse_args(argv)
    if not args.verbose:
        quiet_logging()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                           args.vocab_size, args.seed)
    L, n = args.output_len, args.n
    N = len(prompts)
    n_prompt = sum(map(len, prompts))
    info = machine_info(args.device)

    # workload name -> [batchgen Result, HF Results...]
    runs: dict[str, list[Result]] = {}
    expected: dict[str, int] = {}
    with prepare_model_dir(args, args.max_prompt_len + L) as model_dir:
        hf_model = load_hf_model(model_dir, DTYPES[args.dtype], args.device, "sdpa")
        n_params = count_params(hf_model)
        print(f"model: random Llama, {n_params / 1e6:.2f}M params, hidden {args.hidden_size}, "
              f"{args.num_layers} layers, {args.num_heads}/{args.num_kv_heads} q/kv heads, "
              f"ffn {args.intermediate_size}, vocab {args.vocab_size}, {args.dtype}")
        print(f"workload: {N} prompts, lengths {args.min_prompt_len}-{args.max_prompt_len} "
              f"(mean {n_prompt / N:.0f}, {n_prompt} prompt tokens), {L} new tokens per "
              f"sample/beam, EOS ignored; n={n or '-'}, beam widths "
              f"{args.beam_widths or '-'}", flush=True)

        llm = make_llm(model_dir, prompts, args)
        eos_ids = list(llm.eos_token_ids)
        kv_blocks = llm.engine.kv.block_manager.num_blocks
        print(f"batchgen KV pool: num_kv_blocks={kv_blocks} x {args.block_size} tokens "
              f"({'given' if args.num_kv_blocks else 'no-sharing worst case of the largest run'})",
              flush=True)

        if n:
            name = f"sampling n={n}"
            expected[name] = N * n * L
            print(f"  {name}", flush=True)
            res = run_batchgen_sampling(llm, prompts, args)
            runs[name] = [res]
            print(f"    batchgen: {res.wall_s:.2f} s", flush=True)
            gc.collect()
            if not args.skip_hf:
                for r, _ in run_hf(hf_model, prompts, args, f"n={n}", n, n, do_sample=True,
                                   top_k=0, top_p=1.0, temperature=1.0,
                                   num_return_sequences=n):
                    runs[name].append(r)
                gc.collect()
            if not args.skip_generate_batch:
                r = run_generate_batch_sampling(model_dir, prompts, args)
                runs[name].append(r)
                print(f"    HF generate_batch: {r.wall_s:.2f} s", flush=True)
                gc.collect()

        for width in args.beam_widths:
            variants = [None] + ([{"no_repeat_ngram_size": args.ngram,
                                   "repetition_penalty": args.rep_penalty}]
                                 if width in args.controls_widths else [])
            if args.controls_first:
                variants.reverse()
            for controls in variants:
                name = f"beam W={width}" + (f" {controls_label(controls)}" if controls else "")
                expected[name] = N * L
                runs[name] = run_beam_workload(llm, hf_model, prompts, width, args, eos_ids,
                                               name, controls)
        del llm, hf_model
        gc.collect()
    sync(args.device)

    # Every system must have produced the expected token count.
    for name, rs in runs.items():
        for r in rs:
            assert r.output_tokens == expected[name], (
                f"{name}: {r.system} ({r.config}) counted {r.output_tokens} output tokens, "
                f"expected {expected[name]}")

    # ---- throughput table
    rows, summary = [], {}
    for name, rs in runs.items():
        bg = rs[0]
        hf_runs = [r for r in rs if r.system == "HF generate"]
        best_hf = max(hf_runs, key=lambda r: r.output_tok_s) if hf_runs else None
        gb = next((r for r in rs if r.system == "HF generate_batch"), None)
        s: dict[str, Any] = {"batchgen_output_tok_s": bg.output_tok_s}
        if best_hf is not None:
            s["batchgen_over_hf_generate"] = bg.output_tok_s / best_hf.output_tok_s
            s["hf_generate_best_batch_size"] = best_hf.extra["batch_size"]
            s["hf_generate_output_tok_s"] = best_hf.output_tok_s
            if "best_beam_agreement" in best_hf.extra:
                s["best_beam_agreement"] = best_hf.extra["best_beam_agreement"]
        if gb is not None:
            s["batchgen_over_generate_batch"] = bg.output_tok_s / gb.output_tok_s
            s["generate_batch_output_tok_s"] = gb.output_tok_s
        summary[name] = s
        for r in rs:
            label = r.system + (" (best)" if r is best_hf and len(hf_runs) > 1 else "")
            ag = r.extra.get("best_beam_agreement")
            match = f"{ag['identical']}/{ag['of']}" if ag else ""
            rows.append([name, label, r.config, f"{r.wall_s:.2f}", r.output_tokens,
                         f"{r.output_tok_s:.1f}", fmt_ratio(bg.output_tok_s, r.output_tok_s),
                         match])
    print()
    wall_head = "wall s" if args.repeats == 1 else f"wall s (best of {args.repeats})"
    print(markdown_table(["workload", "system", "batch / config", wall_head, "output tokens",
                          "output tok/s", "batchgen / this", "best beam = batchgen"], rows))
    print()
    print("output tokens: every sample for n-way sampling, the best beam only for beam search.")
    for name, s in summary.items():
        parts = []
        if "batchgen_over_hf_generate" in s:
            parts.append(f"vs HF generate (best, batch {s['hf_generate_best_batch_size']}) "
                         f"{s['batchgen_over_hf_generate']:.2f}x")
        if "batchgen_over_generate_batch" in s:
            parts.append(f"vs HF generate_batch {s['batchgen_over_generate_batch']:.2f}x")
        if parts:
            print(f"{name}: batchgen " + ", ".join(parts))
        ag = s.get("best_beam_agreement")
        if ag:
            print(f"{name}: best beam identical to HF's (batch "
                  f"{s['hf_generate_best_batch_size']}) for {ag['identical']}/{ag['of']} prompts "
                  f"({pct(ag['identical'] / ag['of'])}), mean common prefix "
                  f"{pct(ag['mean_prefix_frac'])}; mismatches with EOS in batchgen's beam "
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
        overstated = "" if e["all_groups_concurrent"] else " *"
        kind = "sampling" if name.startswith("sampling") else "beam"
        kv_rows.append([name, e["kv_peak_blocks"], e["kv_peak_tokens"], e["contiguous_tokens"],
                        pct(e["saving_vs_contiguous"]) + overstated,
                        e["paged_no_sharing_tokens"],
                        pct(e["saving_vs_paged_no_sharing"]) + overstated,
                        e["cow_copies"], e["preemptions"], PAPER_SAVINGS[kind]])
    print()
    print(f"KV memory (batchgen pool: num_kv_blocks={kv_blocks}, block size {args.block_size}; "
          "baselines hold the whole workload at once):")
    print(markdown_table(["workload", "peak blocks", "peak KV tokens",
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
    print(machine_line(info))
    print(f"total wall time {total_s:.0f} s. note: timings are wall-clock on a possibly shared "
          "machine" + ("; rerun or use --repeats 3 to check noise." if args.repeats == 1 else
                       f", best of {args.repeats} repeats."))

    payload = {"machine": info, "args": args_dict(args), "model_params": n_params,
               "prompt_tokens": n_prompt, "prompt_lens": [len(p) for p in prompts],
               "kv_num_blocks": kv_blocks, "expected_output_tokens": expected,
               "results": {k: [r.to_dict() for r in rs] for k, rs in runs.items()},
               "summary": summary, "paper_sharing_savings": PAPER_SAVINGS,
               "total_wall_s": total_s}
    if args.json is not None:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()

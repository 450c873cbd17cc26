"""Offline throughput: batchgen vs HF ``generate`` vs HF ``generate_batch`` (continuous batching).

All three systems run in one process on the same random-weight Llama folder and the same
workload: ``--num-prompts`` token-id prompts with lengths uniform in
[``--min-prompt-len``, ``--max-prompt-len``] and exactly ``--output-len`` greedy tokens each
(EOS ignored), so every system must produce ``num_prompts * output_len`` tokens; the counts are
asserted. Each system is loaded and gets one untimed warm-up on two prompts; then the whole workload is
timed with ``time.perf_counter`` under ``torch.inference_mode`` (torch's default thread count
unless ``--threads``) in ``--repeats`` interleaved rounds (every system once per round, so all
see the same load on a shared machine), keeping each system's fastest run. Greedy outputs are compared with
batchgen's as a sanity check (identical sequences, mean common prefix).

* batchgen: ``LLM.generate`` with ``SamplingParams(temperature=0, max_tokens=L, ignore_eos=True)``.
* HF generate: sdpa attention, left-padded batches of ``--hf-batch-sizes`` prompts taken in input
  order (not sorted by length, as a user would call it), ``max_new_tokens = min_new_tokens = L``;
  every batch size is timed and the best one is used for the ratio.
* HF generate_batch: transformers' continuous batching with sdpa (flash attention is not
  available on CPU), EOS disabled (``eos_token_id=None`` becomes -1) since its CB logits
  processors do not support ``min_new_tokens``; an explicit ``ContinuousBatchingConfig`` sized to
  hold the whole workload (HF's default would claim 60% of RAM on CPU) with the same per-step
  token budget and request cap as batchgen; the manager is kept across the warm-up and the timed
  run so, as for batchgen, cache allocation is not timed.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/throughput.py
    PYTHONPATH=. python benchmarks/throughput.py --num-prompts 4 --output-len 8 --json out.json
    PYTHONPATH=. python benchmarks/throughput.py --repeats 3   # on a busy machine
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    DTYPES,
    PAD_ID,
    Contender,
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
    interleaved_repeats,
    load_hf_model,
    machine_info,
    machine_line,
    make_prompts,
    markdown_table,
    parse_int_list,
    prepare_model_dir,
    quiet_logging,
    sync,
    write_json,
)

WARMUP_PROMPTS = 2
WARMUP_TOKENS = 8


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p)
    add_workload_args(p)
    add_run_args(p)
    g = p.add_argument_group("systems")
    g.add_argument("--block-size", type=int, default=16, help="batchgen KV block size")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="max running sequences (batchgen max_num_seqs, generate_batch "
                        "max_requests_per_batch)")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="per-step token budget (batchgen max_num_batched_tokens, generate_batch "
                        "max_batch_tokens; 8192 is both libraries' default)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="batchgen KV pool size in blocks (default: batchgen's own sizing)")
    g.add_argument("--hf-batch-sizes", default="8,32",
                   help="comma-separated batch sizes for HF generate; the best is reported")
    g.add_argument("--gb-page-size", type=int, default=256,
                   help="generate_batch page size in tokens (256 is transformers' default)")
    g.add_argument("--skip-hf", action="store_true", help="skip HF generate")
    g.add_argument("--skip-generate-batch", action="store_true", help="skip HF generate_batch")
    g.add_argument("--verbose", action="store_true", help="keep transformers/batchgen logging")
    args = p.parse_args(argv)
    check_workload_args(p, args)
    args.hf_batch_sizes = parse_int_list(p, args.hf_batch_sizes, "--hf-batch-sizes")
    return args


# ---- systems --------------------------------------------------------------------------------
def setup_batchgen(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace
                   ) -> Contender:
    from batchgen import LLM, SamplingParams

    llm = LLM(str(model_dir), block_size=args.block_size, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
              dtype=args.dtype, device=args.device, seed=args.seed,
              enable_prefix_caching=False)  # repeats and warm-up reuse prompts: no cache hits
    L = args.output_len

    def go(ps: list[list[int]], n_tokens: int) -> list[list[int]]:
        sp = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def describe() -> tuple[str, dict[str, Any]]:
        stats = llm.kv_stats()
        extra = {"kv_num_blocks": stats.num_blocks, "kv_block_size": stats.block_size,
                 "kv_peak_blocks": stats.peak_blocks_in_use, "preemptions": stats.preemptions,
                 "cow_copies": stats.cow_copies,
                 "max_num_batched_tokens": llm.max_num_batched_tokens,
                 "attention_backend": llm.attention_backend}
        return (f"block {args.block_size}, peak {stats.peak_blocks_in_use}/{stats.num_blocks} "
                f"blocks, {stats.preemptions} preempt"), extra

    with torch.inference_mode():
        go(prompts[:WARMUP_PROMPTS], min(L, WARMUP_TOKENS))
    return Contender("batchgen", lambda: go(prompts, L), describe)


def setup_hf_generate(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace
                      ) -> list[Contender]:
    model = load_hf_model(model_dir, DTYPES[args.dtype], args.device, "sdpa")
    L = args.output_len
    with torch.inference_mode():
        hf_generate_all(model, prompts[:WARMUP_PROMPTS], WARMUP_PROMPTS, min(L, WARMUP_TOKENS),
                        args.device, 1, do_sample=False)
    return [Contender(
        "HF generate",
        lambda bs=bs: hf_generate_all(model, prompts, bs, L, args.device, 1, do_sample=False),
        lambda bs=bs: (f"sdpa, batch {bs}, left-padded", {"batch_size": bs}))
        for bs in args.hf_batch_sizes]


def setup_generate_batch(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace
                         ) -> Contender:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf_model(model_dir, DTYPES[args.dtype], args.device, "sdpa")
    L = args.output_len
    page = args.gb_page_size
    # Room for the whole workload at once (plus one page per request of slack), like batchgen.
    num_blocks = sum(math.ceil((len(p) + L) / page) + 1 for p in prompts)
    cb_config = ContinuousBatchingConfig(
        page_size=page, num_blocks=num_blocks, max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs, seed=args.seed)
    # eos_token_id=None: generate_batch turns it into -1, i.e. no EOS, so every request runs
    # to max_new_tokens (its CB logits processors have no min_new_tokens).
    gen_config = GenerationConfig(max_new_tokens=L, do_sample=False, eos_token_id=None,
                                  pad_token_id=PAD_ID)

    def go(ps: list[list[int]], n_tokens: int) -> list[list[int]]:
        results = model.generate_batch(inputs=ps, generation_config=gen_config,
                                       continuous_batching_config=cb_config,
                                       max_new_tokens=n_tokens, persistent_manager=True)
        assert len(results) == len(ps), f"generate_batch returned {len(results)} of {len(ps)}"
        bad = [rid for rid, r in results.items() if r.error is not None]
        assert not bad, f"generate_batch failed requests {bad}"
        return [list(r.generated_tokens) for r in results.values()]

    def describe() -> tuple[str, dict[str, Any]]:
        manager = getattr(model, "_cached_continuous_batching_manager", None)
        resolved = getattr(manager, "continuous_batching_config", cb_config)
        extra = {"page_size": page, "num_blocks": resolved.num_blocks,
                 "max_batch_tokens": resolved.max_batch_tokens,
                 "max_requests_per_batch": resolved.max_requests_per_batch,
                 "attn_implementation": model.config._attn_implementation,
                 "allow_block_sharing": resolved.allow_block_sharing}
        return (f"sdpa, page {page}, {resolved.num_blocks} blocks, "
                f"{resolved.max_batch_tokens} batch tok"), extra

    with torch.inference_mode():
        go(prompts[:WARMUP_PROMPTS], min(L, WARMUP_TOKENS))
    # the manager is kept across the warm-up and the timed runs (cache allocation not timed)
    return Contender("HF generate_batch", lambda: go(prompts, L), describe,
                     close=model.destroy_cached_continuous_batching_manager)


# ---- report ---------------------------------------------------------------------------------
def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Identical sequences and mean common-prefix fraction between two greedy outputs."""
    prefix = [common_prefix_frac(x, y) for x, y in zip(a, b)]
    return {"identical": sum(x == y for x, y in zip(a, b)), "of": len(a),
            "mean_prefix_frac": sum(prefix) / max(len(prefix), 1)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.verbose:
        quiet_logging()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                           args.vocab_size, args.seed)
    L = args.output_len
    expected = len(prompts) * L
    n_prompt = sum(map(len, prompts))
    info = machine_info(args.device)

    results: list[Result] = []
    outputs: dict[str, list[list[int]]] = {}  # label -> tokens; "batchgen" first
    with prepare_model_dir(args, args.max_prompt_len + L) as model_dir:
        probe = load_hf_model(model_dir, DTYPES[args.dtype], "cpu")
        n_params = count_params(probe)
        del probe
        print(f"model: random Llama, {n_params / 1e6:.2f}M params, hidden {args.hidden_size}, "
              f"{args.num_layers} layers, {args.num_heads}/{args.num_kv_heads} q/kv heads, "
              f"ffn {args.intermediate_size}, vocab {args.vocab_size}, {args.dtype}")
        print(f"workload: {len(prompts)} prompts, lengths {args.min_prompt_len}-"
              f"{args.max_prompt_len} (mean {n_prompt / len(prompts):.0f}, {n_prompt} prompt "
              f"tokens), {L} output tokens each = {expected} output tokens, greedy, EOS ignored",
              flush=True)

        contenders = [setup_batchgen(model_dir, prompts, args)]
        if not args.skip_hf:
            contenders += setup_hf_generate(model_dir, prompts, args)
        if not args.skip_generate_batch:
            contenders.append(setup_generate_batch(model_dir, prompts, args))
        labels = [c.system + (f" bs={c.describe()[1]['batch_size']}"
                              if c.system == "HF generate" else "") for c in contenders]
        try:
            timings = interleaved_repeats(
                contenders, args.repeats, args.device,
                on_round=lambda r: print(f"  round {r + 1}/{args.repeats} done", flush=True))
        finally:
            for c in contenders:
                c.close()
        for c, label, (toks, walls) in zip(contenders, labels, timings):
            config, extra = c.describe()
            results.append(Result(c.system, config, min(walls), sum(map(len, toks)), n_prompt,
                                  {**extra, "wall_s_all": walls}))
            outputs[label] = toks
            print(f"  {label}: " + ", ".join(f"{w:.2f}" for w in walls) + " s", flush=True)
    sync(args.device)

    # Every system must have produced exactly N * L tokens, L per prompt.
    for r in results:
        assert r.output_tokens == expected, (
            f"{r.system} ({r.config}) produced {r.output_tokens} output tokens, expected {expected}")
    for name, toks in outputs.items():
        assert len(toks) == len(prompts) and all(len(t) == L for t in toks), (
            f"{name}: per-prompt output lengths {sorted({len(t) for t in toks})}, expected {L}")

    bg = results[0]
    hf_runs = [r for r in results if r.system == "HF generate"]
    best_hf = max(hf_runs, key=lambda r: r.output_tok_s) if hf_runs else None
    gb = next((r for r in results if r.system == "HF generate_batch"), None)

    rows = []
    for r in results:
        name = r.system + (" (best)" if r is best_hf and len(hf_runs) > 1 else "")
        rows.append([name, r.config, f"{r.wall_s:.2f}", f"{r.output_tok_s:,.1f}".replace(",", ""),
                     fmt_ratio(bg.output_tok_s, r.output_tok_s)])
    print()
    wall_head = "wall s" if args.repeats == 1 else f"wall s (best of {args.repeats})"
    print(markdown_table(["system", "batch / config", wall_head, "output tok/s",
                          "batchgen / this"], rows))
    print()
    summary: dict[str, Any] = {}
    if best_hf is not None:
        summary["batchgen_over_hf_generate"] = bg.output_tok_s / best_hf.output_tok_s
        summary["hf_generate_best_batch_size"] = best_hf.extra["batch_size"]
        print(f"batchgen / HF generate (best, batch {best_hf.extra['batch_size']}): "
              f"{summary['batchgen_over_hf_generate']:.2f}x")
    if gb is not None:
        summary["batchgen_over_generate_batch"] = bg.output_tok_s / gb.output_tok_s
        print(f"batchgen / HF generate_batch: {summary['batchgen_over_generate_batch']:.2f}x")
    print(f"batchgen KV: peak {bg.extra['kv_peak_blocks']} of {bg.extra['kv_num_blocks']} blocks "
          f"x {bg.extra['kv_block_size']} tokens, {bg.extra['preemptions']} preemptions")
    agree = {}
    for name, toks in outputs.items():
        if name == "batchgen":
            continue
        agree[name] = agreement(outputs["batchgen"], toks)
        a = agree[name]
        print(f"greedy agreement batchgen vs {name}: {a['identical']}/{a['of']} identical, "
              f"mean common prefix {100 * a['mean_prefix_frac']:.1f}%")
    print(machine_line(info))
    print("note: timings are wall-clock on a possibly shared machine; rerun to check noise.")

    payload = {"machine": info, "args": args_dict(args), "model_params": n_params,
               "prompt_tokens": n_prompt, "expected_output_tokens": expected,
               "results": [r.to_dict() for r in results], "summary": summary,
               "greedy_agreement_vs_batchgen": agree}
    if args.json is not None:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()

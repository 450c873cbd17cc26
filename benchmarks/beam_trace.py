"""What beam search's records cost: ``return_trace`` and ``logprobs=k`` against plain beams.

Same random-weight Llama and prompt mix as ``benchmarks/sampling.py`` (token-id prompts, lengths
uniform in [``--min-prompt-len``, ``--max-prompt-len``], exactly ``--output-len`` new tokens, EOS
ignored). For each of ``--beam-widths`` one ``LLM`` runs four configurations of
``BeamSearchParams(beam_width=W, max_tokens=L, ignore_eos=True)``: plain, ``return_trace=True``,
``logprobs=--logprobs``, and both. They are timed in interleaved rounds (plain, trace, logprobs,
both, plain, ...) ``--repeats`` times after one untimed warm-up each, so a shared machine's load
drifts over all of them alike; min and median wall times are reported with the ratio of each
configuration's min to plain's. Every configuration must return the same hypotheses (asserted):
the records never change the search. The trace's size is reported per request: live records (width per step but the
last) and finished-buffer records (at most width per step), against steps x width.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/beam_trace.py
    PYTHONPATH=. python benchmarks/beam_trace.py --beam-widths 4,16 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    parse_int_list,
    prepare_model_dir,
    quiet_logging,
    write_json,
)

CONFIGS = ("plain", "trace", "logprobs", "trace+logprobs")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    add_workload_args(p, num_prompts=16, min_prompt_len=16, max_prompt_len=128, output_len=32)
    add_run_args(p)
    p.add_argument("--beam-widths", default="4,16", help="comma-separated beam widths")
    p.add_argument("--logprobs", type=int, default=5, help="k of the logprobs configurations")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)} (plain alone also "
                        "runs on a batchgen without these parameters, e.g. the previous "
                        "commit, to compare the off path across versions)")
    args = p.parse_args(argv)
    check_workload_args(p, args)
    args.beam_widths = parse_int_list(p, args.beam_widths, "--beam-widths")
    args.configs = [c for c in args.configs.split(",") if c]
    if not args.configs or not set(args.configs) <= set(CONFIGS) or args.configs[0] != "plain":
        p.error(f"--configs must start with plain and name only {', '.join(CONFIGS)}")
    return args


def params_of(config: str, width: int, args: argparse.Namespace) -> Any:
    """The BeamSearchParams of one configuration."""
    from batchgen import BeamSearchParams

    extra: dict[str, Any] = {}  # plain passes neither, so it runs on older versions too
    if "trace" in config:
        extra["return_trace"] = True
    if "logprobs" in config:
        extra["logprobs"] = args.logprobs
    return BeamSearchParams(beam_width=width, max_tokens=args.output_len, ignore_eos=True,
                            **extra)


def contenders(llm: Any, prompts: list[list[int]], width: int, args: argparse.Namespace
               ) -> list[Contender]:
    """One warmed-up contender per configuration, all on the same LLM."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    out = []
    for config in args.configs:
        params = params_of(config, width, args)

        def run(params: Any = params) -> Any:
            return llm.beam_search(inputs, params, use_tqdm=False)

        with torch.inference_mode():
            llm.beam_search(inputs[:2], params, use_tqdm=False)  # warm-up
        out.append(Contender(config, run, lambda: ("", {})))
    return out


def summarize(width: int, results: list[tuple[Any, list[float]]], args: argparse.Namespace
              ) -> list[dict[str, Any]]:
    """Rows of the report; asserts every configuration found the same hypotheses."""
    plain = results[0][0]
    rows = []
    for config, (outs, walls) in zip(args.configs, results):
        assert [[s.token_ids for s in o.sequences] for o in outs] == [
            [s.token_ids for s in o.sequences] for o in plain], f"{config} changed the beams"
        traces = [o.trace for o in outs if getattr(o, "trace", None) is not None]
        rows.append({"width": width, "config": config, "min_s": min(walls),
                     "median_s": statistics.median(walls), "walls": walls,
                     "vs_plain": min(walls) / min(results[0][1]),
                     "live_records": _mean([len(t.live) for t in traces]),
                     "finished_records": _mean([len(t.finished) for t in traces]),
                     "steps_x_width": _mean([t.num_steps * width for t in traces])})
    return rows


def _mean(values: list[int]) -> float:
    return statistics.mean(values) if values else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    from batchgen import LLM

    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                           args.vocab_size, args.seed)
    rows: list[dict[str, Any]] = []
    with prepare_model_dir(args, args.max_prompt_len + args.output_len) as model_dir:
        for width in args.beam_widths:
            llm = LLM(str(model_dir), device=args.device, block_size=args.block_size,
                      max_num_seqs=max(256, width))
            results = interleaved_repeats(contenders(llm, prompts, width, args), args.repeats,
                                          args.device)
            rows += summarize(width, results, args)
            del llm
    info = machine_info(args.device)
    print(machine_line(info))
    print(markdown_table(
        ["W", "config", "min s", "median s", "min / plain", "live records / request",
         "finished records / request", "steps x W"],
        [[r["width"], r["config"], f"{r['min_s']:.3f}", f"{r['median_s']:.3f}",
          f"{r['vs_plain']:.3f}x", f"{r['live_records']:.1f}",
          f"{r['finished_records']:.1f}", f"{r['steps_x_width']:.0f}"] for r in rows]))
    if args.json:
        write_json(args.json, {"args": args_dict(args), "machine": info, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

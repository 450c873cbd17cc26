"""`batchgen generate` and `batchgen beam`: a dataset job from the command line, written as
Parquet or JSONL shards that `--resume` continues after a crash or Ctrl-C."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from batchgen.checks import check
from batchgen.cli.common import EXIT_INTERRUPTED, CliError
from batchgen.cli.engine import engine_args, engine_kwargs
from batchgen.sampling.logprobs_mode import check_beam_mode


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="n samples for every row of a dataset",
                         description="Sample completions for every row of a dataset into "
                                     "Parquet or JSONL shards (resumable).")
    _job_args(gen)
    s = gen.add_argument_group("sampling")
    s.add_argument("--n", type=int, default=1, help="samples per row (default 1)")
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    s.add_argument("--logprobs", type=int, default=None, help="top-k logprobs per token")
    s.add_argument("--ignore-eos", action="store_true")
    _score_args(gen)
    gen.set_defaults(run=run, kind="generate")

    beam = sub.add_parser("beam", help="beam search for every row of a dataset",
                          description="Beam search (HF semantics) for every row of a dataset "
                                      "into Parquet or JSONL shards (resumable).")
    _job_args(beam)
    b = beam.add_argument_group("beam search")
    b.add_argument("--beam-width", type=int, required=True)
    b.add_argument("--length-penalty", type=float, default=1.0)
    b.add_argument("--early-stopping", action="store_true")
    b.add_argument("--num-return-sequences", type=int, default=None)
    c = beam.add_argument_group("beam controls (HF's logits processors) and diverse beams")
    c.add_argument("--repetition-penalty", type=float, default=1.0)
    c.add_argument("--no-repeat-ngram-size", type=int, default=0)
    c.add_argument("--bad-word", action="append", default=None, dest="bad_words",
                   help="a word no beam may contain (repeatable)")
    c.add_argument("--min-tokens", type=int, default=0, help="HF's min_new_tokens")
    c.add_argument("--temperature", type=float, default=1.0,
                   help="divides the beams' processed log-probs (scores only)")
    c.add_argument("--num-beam-groups", type=int, default=1,
                   help="diverse beam search: groups of beam-width / G beams")
    c.add_argument("--diversity-penalty", type=float, default=0.0,
                   help="Hamming diversity between groups (> 0 with --num-beam-groups > 1)")
    b.add_argument("--logprobs", type=int, default=0,
                   help="top-k alternatives per token of each beam (0-20; 0: none)")
    beam.set_defaults(run=run, kind="beam")


def _job_args(p: argparse.ArgumentParser) -> None:
    """Input, output, prompt source and engine flags, shared by generate and beam."""
    io = p.add_argument_group("input and output")
    io.add_argument("--model", required=True, help="model folder (or a hub id in the HF cache)")
    io.add_argument("--input", required=True,
                    help="JSONL / JSON / Parquet / CSV file, a folder of them, or a "
                         "save_to_disk folder")
    src = io.add_mutually_exclusive_group()
    src.add_argument("--prompt-column", default=None, help="text or token-id column "
                                                          "(default: prompt)")
    src.add_argument("--messages-column", default=None,
                     help="chat messages column, rendered through the chat template")
    io.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    io.add_argument("--image-column", default=None,
                    help="a vision-language model's image column (a path, image bytes or a "
                         "datasets Image) beside the text prompt column, whose text holds "
                         "the model's image placeholder")
    io.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                    help="a PEFT LoRA adapter folder under a name (repeatable); each row names "
                         "its adapter in --lora-column")
    io.add_argument("--lora-column", default=None, metavar="COL",
                    help="the column naming each row's adapter (a --lora NAME; empty or null: "
                         "the base model)")
    io.add_argument("--output", required=True, help="folder for the shards")
    io.add_argument("--output-format", choices=("parquet", "jsonl"), default="parquet",
                    help="shard file format (default parquet)")
    io.add_argument("--resume", action="store_true",
                    help="continue the job in --output: rows of whole shards whose input is "
                         "unchanged are kept, the rest (edited, added, failed) are computed")
    io.add_argument("--rows-per-shard", type=int, default=256,
                    help="shard k holds rows [k*N, (k+1)*N), written once they finish")
    io.add_argument("--shard-seconds", type=float, default=60.0, metavar="S",
                    help="...and the shards not full yet every S seconds (written again "
                         "whole when full), so a slow job keeps its progress (0: when full)")
    io.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                    help="a row that cannot run (prompt too long, bad chat or schema): stop "
                         "the job, or write it with an `error` column and go on")
    io.add_argument("--max-tokens", type=int, default=16,
                    help="most new tokens per sample (raise it for full answers)")
    io.add_argument("--seed", type=int, default=0, help="job seed: row seeds derive from it")
    io.add_argument("--quiet", action="store_true", help="no progress bar")
    _constraint_args(p)
    engine_args(p)
    _ray_args(p)


def _ray_args(p: argparse.ArgumentParser) -> None:
    """The --ray job's flags: the cluster, the generator's actors and the scorer's."""
    r = p.add_argument_group("Ray Data (the batchgen[ray] extra)")
    r.add_argument("--ray", action="store_true",
                   help="run the job on Ray Data: one LLM per actor, output written by Ray")
    r.add_argument("--ray-address", default=None,
                   help="an existing cluster ('auto', 'ray://host:10001'); default: a local Ray")
    r.add_argument("--actors", type=int, default=1, help="LLM actors (default 1)")
    r.add_argument("--gpus-per-actor", type=float, default=0.0,
                   help="GPUs per actor: 1 on a GPU cluster, N with --tensor-parallel-size N "
                        "(default 0: CPU actors)")
    r.add_argument("--cpus-per-actor", type=float, default=1.0)
    r.add_argument("--batch-size", type=int, default=64, help="rows per actor call")
    r.add_argument("--score-actors", type=int, default=1,
                   help="with --score-model: scorer actors (default 1)")
    r.add_argument("--score-gpus-per-actor", type=float, default=0.0,
                   help="with --score-model: GPUs per scorer actor (0.5 with "
                        "--gpus-per-actor 0.5: both models on one GPU; default 0)")
    r.add_argument("--score-kv-cache-memory", default=None,
                   help="with --score-model: the scorer's KV pool bytes, e.g. 4GiB (needed "
                        "on a shared GPU, with --kv-cache-memory for the generator)")


def _score_args(p: argparse.ArgumentParser) -> None:
    """The score and select stages (docs/best_of_n.md)."""
    g = p.add_argument_group("score and select (best-of-n, rejection sampling, DPO pairs)")
    g.add_argument("--score-model", default=None, metavar="RM",
                   help="a reward (or process reward) model folder: every candidate scored")
    g.add_argument("--select", default=None, help="best | top:K | threshold:X | pairs | "
                   "until:K (rounds of --n until K candidates reach --threshold)")
    g.add_argument("--threshold", type=float, default=None, help="the score until:K counts")
    g.add_argument("--max-candidates", type=int, default=None,
                   help="until:K's budget of candidates per row (default 4 x --n)")
    g.add_argument("--prm-step-tag", default=None, metavar="TAG",
                   help="a process reward model's step tag, one token of its tokenizer, put "
                        "after each step (steps: the response split at blank lines; default "
                        "<extra_0>, Qwen2.5-Math-PRM's)")
    g.add_argument("--prm-aggregate", default=None, choices=("min", "last", "mean", "prod"),
                   help="a PRM candidate's score from its step scores (default min)")


def _stage_kwargs(args: argparse.Namespace, params: Any) -> dict[str, Any]:
    """The score/select arguments of generate_dataset, checked before the weights load."""
    prm = {"prm_step_tag": getattr(args, "prm_step_tag", None),
           "prm_aggregate": getattr(args, "prm_aggregate", None)}
    if getattr(args, "score_model", None) is None and getattr(args, "select", None) is None \
            and prm == {"prm_step_tag": None, "prm_aggregate": None}:
        return {}
    from batchgen.data.scoring import check_scorer, step_scoring
    from batchgen.data.stages import parse_policy

    try:
        parse_policy(args.select, args.threshold, args.max_candidates, params,
                     args.score_model)
        if args.score_model is not None:
            check_scorer(args.score_model)
        step_scoring(args.score_model, prm["prm_step_tag"], prm["prm_aggregate"], None)
    except ValueError as e:
        raise CliError(str(e).replace("select ", "--select ", 1).replace(
            "score ", "--score-model ", 1).replace("prm_step_tag", "--prm-step-tag").replace(
            "prm_aggregate", "--prm-aggregate")) from None
    if args.ray and args.select is not None and args.select.startswith("until:"):
        raise CliError(f"--select {args.select} is for local jobs (not --ray): until:k samples "
                       f"each row in rounds, a round only for the rows the last round's scores "
                       f"left open, and a Ray Data pipeline runs each stage once per row; on "
                       f"Ray use a fixed --n with --select threshold:X or top:K")
    return {"score": args.score_model, "select": args.select, "threshold": args.threshold,
            "max_candidates": args.max_candidates, **prm}


def check_generator(model: str) -> None:
    """Refuse a pooling model's folder as --model (a reward, classifier or embedding model has
    no tokens to generate), pointing to the commands that run it; read from its config.json."""
    from batchgen.runners import folder_architectures, resolve_runner

    archs = folder_architectures(model)
    if archs and resolve_runner("auto", archs) == "pooling":
        raise CliError(f"--model {model!r} is a pooling model ({', '.join(archs)}): `batchgen "
                       "generate` runs generators (runner='generate'); score with `batchgen "
                       "score --model` (or pass it as --score-model), embed with `batchgen "
                       "embed --model`")


def _constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured outputs (the batchgen[structured] extra): one constraint for every row, or
    each row's own JSON schema from a column."""
    g = p.add_argument_group("structured outputs (the batchgen[structured] extra)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", default=None, metavar="FILE",
                     help="every output is JSON valid under this schema file")
    one.add_argument("--regex", default=None, help="every output matches this regex in full")
    one.add_argument("--choice", default=None, metavar="A,B,C",
                     help="every output is one of these comma-separated strings")
    one.add_argument("--grammar", default=None, metavar="FILE",
                     help="every output follows this EBNF grammar file (root ::= ...)")
    one.add_argument("--schema-column", default=None, metavar="COLUMN",
                     help="a column holding each row's own JSON schema")
    g.add_argument("--max-whitespace", type=int, default=16,
                   help="longest whitespace run between JSON tokens (default 16; -1: unbounded)")


def run(args: argparse.Namespace) -> int:
    """Check everything that can be checked before the weights load (the flags first, before
    anything heavy is imported), then run the job."""
    from batchgen.cli.kv_plan import parse_memory

    memory = None if args.kv_cache_memory is None else parse_memory(args.kv_cache_memory,
                                                                      "--kv-cache-memory")
    check(args.rows_per_shard >= 1, "--rows-per-shard", ">= 1", args.rows_per_shard)
    check(args.shard_seconds >= 0, "--shard-seconds", ">= 0 (0: by rows only)",
          args.shard_seconds)
    check(args.tensor_parallel_size >= 1, "--tensor-parallel-size", ">= 1",
          args.tensor_parallel_size)
    check_generator(args.model)
    if args.kind == "beam":
        check_beam_mode(args.logprobs_mode, "--logprobs-mode")
    from batchgen.lora.dataset import LoRAColumn, parse_lora_flags

    args.loras = parse_lora_flags(args.lora)
    if bool(args.loras) != (args.lora_column is not None):
        raise CliError("--lora NAME=PATH and --lora-column COL go together (the adapters, and "
                       "the column naming each row's)")
    LoRAColumn.of(args.lora_column, args.loras)
    _check_scorer_actor_flags(args)
    params = _params(args)
    return _run_job(args, params, memory)


def _check_scorer_actor_flags(args: argparse.Namespace) -> None:
    """The scorer's actor flags go with a Ray job that scores (ignored otherwise: refused)."""
    given = [flag for flag, value, default in (
        ("--score-actors", args.score_actors, 1),
        ("--score-gpus-per-actor", args.score_gpus_per_actor, 0.0),
        ("--score-kv-cache-memory", args.score_kv_cache_memory, None)) if value != default]
    if given and not (args.ray and getattr(args, "score_model", None) is not None):
        raise CliError(f"{', '.join(given)} go with --ray and --score-model (the scorer's "
                       f"actors on Ray)")


def _run_job(args: argparse.Namespace, params: Any, memory: int | None) -> int:
    """Check the output folder, the input and its columns, load the model, run the job."""
    from batchgen.data.shards import check_output_dir
    from batchgen.data.source import open_source
    from batchgen.data.stages import generate_dataset

    if args.ray and args.schema_column:
        raise CliError("--schema-column is for local jobs; on Ray (--ray) pass one constraint "
                       "(--json-schema, --regex, --choice or --grammar)")
    if args.ray and args.resume:
        raise CliError("--resume is for local jobs: on Ray (--ray) a failed task is retried "
                       "within the job; rerun a stopped Ray job into a new --output")
    if args.image_column and args.messages_column:
        raise CliError("--image-column goes with --prompt-column: chat messages carry their "
                       "own image parts")
    if args.ray and args.on_error != "fail":
        raise CliError("--on-error skip is for local jobs: on Ray (--ray) a row that cannot "
                       "run fails the job")
    stages = _stage_kwargs(args, params)
    check_output_dir(Path(args.output).expanduser(), args.resume)
    template = chat_template_arg(args.chat_template)
    source = open_source(args.input)
    column = args.messages_column or args.prompt_column or "prompt"
    for flag, name in (("--messages-column" if args.messages_column else "--prompt-column",
                        column), ("--schema-column", args.schema_column),
                       ("--image-column", args.image_column),
                       ("--lora-column", args.lora_column)):
        if name is not None and source.column_names is not None \
                and name not in source.column_names:
            raise CliError(f"{flag} {name!r} is not a column of {args.input} (columns: "
                           f"{', '.join(source.column_names)})")
    from batchgen.lora.dataset import LoRAColumn
    from batchgen.lora.dataset import engine_kwargs as lora_engine_kwargs

    LoRAColumn.of(args.lora_column, args.loras).check_rows(source)  # each row's adapter name
    engine = engine_kwargs(args, memory) | lora_engine_kwargs(args.loras)
    if args.ray:
        from batchgen.cli.ray_job import run_on_ray

        return run_on_ray(args, params, template, source, engine)
    from batchgen.llm import LLM

    llm = LLM(args.model, runner="generate", **engine | {"enable_sleep_mode": bool(stages)})
    start = time.perf_counter()
    try:
        ds = generate_dataset(llm, source, params, prompt_column=args.prompt_column or "prompt",
                              messages_column=args.messages_column, output_dir=args.output,
                              resume=args.resume, seed=args.seed,
                              rows_per_shard=args.rows_per_shard,
                              shard_seconds=args.shard_seconds or None, chat_template=template,
                              schema_column=args.schema_column, on_error=args.on_error,
                              output_format=args.output_format, use_tqdm=not args.quiet,
                              image_column=args.image_column,
                              lora_column=args.lora_column, loras=args.loras or None, **stages)
    except KeyboardInterrupt:
        sys.stderr.write(f"batchgen: interrupted; the finished rows are in {args.output}: rerun "
                         "with --resume to finish the job\n")
        return EXIT_INTERRUPTED
    _summary(ds, time.perf_counter() - start, args.output, args.max_tokens)
    return 0


def _params(args: argparse.Namespace) -> Any:
    from batchgen.params import BeamSearchParams, SamplingParams

    so = _constraint(args)
    if args.kind == "beam":
        return BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                                length_penalty=args.length_penalty,
                                early_stopping=args.early_stopping,
                                num_return_sequences=args.num_return_sequences,
                                structured_outputs=so, logprobs=args.logprobs,
                                **_beam_controls(args))
    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty,
                          max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
                          logprobs=args.logprobs, ignore_eos=args.ignore_eos, seed=args.seed,
                          structured_outputs=so)


def _beam_controls(args: argparse.Namespace) -> dict[str, Any]:
    """The beam-control flags as BeamSearchParams fields (checked there, before loading)."""
    names = ("repetition_penalty", "no_repeat_ngram_size", "bad_words", "min_tokens",
             "temperature", "num_beam_groups", "diversity_penalty")
    return {n: getattr(args, n) for n in names}


def _constraint(args: argparse.Namespace) -> Any:
    """The constraint the flags give (None without one), parsed now: a bad schema, regex or
    grammar fails before the weights load."""
    from batchgen.params import StructuredOutputsParams

    ws = None if args.max_whitespace == -1 else args.max_whitespace
    check(ws is None or ws >= 0, "--max-whitespace", ">= 0 or -1", args.max_whitespace)
    if args.json_schema is not None:
        so = StructuredOutputsParams(json=_read(args.json_schema, "--json-schema"),
                                     max_whitespace=ws)
    elif args.regex is not None:
        so = StructuredOutputsParams(regex=args.regex)
    elif args.choice is not None:
        so = StructuredOutputsParams(choice=[c for c in args.choice.split(",") if c])
    elif args.grammar is not None:
        so = StructuredOutputsParams(grammar=_read(args.grammar, "--grammar"))
    else:
        if args.schema_column is not None:
            from batchgen.sampling.grammar import load_xgrammar

            load_xgrammar()  # the extra is there before the weights load
        return None
    from batchgen.sampling.grammar import check_constraint

    check_constraint(so)
    return so


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).expanduser().read_text()
    except OSError as e:
        raise CliError(f"{flag} {path!r} cannot be read: {e.strerror}") from e


def chat_template_arg(path: str | None) -> str | None:
    """The text of `--chat-template FILE` (None without the flag); CliError if unreadable."""
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_text()
    except OSError as e:
        raise CliError(f"--chat-template {path!r} cannot be read: {e.strerror}") from e


def _summary(ds: Any, seconds: float, output: str, max_tokens: int) -> None:
    """One line: rows, samples and output tokens in the output, how many samples --max-tokens
    cut short, rows skipped with an error (under --on-error skip), and this run's wall
    time."""
    outputs = ds["outputs"]
    samples = sum(len(o) for o in outputs)
    tokens = sum(len(s["token_ids"]) for o in outputs for s in o)
    cut = sum(s["finish_reason"] == "length" for o in outputs for s in o)
    notes = f"; {cut} stopped at --max-tokens {max_tokens}" if cut else ""
    skipped = sum(e is not None for e in ds["error"]) if "error" in ds.column_names else 0
    if skipped:
        notes += (f"; {skipped} row{'' if skipped == 1 else 's'} skipped with an error (see "
                  "their `error` column)")
    print(f"batchgen: {len(ds)} rows, {samples} samples, {tokens} output tokens in {output}"
          f"{notes} ({seconds:.1f} s this run)")

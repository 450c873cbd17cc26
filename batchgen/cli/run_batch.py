"""`batchgen run-batch -i IN -o OUT --model DIR`: an OpenAI Batch API file (as `vllm
run-batch` reads it) answered line by line into OUT, written atomically; an existing OUT is
refused unless `--resume` (reuse the answers whose request is unchanged: same model, served
name, chat template, url and body; recompute the others) or `--overwrite`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from batchgen.cli.common import EXIT_INTERRUPTED
from batchgen.cli.engine import engine_args, engine_kwargs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="answer an OpenAI Batch API .jsonl file",
                       description="Answer every line of an OpenAI Batch API file "
                                   "(/v1/chat/completions, /v1/completions; /v1/embeddings with an "
                                   "embedding model) into one output "
                                   "line each, same custom_id.")
    io = p.add_argument_group("input and output")
    io.add_argument("-i", "--input-file", required=True, help="the batch file (.jsonl)")
    io.add_argument("-o", "--output-file", required=True, help="the answers (.jsonl)")
    io.add_argument("--model", required=True, help="model folder (or a hub id in the HF cache)")
    io.add_argument("--served-model-name", default=None,
                    help="the `model` in the answers (default: the model folder's name)")
    io.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    io.add_argument("--resume", action="store_true",
                    help="reuse the answers in --output-file (or a stopped run's progress) "
                         "whose request is unchanged; lines that changed (body, model) are "
                         "recomputed")
    io.add_argument("--overwrite", action="store_true",
                    help="replace an existing --output-file (without --resume or this, it is "
                         "refused)")
    io.add_argument("--seed", type=int, default=0, help="engine seed (requests without one)")
    io.add_argument("--quiet", action="store_true", help="no progress bar")
    engine_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Check the flags and paths (before anything heavy is imported), load the model, serve
    the file, print one summary line."""
    from batchgen.batch_api.paths import CLI_NAMES, check_paths
    from batchgen.cli.generate import chat_template_arg
    from batchgen.cli.kv_plan import parse_memory

    memory = None if args.kv_cache_memory is None else parse_memory(args.kv_cache_memory,
                                                                      "--kv-cache-memory")
    check_paths(Path(args.input_file).expanduser(), Path(args.output_file).expanduser(),
                args.resume, args.overwrite, CLI_NAMES)
    template = chat_template_arg(args.chat_template)
    from batchgen.batch_api import run_batch
    from batchgen.llm import LLM
    from batchgen.pooling.llm import PoolingLLM, wants_pooling

    kw = engine_kwargs(args, memory)
    if wants_pooling(args.model):  # an embedding model's folder: /v1/embeddings lines
        kw.pop("logprobs_mode")
        llm: LLM = PoolingLLM(args.model, **kw)
    else:
        llm = LLM(args.model, **kw)
    start = time.perf_counter()
    try:
        s = run_batch(llm, args.input_file, args.output_file, resume=args.resume,
                      overwrite=args.overwrite, model_name=args.served_model_name,
                      chat_template=template, use_tqdm=not args.quiet)
    except KeyboardInterrupt:
        sys.stderr.write("batchgen: interrupted; rerun with --resume to keep the answers "
                         "finished so far\n")
        return EXIT_INTERRUPTED
    print(f"batchgen: {s.lines} lines in {args.output_file}: {s.answered} answered, "
          f"{s.reused} reused, {s.recomputed} recomputed (changed), {s.errors} errors "
          f"({time.perf_counter() - start:.1f} s)")
    return 0

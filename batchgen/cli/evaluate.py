"""`batchgen eval --model DIR <lm-eval's run arguments>`: lm-evaluation-harness with the
"batchgen" backend registered (`batchgen.eval.BatchgenLM`); every argument this command does
not know (`--tasks`, `--include_path`, `--limit`, `--num_fewshot`, `--output_path`,
`--model_args`, ...) goes to lm-eval's own `run` command, so results files are lm-eval's."""

from __future__ import annotations

import argparse
import sys

from batchgen.cli.common import CliError

# Our flag -> BatchgenLM / LLM keyword, given to lm-eval as model_args (`--device` is lm-eval's
# own flag, passed on to BatchgenLM by lm-eval).
_ENGINE_FLAGS = {"tensor_parallel_size": int, "max_model_len": int, "max_num_seqs": int,
                 "block_size": int, "num_kv_blocks": int, "kv_cache_memory": str, "dtype": str,
                 "max_length": int, "max_gen_toks": int,
                 "lora_local_path": str}  # `--lora PATH` too: a PEFT LoRA folder


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="lm-evaluation-harness tasks on batchgen",
                       description="Run lm-evaluation-harness (the batchgen[eval] extra) with "
                                   "the batchgen backend; other arguments go to `lm-eval run`.")
    p.add_argument("--model", required=True, help="model folder (or a hub id in the HF cache)")
    for name, kind in _ENGINE_FLAGS.items():
        flags = ["--" + name.replace("_", "-")] + (["--lora"] if name == "lora_local_path" else [])
        p.add_argument(*flags, type=kind, default=None, dest=name)
    p.set_defaults(run=run, passthrough=True)


def lm_eval_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """lm-eval's `run` arguments: the batchgen backend, our model_args first (a user's
    `--model_args` are appended to them), then everything else as given."""
    from batchgen.cli.kv_plan import parse_memory

    pairs = [f"pretrained={args.model}"]
    for name in _ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            if name == "kv_cache_memory":
                value = parse_memory(value, "--kv-cache-memory")
            pairs.append(f"{name}={value}")
    rest, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if arg == "--model_args" and i + 1 < len(extra):
            pairs.append(extra[i + 1])
            i += 2
            continue
        if arg.startswith("--model_args="):
            pairs.append(arg.split("=", 1)[1])
        elif arg == "--model" or arg.startswith("--model="):
            raise CliError("--model is the model folder here; lm-eval's backend is always "
                           "batchgen")
        else:
            rest.append(arg)
        i += 1
    if not any(a == "--device" or a.startswith("--device=") for a in rest):
        rest += ["--device", "auto"]  # lm-eval's default is cuda:0; batchgen picks its own
    return ["run", "--model", "batchgen", "--model_args", ",".join(pairs), *rest]


def run(args: argparse.Namespace) -> int:
    """Check our arguments, register the backend and hand over to lm-eval's command line."""
    argv = lm_eval_argv(args, list(getattr(args, "extra", [])))  # before any import
    try:
        from lm_eval.__main__ import cli_evaluate

        import batchgen.eval  # noqa: F401  (registers "batchgen")
    except ImportError as e:
        raise CliError(f"batchgen eval needs lm-eval: pip install 'batchgen[eval]' ({e})") from e
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0

"""The `batchgen` command (also `python -m batchgen`): one subcommand per job.

Each subcommand module has `register(subparsers)`, which adds its parser and sets `run`, a
function of the parsed arguments that returns the exit code. Bad flags, bad values and bad
inputs print one `batchgen: error: ...` line and exit with code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from batchgen.cli.common import EXIT_INTERRUPTED, EXIT_USAGE, CliError, Parser

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "CliError", "Parser", "build_parser", "main"]


def build_parser() -> Parser:
    """The full command line: every subcommand registered."""
    from batchgen.cli import bench, embed, evaluate, generate, kv_plan, run_batch, score

    parser = Parser(prog="batchgen", description="Offline batch inference on a paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser,
                                metavar="{generate,beam,kv-plan,bench,run-batch,eval,score,embed}")
    for module in (generate, kv_plan, bench, run_batch, evaluate, score, embed):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the subcommand, and turn errors and Ctrl-C into exit codes."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):  # only `eval` passes flags on
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(args.run(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as e:
        sys.stderr.write(f"batchgen: error: {e}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("batchgen: interrupted\n")
        return EXIT_INTERRUPTED

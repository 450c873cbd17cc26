"""What every subcommand shares: the one-line error, the exit codes and the parser class."""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A problem with the command line or its inputs: one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit code 2, and every option's default
    in its --help line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"batchgen: error: {message}\n")
        sys.exit(EXIT_USAGE)

    def format_help(self) -> str:
        show_defaults(self)
        return super().format_help()


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to each option's help that does not already name its default
    (options whose default is None or False say nothing: they are off unless given)."""
    for action in parser._actions:
        default, text = action.default, action.help
        if (text == argparse.SUPPRESS or default is None or default is False
                or default == argparse.SUPPRESS or not action.option_strings
                or (text and "default" in text)):
            continue
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        action.help = f"{text} (default: {shown})" if text else f"(default: {shown})"

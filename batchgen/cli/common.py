"""What every subcommand shares: the one-line error, the exit codes and the parser class."""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A problem with the command line or its inputs: one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"batchgen: error: {message}\n")
        sys.exit(EXIT_USAGE)

"""MkDocs hook (mkdocs.yml `hooks:`): a page's `<!-- cli-help -->` becomes the `--help` text
of `batchgen` and of each subcommand, read from the parser when the site is built."""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- cli-help -->"


def _helps() -> str:
    from batchgen.cli import build_parser

    os.environ.setdefault("COLUMNS", "100")
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    blocks = [("batchgen", parser.format_help())]
    blocks += [(f"batchgen {name}", sub.format_help()) for name, sub in subs.choices.items()]
    return "\n".join(f"## `{title}`\n\n```text\n{text.rstrip()}\n```\n" for title, text in blocks)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARKER, _helps()) if MARKER in markdown else markdown

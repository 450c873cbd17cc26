"""MkDocs hook (mkdocs.yml `hooks:`): a page's `<!-- cli-help -->` becomes the `--help` text
of `batchgen` and of each subcommand, read from the parser when the site is built, and
`<!-- family-matrix -->` the family matrix's expectations, read from tests/families.py (the
test's own data, never retyped)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import Any

MARKER = "<!-- cli-help -->"
MATRIX_MARKER = "<!-- family-matrix -->"
FAMILIES = Path(__file__).resolve().parents[1] / "tests" / "families.py"


def _helps() -> str:
    from batchgen.cli import build_parser

    os.environ.setdefault("COLUMNS", "100")
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    blocks = [("batchgen", parser.format_help())]
    blocks += [(f"batchgen {name}", sub.format_help()) for name, sub in subs.choices.items()]
    return "\n".join(f"## `{title}`\n\n```text\n{text.rstrip()}\n```\n" for title, text in blocks)


def _matrix() -> str:
    spec = importlib.util.spec_from_file_location("_docs_families", FAMILIES)
    families = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(families)
    rows = [f"| `{name}` | {expected} |" for name, expected in sorted(families.MATRIX.items())]
    rows += [f"| `{name}` | left out: {why} |" for name, why in sorted(families.NOT_SHRUNK.items())]
    return "| family | expected |\n|---|---|\n" + "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, _helps())
    if MATRIX_MARKER in markdown:
        markdown = markdown.replace(MATRIX_MARKER, _matrix())
    return markdown

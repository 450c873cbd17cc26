"""The report of scripts/check_latest.sh: from pytest's JUnit XML, the family matrix's verdicts
(families new in this transformers or new to the matrix, then every failure) and the parity
suites' counts, as a markdown block; `--record` writes it into docs/families.md between the
`<!-- check_latest:start -->` and `<!-- check_latest:end -->` markers.

    python scripts/check_latest_report.py JUNIT_XML TRANSFORMERS_VERSION [--record]
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MATRIX_TEST = "test_family_equals_hf_greedy_or_is_refused_before_weights"
START, END = "<!-- check_latest:start -->", "<!-- check_latest:end -->"


def outcomes(junit: Path) -> list[tuple[str, str, str, str]]:
    """(file, test name, outcome, detail) per test case: outcome is passed, failed or
    skipped; detail the failure's first line, the skip's reason or a new family's report."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                detail = (node.get("message") or "").splitlines()[0] if node.get("message") else ""
        for prop in case.iter("property"):
            if prop.get("name") == "new_family":
                detail = prop.get("value") or detail
        cases.append((case.get("classname", ""), case.get("name", ""), outcome, detail))
    return cases


def report(cases: list[tuple[str, str, str, str]], version: str) -> str:
    """The markdown block."""
    from tests.families import ADDED_IN, MATRIX

    matrix = {}
    for _, name, outcome, detail in cases:
        m = re.fullmatch(rf"{MATRIX_TEST}\[(.+)\]", name)
        if m:
            matrix[m.group(1)] = (outcome, detail)
    lines = [f"Checked {date.today().isoformat()} with transformers {version} "
             "(`bash scripts/check_latest.sh`):", ""]
    new = sorted(f for f in matrix if f not in MATRIX or ADDED_IN.get(f) == version)
    lines.append(f"- family matrix: {len(matrix)} families; "
                 + ", ".join(f"{n} {o}" for o, n in sorted(Counter(
                     o for o, _ in matrix.values()).items())))
    for f in new:
        outcome, detail = matrix[f]
        said = MATRIX.get(f, "no expectation yet")
        lines.append(f"  - new: `{f}`: {outcome} (expected: {said})"
                     + (f"; {detail}" if detail else ""))
    for f, (outcome, detail) in sorted(matrix.items()):
        if outcome == "failed" and f not in new:
            lines.append(f"  - FAILED: `{f}`: {detail}")
    files = Counter()
    failed = []
    for file, name, outcome, detail in cases:
        if MATRIX_TEST in name:
            continue
        files[(file.rsplit(".", 1)[-1], outcome)] += 1
        if outcome == "failed":
            failed.append(f"  - FAILED: `{file.rsplit('.', 1)[-1]}::{name}`: {detail}")
    for file in sorted({f for f, _ in files}):
        counts = ", ".join(f"{files[(file, o)]} {o}" for o in ("passed", "failed", "skipped")
                           if files[(file, o)])
        lines.append(f"- `{file}`: {counts}")
    lines += failed
    return "\n".join(lines)


def record(block: str, doc: Path) -> None:
    """Replace the block between the markers in `doc` (appended with them if absent)."""
    text = doc.read_text()
    body = f"{START}\n{block}\n{END}"
    if START in text and END in text:
        text = text[:text.index(START)] + body + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + f"\n\n## The newest transformers, checked\n\n{body}\n"
    doc.write_text(text)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    block = report(outcomes(Path(argv[0])), argv[1])
    print(block)
    if "--record" in argv[2:]:
        record(block, ROOT / "docs" / "families.md")
        print("check_latest: recorded in docs/families.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

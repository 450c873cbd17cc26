"""The code stays in small pieces: no function or method in batchgen/ spans more than
MAX_FUNCTION_LINES lines (from its `def` line to its last line; decorators not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "batchgen"
MAX_FUNCTION_LINES = 60


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:line name (N lines)' for every function or method over `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} "
                                 f"{node.name} ({lines} lines)")
    return found


def test_no_function_is_over_60_lines() -> None:
    offenders = long_functions()
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines (split them):\n  "
                           + "\n  ".join(offenders))


def test_the_check_counts_from_def_to_the_last_line(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"@decorator\ndef long():\n{body}\n\n\ndef short():\n"
                                   "    pass\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/m.py:2 long (61 lines)"]
    assert long_functions(tmp_path, limit=61) == []


ROOM_LIMITS = {"engine/scheduler.py": 400, "llm.py": 300}  # decisions only; the user's API


def test_the_scheduler_and_the_llm_stay_small() -> None:
    sizes = {name: len((PACKAGE / name).read_text().splitlines()) for name in ROOM_LIMITS}
    assert {n: s for n, s in sizes.items() if s > ROOM_LIMITS[n]} == {}

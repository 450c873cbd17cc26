"""Write the names (and, where the source spells them, the defaults) of vLLM's offline API from
a vLLM source tree: `LLM.__init__`, `EngineArgs` (what `LLM(**kwargs)` takes), `generate`,
`chat`, `beam_search`, `SamplingParams` and `BeamSearchParams`. batchgen/vllm_api.json is its
output for the vLLM sdist named there; tests/test_vllm_api_surface.py walks it.

    python scripts/vllm_acceptance.py --fetch-only      # unpacks the pinned sdist
    python scripts/vllm_api_names.py ~/.cache/batchgen/vllm-src/vllm-0.34.0 batchgen/vllm_api.json

The source is parsed, never imported (vLLM needs not be installable here). A default given as
`SomeConfig.field` or `get_field(SomeConfig, "field")` is looked up in vllm/config/*.py; one
that is not a literal there is written as its source text under "expr".
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path
from typing import Any


def _classes(root: Path) -> dict[str, ast.ClassDef]:
    """Every class of vllm/config/*.py, by name."""
    out: dict[str, ast.ClassDef] = {}
    for path in sorted((root / "vllm" / "config").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, node)
    return out


def _field_value(node: ast.expr | None) -> ast.expr | None:
    """The default inside `Field(default=...)` / `field(default=...)`, or the node itself;
    a `default_factory` of dict/list/set as the empty literal."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
            "Field", "field"):
        for kw in node.keywords:
            if kw.arg == "default":
                return kw.value
            if kw.arg == "default_factory" and isinstance(kw.value, ast.Name) and \
                    kw.value.id in ("dict", "list", "set"):
                return ast.parse({"dict": "{}", "list": "[]", "set": "set()"}[kw.value.id],
                                 mode="eval").body
        return None
    return node


def _resolve(node: ast.expr | None, classes: dict[str, ast.ClassDef], depth: int = 0
             ) -> dict[str, Any]:
    """{"default": literal} when it resolves to one, else {"expr": source text}."""
    if node is None:
        return {"required": True}
    node = _field_value(node) or node
    try:
        value = ast.literal_eval(node)
        return {"default": sorted(value) if isinstance(value, set) else value}
    except (ValueError, TypeError, SyntaxError):
        pass
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "set" and not node.args:
        return {"default": []}
    target = None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        target = (node.value.id, node.attr)
    elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "get_field" and \
            len(node.args) == 2 and isinstance(node.args[0], ast.Name):
        target = (node.args[0].id, ast.literal_eval(node.args[1]))
    if target and target[0] in classes and depth < 3:
        for stmt in classes[target[0]].body:
            if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", "") == target[1]:
                found = _resolve(stmt.value, classes, depth + 1)
                if "default" in found:
                    return found
    return {"expr": ast.unparse(node)}


def _signature(fn: ast.FunctionDef, classes: dict[str, ast.ClassDef]) -> dict[str, Any]:
    """Parameter -> resolved default (self, *args and **kwargs left out)."""
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
    return {a.arg: _resolve(d, classes) for a, d in pairs if a.arg != "self"}


def _struct(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> dict[str, Any]:
    """Public fields of a dataclass / msgspec Struct -> resolved default."""
    return {s.target.id: _resolve(s.value, classes) for s in cls.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            and not s.target.id.startswith("_")}


def _find(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def collect(root: Path) -> dict[str, Any]:
    """The API's names and defaults from the tree at `root`."""
    classes = _classes(root)
    parse = lambda rel: ast.parse((root / rel).read_text())  # noqa: E731
    llm = _find(parse("vllm/entrypoints/llm.py"), "LLM")
    beam_mod = root / "vllm/entrypoints/generate/beam_search/offline.py"
    beam_cls = next(n for n in ast.walk(ast.parse(beam_mod.read_text()))
                    if isinstance(n, ast.ClassDef) and any(
                        isinstance(m, ast.FunctionDef) and m.name == "beam_search"
                        for m in n.body)) if beam_mod.exists() else llm
    sp = parse("vllm/sampling_params.py")
    version = re.search(r"version = '([^']+)'", (root / "vllm/_version.py").read_text())
    commit = re.search(r"commit_id = '([^']+)'", (root / "vllm/_version.py").read_text())
    return {
        "vllm_version": version.group(1) if version else None,
        "vllm_commit": commit.group(1) if commit else None,
        "LLM.__init__": _signature(_method(llm, "__init__"), classes),
        "EngineArgs": _struct(_find(parse("vllm/engine/arg_utils.py"), "EngineArgs"), classes),
        "LLM.generate": _signature(_method(llm, "generate"), classes),
        "LLM.chat": _signature(_method(llm, "chat"), classes),
        "LLM.beam_search": _signature(_method(beam_cls, "beam_search"), classes),
        "SamplingParams": _struct(_find(sp, "SamplingParams"), classes),
        "BeamSearchParams": _struct(_find(sp, "BeamSearchParams"), classes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="an unpacked vLLM source tree (its sdist)")
    ap.add_argument("output", type=Path, help="the JSON file to write")
    ap.add_argument("--sdist-sha256", default=None, help="recorded beside the names")
    a = ap.parse_args()
    data = collect(a.source)
    if a.sdist_sha256:
        data["sdist_sha256"] = a.sdist_sha256
    a.output.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    counts = {k: len(v) for k, v in data.items() if isinstance(v, dict)}
    print(f"wrote {a.output}: vLLM {data['vllm_version']} ({data['vllm_commit']}), {counts}")


if __name__ == "__main__":
    main()

"""batchgen's modules import in one direction: no circles (not even lazily inside a function or
under TYPE_CHECKING), no module importing a higher floor, no private name imported from
another module. The floors, lowest first, are the package's rooms (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "batchgen"

# Each module belongs to the floor of its longest listed prefix; it may import its own floor
# and the floors below.
FLOORS: list[tuple[str, ...]] = [
    ("batchgen.checks", "batchgen.log", "batchgen.cache", "batchgen.transfer",
     "batchgen.cpu_build", "batchgen.cpu_allocator", "batchgen.prompts", "batchgen.params",
     "batchgen.outputs", "batchgen.defaults", "batchgen.threads", "batchgen.param_bounds", "batchgen.id_table",
     "batchgen.vllm_args", "batchgen.multimodal.items",
     "batchgen.runners"),  # values and utilities; vLLM's argument names
    ("batchgen.kv", "batchgen.sampling",
     "batchgen.state"),  # the pool's bookkeeping and bytes; the sampler; mixers' state
    ("batchgen.attention",),  # backends over the pool
    ("batchgen.model", "batchgen.quantization",
     "batchgen.multimodal"),  # loading (quantized too), runner, inputs; images
    ("batchgen.engine",
     "batchgen.speculative"),  # scheduler, KV manager, layout, output processor, the loop; drafts
    ("batchgen.kinds", "batchgen.requests", "batchgen.results", "batchgen.token_texts",
     "batchgen.config",
     "batchgen.kv_plan", "batchgen.calls"),  # requests in and results out; settings and sizing
    ("batchgen.factory", "batchgen.progress",
     "batchgen.stats"),  # building an engine; a call's figures; request metrics
    ("batchgen.distributed",),  # tensor parallelism: workers, the TP executor
    ("batchgen.llm", "batchgen.lora"),  # the user's API; adapters (lora: LLM's seam)
    ("batchgen.data", "batchgen.eval", "batchgen.batch_api",
     "batchgen.vllm_compat", "batchgen.pooling"),  # jobs on an LLM; vLLM's module names over it
    # the package's __init__: `batchgen.LLM` imports the pooling runner (its registration) on
    # first use, so it sits above batchgen.pooling; no module below imports the package itself
    ("batchgen",),
    ("batchgen.ray",),  # dataset jobs on Ray Data
    ("batchgen.cli", "batchgen.tools", "batchgen.__main__"),  # commands
]


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, list[str]]:
    """The package's modules `name` imports (anywhere in the file), each with the names it
    takes from it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(_resolve(alias.name, known), [])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = full if full in known else _resolve(base, known)
                found.setdefault(target, []).append("" if full in known else alias.name)
    found.pop(name, None)
    found.pop("", None)
    return found


def _resolve(dotted: str, known: dict[str, Path]) -> str:
    """The longest prefix of `dotted` that is a module of the package ('' for none)."""
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted


def floor_of(name: str) -> int:
    best, floor = -1, -1
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), i
    return floor


def graph() -> dict[str, dict[str, list[str]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while comp[-1:] != [v]:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_floor() -> None:
    assert [m for m in modules() if floor_of(m) < 0] == []


def test_no_import_circles() -> None:
    edges = {m: set(deps) for m, deps in graph().items()}
    assert cycles(edges) == []


def test_no_upward_imports() -> None:
    upward = [f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})"
              for m, deps in graph().items() for d in deps if floor_of(d) > floor_of(m)]
    assert upward == []


def test_no_private_names_cross_modules() -> None:
    private = [f"{m} imports {n} from {d}" for m, deps in graph().items()
               for d, names in deps.items() for n in names if n.startswith("_")]
    assert private == []


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "batchgen"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("def f():\n    from batchgen.engine.b import _x\n")
    (pkg / "engine" / "b.py").write_text("from batchgen.engine import a\nimport batchgen.llm\n")
    (pkg / "llm.py").write_text("")
    known = modules(pkg)
    deps = {m: imports(m, p, known) for m, p in known.items()}
    assert cycles({m: set(d) for m, d in deps.items()}) == [["batchgen.engine.a",
                                                             "batchgen.engine.b"]]
    assert deps["batchgen.engine.a"] == {"batchgen.engine.b": ["_x"]}
    assert floor_of("batchgen.llm") > floor_of("batchgen.engine.b")


def test_only_the_kv_manager_and_the_factory_hold_a_block_manager() -> None:
    """Block tables change through the KVManager alone: besides the kv package, only it (and
    the factory, which builds one for it) imports the BlockManager."""
    holders = sorted(m for m, deps in graph().items() for d, names in deps.items()
                     if "BlockManager" in names and not m.startswith("batchgen.kv"))
    assert holders == ["batchgen.engine.kv_manager", "batchgen.factory"]

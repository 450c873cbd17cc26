"""Export the notebooks' plots for the docs site: run each notebook in notebooks/ top to bottom
(its code cells in one namespace, as tests/test_notebook.py does), save every figure it draws
as docs/assets/notebooks/<notebook>-<k>.png, and write docs/assets/notebooks/figures.json
(each notebook's SHA-256 and its figures), so the site's "How it works" page shows what the
notebooks drew, never a figure made by hand, and tests/test_docs_site.py can tell when a
notebook changed after its figures were exported.

    PYTHONPATH=. python scripts/export_notebook_figures.py [--tiny] [NOTEBOOK ...]

`--tiny` runs on the tiny random model (BATCHGEN_DEMO_MODEL=tiny) instead of SmolLM2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
OUT = ROOT / "docs" / "assets" / "notebooks"
MANIFEST = OUT / "figures.json"


def digest(notebook: Path) -> str:
    """The notebook's code cells' SHA-256: what the figures depend on."""
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n# ---\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return hashlib.sha256(code.encode()).hexdigest()


def export(notebook: Path) -> list[str]:
    """Run the notebook; save each figure it leaves open after a cell; return the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.show = lambda *args, **kwargs: None  # Agg cannot show: keep the figures to save them
    cells = json.loads(notebook.read_text())["cells"]
    namespace: dict = {"__name__": "__notebook__"}
    names: list[str] = []
    for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        exec(compile("".join(cell["source"]), f"{notebook.name}[code cell {i}]", "exec"), namespace)
        for number in plt.get_fignums():
            name = f"{notebook.stem}-{len(names) + 1}.png"
            plt.figure(number).savefig(OUT / name, dpi=80, bbox_inches="tight")
            names.append(name)
        plt.close("all")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", help="stems (default: every notebook)")
    p.add_argument("--tiny", action="store_true", help="the tiny random model, not SmolLM2")
    args = p.parse_args(argv)
    if args.tiny:
        os.environ["BATCHGEN_DEMO_MODEL"] = "tiny"
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.is_file() else {}
    for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
        if args.notebooks and nb.stem not in args.notebooks:
            continue
        for old in manifest.get(nb.name, {}).get("figures", []):
            (OUT / old).unlink(missing_ok=True)
        start = time.perf_counter()
        figures = export(nb)
        manifest[nb.name] = {"sha256": digest(nb), "figures": figures,
                             "model": "tiny" if args.tiny else "demo_model()"}
        print(f"{nb.name}: {len(figures)} figures, {time.perf_counter() - start:.0f} s")
    MANIFEST.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

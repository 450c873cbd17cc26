"""The README's benchmark tables, from the files the benchmarks write (never typed by hand).

`benchmarks/throughput.py`, `sampling.py` and `prefix_cache.py`, run with `--json
benchmarks/figures/<name>.json`, leave their figures there; this script renders the headline
tables from those files into the marked block of the newest section of `benchmarks/RESULTS.md`
that has one, and copies that block into `README.md`:

    PYTHONPATH=. python scripts/readme_figures.py          # write both blocks
    PYTHONPATH=. python scripts/readme_figures.py --check  # exit 1 if either is stale

tests/test_docs_site.py runs the check, so the README's table is always RESULTS.md's newest
one, and that one is always what the JSON files hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "benchmarks" / "figures"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
README = ROOT / "README.md"
BEGIN = "<!-- benchmark-table: rendered by scripts/readme_figures.py from benchmarks/figures/ -->"
END = "<!-- /benchmark-table -->"


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIGURES / f"{name}.json").read_text())


def _x(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2f}x"


def _headline(tp: dict[str, Any], sm: dict[str, Any], pc: dict[str, Any]) -> list[str]:
    a, s = tp["args"], tp["summary"]
    rows = [f"| greedy, {a['num_prompts']} prompts of {a['min_prompt_len']}-{a['max_prompt_len']}"
            f" tokens, {a['output_len']} new tokens | {s['batchgen_output_tok_s']:,.0f} tok/s | "
            f"{_x(s['batchgen_over_hf_generate'])} | {_x(s['batchgen_over_generate_batch'])} |"]
    for key, label in ((f"sampling n={sm['args']['n']}", f"n={sm['args']['n']} sampling"),
                       ("beam W=4", "beam width 4")):
        s = sm["summary"][key]
        gb = s.get("batchgen_over_generate_batch")
        rows.append(f"| {label}, {sm['args']['num_prompts']} prompts | "
                    f"{s['batchgen_output_tok_s']:,.0f} tok/s | "
                    f"{_x(s['batchgen_over_hf_generate'])} | "
                    f"{_x(gb) if gb else '(no beam search)'} |")
    on = next(r for r in pc["results"] if r["system"] == "batchgen, prefix caching on")
    hf = min((r for r in pc["results"] if r["system"] == "HF generate"),
             key=lambda r: r["wall_s"])  # the fastest HF batch size
    a = pc["args"]
    rows.append(f"| {a['num_prompts']} requests sharing a {a['system_len']}-token system prompt | "
                f"{a['num_prompts'] / on['wall_s']:.1f} req/s | "
                f"{_x(hf['wall_s'] / on['wall_s'])} (batch {hf['extra']['batch_size']}) | |")
    return ["| workload | batchgen | vs HF `generate` | vs HF `generate_batch` |",
            "|---|--:|--:|--:|", *rows]


def _memory(sm: dict[str, Any]) -> list[str]:
    rows = []
    for key, label in ((f"sampling n={sm['args']['n']}", f"n={sm['args']['n']} sampling"),
                       ("beam W=16", "beam width 16")):
        kv = sm["results"][key][0]["extra"]
        rows.append(f"| {label} | {kv['peak_tokens']:,} | {kv['contiguous_tokens']:,} | "
                    f"{100 * kv['saving_vs_contiguous']:.1f}% |")
    return ["| memory (KV tokens at peak) | batchgen | contiguous (HF-style) | saved |",
            "|---|--:|--:|--:|", *rows]


def render() -> str:
    """The block: the tables and where they come from."""
    tp, sm, pc = _load("throughput"), _load("sampling"), _load("prefix_cache")
    m = tp["machine"]
    threads = sorted({d["machine"]["torch_threads"] for d in (tp, sm, pc)})
    note = (f"Run {m['date'][:10]}: {m['host_cpus']} CPUs, {'/'.join(map(str, threads))} torch "
            f"thread(s), torch {m['torch']}, transformers {m['transformers']}; best of "
            f"{tp['args']['repeats']} (throughput), {sm['args']['repeats']} (sampling, beams), "
            f"{pc['args']['repeats']} (prefix caching) interleaved rounds.")
    return "\n".join([BEGIN, *_headline(tp, sm, pc), "", *_memory(sm), "", note, END])


def _replace_first(text: str, block: str) -> str:
    start = text.index(BEGIN)
    end = text.index(END, start) + len(END)
    return text[:start] + block + text[end:]


def stale() -> list[Path]:
    """The files whose block differs from what the JSON files give."""
    block = render()
    return [p for p in (RESULTS, README) if _replace_first(p.read_text(), block) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    args = p.parse_args(argv)
    if args.check:
        out = stale()
        for path in out:
            print(f"{path.relative_to(ROOT)}: benchmark table stale; run scripts/readme_figures.py")
        return 1 if out else 0
    block = render()
    for path in (RESULTS, README):
        path.write_text(_replace_first(path.read_text(), block))
    return 0


if __name__ == "__main__":
    sys.exit(main())

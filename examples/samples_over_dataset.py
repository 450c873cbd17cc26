"""n samples per row of a `datasets.Dataset`, written to Parquet shards and resumable.

Shows `batchgen.data.generate_dataset`: 12 short prompts (with an extra `topic` column) get 4
samples each, the finished rows go to `part-*.parquet` shards in an output folder, the folder
is read back with `datasets.load_dataset("parquet", ...)`, and a rerun with `resume=True` finds
every shard done and computes nothing.

    python examples/samples_over_dataset.py [MODEL_DIR [OUTPUT_DIR]]

Without MODEL_DIR it uses a tiny random model (made once under ~/.cache/batchgen/models), so the
samples are gibberish; without OUTPUT_DIR it writes to a temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import datasets

from batchgen import LLM, SamplingParams
from batchgen.data import generate_dataset
from batchgen.tools.demo_model import demo_model

TOPICS = {
    "geography": ["The capital of France is", "The longest river in Africa is",
                  "Mount Everest lies on the border of"],
    "poetry": ["Write a haiku about the sea.", "A limerick about a cat:",
               "Roses are red, violets are"],
    "science": ["Explain photosynthesis to a child.", "Water boils at",
                "The speed of light is about"],
    "code": ["def fibonacci(n):", "# Python: reverse a list\n", "SELECT name FROM users WHERE"],
}
PARAMS = SamplingParams(n=4, temperature=0.8, max_tokens=24)


def make_dataset() -> datasets.Dataset:
    """12 rows: a `prompt` column and a `topic` column (kept in the output)."""
    rows = [{"prompt": p, "topic": t} for t, ps in TOPICS.items() for p in ps]
    return datasets.Dataset.from_list(rows)


def shard_times(out: Path) -> dict[str, int]:
    """Each shard's name and modification time (ns): unchanged files mean no rewrite."""
    return {f.name: f.stat().st_mtime_ns for f in sorted(out.glob("part-*.parquet"))}


def run(llm: LLM, ds: datasets.Dataset, out: Path) -> None:
    generate_dataset(llm, ds, PARAMS, output_dir=out, seed=0, rows_per_shard=4, use_tqdm=False)
    stats = llm.kv_stats()
    print(f"wrote {len(shard_times(out))} shards to {out}: "
          f"{stats.prompt_tokens_computed} prompt tokens computed (each row's prompt once, "
          f"shared by its {PARAMS.n} samples), peak {stats.peak_blocks_in_use} KV blocks")

    table = datasets.load_dataset("parquet", data_files=f"{out}/part-*.parquet", split="train")
    table = table.sort("row_id")
    print(f"reloaded {table.num_rows} rows, columns {table.column_names}")
    for row in table.select(range(3)):
        print(f"\nrow {row['row_id']} [{row['topic']}] {row['prompt']!r} "
              f"({row['num_prompt_tokens']} prompt tokens)")
        for s in row["outputs"]:
            print(f"  sample {s['index']}: {s['text']!r} ({s['finish_reason']}, "
                  f"logprob {s['cumulative_logprob']:.2f})")

    before = shard_times(out)
    generate_dataset(llm, ds, PARAMS, output_dir=out, seed=0, rows_per_shard=4, resume=True,
                     use_tqdm=False)
    computed = llm.kv_stats().prompt_tokens_computed
    same = shard_times(out) == before
    print(f"\nresume=True: {computed} prompt tokens computed, shards untouched: {same} "
          f"-> {'no new work' if computed == 0 and same else 'WORK WAS REDONE'}")


def main(model: str | None, output_dir: str | None = None) -> None:
    llm = LLM(demo_model(model, real=False), block_size=16)
    ds = make_dataset()
    print(f"{ds.num_rows} rows x n={PARAMS.n} samples, columns {ds.column_names}")
    if output_dir is not None:
        run(llm, ds, Path(output_dir))
        return
    with tempfile.TemporaryDirectory(prefix="batchgen-samples-") as tmp:
        run(llm, ds, Path(tmp) / "samples")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2] if len(sys.argv) > 2 else None)

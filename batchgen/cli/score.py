"""`batchgen score --model RM --input candidates.jsonl --output scored.jsonl`: every line's text
(`--text-column`, or `--prompt-column` + `--response-column` joined) scored by a
sequence-classification reward model on the paged engine; each line is written back with a
`score` (the raw reward, first label) and `scores` (every label)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from batchgen.cli.common import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="score JSON Lines texts with a reward model",
                       description="Score each line of a JSON Lines file with a "
                                   "*ForSequenceClassification reward model (raw rewards).")
    p.add_argument("--model", required=True, help="reward model folder")
    p.add_argument("--input", required=True, help="the lines (.jsonl)")
    p.add_argument("--output", required=True, help="the scored lines (.jsonl)")
    p.add_argument("--text-column", default="text", help="the text to score")
    p.add_argument("--prompt-column", default=None, help="with --response-column: "
                   "score prompt + response instead of --text-column")
    p.add_argument("--response-column", default=None, help="see --prompt-column")
    p.add_argument("--block-size", type=int, default=16, help="KV block size")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.set_defaults(run=run)


def output_path(args: argparse.Namespace) -> Path:
    """--output, refused (CliError) when it exists without --overwrite."""
    out = Path(args.output).expanduser()
    if out.exists() and not args.overwrite:
        raise CliError(f"--output {args.output!r} exists: pass --overwrite to replace it")
    return out


def write_lines(out: Path, rows: list[dict], added: list[dict]) -> None:
    """Each row with its added fields, as JSON Lines, replacing `out` only once all are written."""
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w") as f:
        for row, extra in zip(rows, added):
            f.write(json.dumps({**row, **extra}) + "\n")
    tmp.replace(out)


def read_texts(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """The input's rows and their texts, or a CliError naming the file, line and column."""
    path = Path(args.input).expanduser()
    if not path.is_file():
        raise CliError(f"--input must be an existing .jsonl file, got {args.input!r}")
    if (args.prompt_column is None) != (args.response_column is None):
        raise CliError("--prompt-column and --response-column must be given together")
    cols = ([args.prompt_column, args.response_column] if args.prompt_column
            else [args.text_column])
    rows, texts = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CliError(f"{args.input} line {n} is not JSON: {e}") from None
        missing = [c for c in cols if not isinstance(row.get(c), str)]
        if missing:
            raise CliError(f"{args.input} line {n} has no text column {missing[0]!r}")
        rows.append(row)
        texts.append("".join(row[c] for c in cols))
    return rows, texts


def run(args: argparse.Namespace) -> int:
    """Check the flags and the input before the model loads, score, write, print a summary."""
    out = output_path(args)
    rows, texts = read_texts(args)
    from batchgen.pooling.scorer import RewardModel

    rm = RewardModel(args.model, block_size=args.block_size)
    outs = rm.reward(texts)
    write_lines(out, rows, [{"score": o.outputs.probs[0], "scores": o.outputs.probs}
                            for o in outs])
    print(f"batchgen: {len(rows)} lines scored into {args.output} "
          f"(prefix hit tokens {rm.llm.kv_stats().prefix_hit_tokens})")
    return 0

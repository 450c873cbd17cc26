"""`batchgen embed --model M --input texts.jsonl --output embedded.jsonl`: every line's text
(`--text-column`) embedded by an embedding model on the paged engine (batchgen.pooling:
last-token, mean or CLS pooling as the folder's sentence-transformers files or
`--pooling-type` say); each line is written back with an `embedding` (a list of floats)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embed JSON Lines texts with an embedding model",
                       description="Embed each line of a JSON Lines file with a decoder "
                                   "embedding model (a *Model folder, or a causal LM's).")
    p.add_argument("--model", required=True, help="embedding model folder")
    p.add_argument("--input", required=True, help="the lines (.jsonl)")
    p.add_argument("--output", required=True, help="the embedded lines (.jsonl)")
    p.add_argument("--text-column", default="text", help="the text to embed")
    p.add_argument("--pooling-type", default=None, choices=("LAST", "MEAN", "CLS"),
                   help="default: the folder's sentence-transformers pooling, else LAST")
    p.add_argument("--dimensions", type=int, default=None,
                   help="Matryoshka: keep the first N dimensions (before normalizing)")
    p.add_argument("--no-normalize", action="store_true", help="no L2 normalization")
    p.add_argument("--block-size", type=int, default=16, help="KV block size")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.set_defaults(run=run, prompt_column=None, response_column=None)


def run(args: argparse.Namespace) -> int:
    """Check the flags and the input before the model loads, embed, write, print a summary."""
    from batchgen.cli.score import output_path, read_texts, write_lines
    from batchgen.pooling.params import PoolingParams

    out = output_path(args)
    params = PoolingParams(dimensions=args.dimensions,
                           normalize=False if args.no_normalize else None)
    rows, texts = read_texts(args)
    from batchgen.pooling.llm import PoolingLLM

    pooler = None if args.pooling_type is None else {"pooling_type": args.pooling_type}
    llm = PoolingLLM(args.model, pooler_config=pooler, block_size=args.block_size)
    outs = llm.embed(texts, params)
    write_lines(out, rows, [{"embedding": o.outputs.embedding} for o in outs])
    print(f"batchgen: {len(rows)} lines embedded into {args.output} "
          f"(prefix hit tokens {llm.kv_stats().prefix_hit_tokens})")
    return 0

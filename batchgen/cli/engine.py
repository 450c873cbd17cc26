"""The engine flags every command that loads a model shares (LLM's arguments), and the
LLM keyword arguments they make."""

from __future__ import annotations

import argparse
from typing import Any

from batchgen.sampling.logprobs_mode import LOGPROBS_MODES


def engine_args(p: argparse.ArgumentParser) -> None:
    """Add the "engine" group of flags."""
    e = p.add_argument_group("engine")
    e.add_argument("--tokenizer", default=None)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--kv-cache-memory", default=None, help="KV pool bytes, e.g. 4GiB")
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--kv-cache-dtype", default="auto")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--device", default=None)
    e.add_argument("--attention-backend", default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N ranks (processes; GPUs on CUDA): N must divide "
                        "its attention and KV heads (default 1)")
    e.add_argument("--swap-space", type=float, default=0, metavar="GIB",
                   help="GiB of CPU RAM to swap preempted groups' KV blocks into (default 0)")
    e.add_argument("--preemption-mode", default=None, choices=("recompute", "swap"),
                   help="default: swap with --swap-space, else recompute")
    e.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                   help="plan the next step while this one's forward runs (same outputs); "
                        "default: $BATCHGEN_ASYNC_SCHEDULING, else off")
    e.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                   help="what logprobs report (vLLM's): the model's raw log-softmax or logits, "
                        "or the processed ones each token was drawn from (after penalties, "
                        "temperature, top-k/top-p/min-p); default raw_logprobs")


def engine_kwargs(args: argparse.Namespace, kv_cache_memory: int | None) -> dict[str, Any]:
    """LLM's arguments from the engine flags."""
    return dict(tokenizer=args.tokenizer, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching,
                kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=kv_cache_memory,
                num_kv_blocks=args.num_kv_blocks, dtype=args.dtype, device=args.device,
                attention_backend=args.attention_backend, seed=args.seed,
                tensor_parallel_size=args.tensor_parallel_size, swap_space=args.swap_space,
                preemption_mode=args.preemption_mode, async_scheduling=args.async_scheduling,
                logprobs_mode=args.logprobs_mode)

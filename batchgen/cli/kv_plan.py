"""`batchgen kv-plan`: how many tokens and sequences a KV budget holds, from config.json alone.

No weights are read: the folder needs only its config.json (a .gguf file: its metadata and
tensor headers). The figures are the ones `LLM`
sizes its pool with (see `batchgen.kv_plan`), down to the capacity line it logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from batchgen.cli.common import CliError
from batchgen.defaults import DEFAULT_CPU_KV_BYTES, KV_CACHE_DTYPES, MODEL_DTYPES, format_bytes

if TYPE_CHECKING:  # torch and transformers come with the plan, not with --help
    from batchgen.kv_plan import KvPlan

MEMORY_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MEMORY_FORMS = ("plain bytes (e.g. 1073741824) or a number with B, KB, MB, GB, TB (powers of "
                "1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 512MiB, 80GiB, 1.5GB")
_MEMORY_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the kv-plan subcommand."""
    p = sub.add_parser(
        "kv-plan", help="KV-cache capacity of a model for a memory budget (config.json only)",
        description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model folder (only config.json is read), a .gguf file (its metadata "
                        "and tensor headers) or a cached hub id")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest sequence (default: the model's max_position_embeddings, "
                        "capped by the pool)")
    p.add_argument("--memory", default=None, metavar="BYTES",
                   help="KV budget, LLM's kv_cache_memory: bytes or 512MiB, 80GiB, 1.5GB "
                        f"(default: the CPU default, {format_bytes(DEFAULT_CPU_KV_BYTES)})")
    p.add_argument("--device-memory", default=None, metavar="BYTES",
                   help="the device's memory (e.g. 80GiB): without --memory, the KV budget is "
                        "0.9 of it less the checkpoint's weights as stored (quantized ones "
                        "at their packed size; a GGUF file's as loaded: dequantized)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--block-size", type=int, default=16, metavar="B")
    p.add_argument("--dtype", default="auto", choices=MODEL_DTYPES,
                   help="model dtype ('auto': the config's); the KV dtype for --kv-cache-dtype "
                        "auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--swap-space", type=float, default=0, metavar="GIB",
                   help="GiB of CPU RAM for swapped-out blocks (LLM's swap_space; default 0)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run)


def parse_memory(text: str, flag: str = "--memory") -> int:
    """Bytes from '1073741824', '512MiB', '80GiB', '1.5GB' (GiB = 2^30, GB = 10^9); whole
    bytes, rounded down; a CliError naming `flag` (the option the text came from) otherwise."""
    m = _MEMORY_RE.fullmatch(text)
    unit = MEMORY_UNITS.get(m.group(2).upper()) if m else None
    value = int(Decimal(m.group(1)) * unit) if m and unit else 0
    if value < 1:
        raise CliError(f"{flag} must be a positive size: {MEMORY_FORMS}; got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """Plan the pool and print the report (or JSON)."""
    memory = None if args.memory is None else parse_memory(args.memory)
    device = (None if args.device_memory is None
              else parse_memory(args.device_memory, "--device-memory"))
    from batchgen.kv_plan import plan_kv

    path, config, weights, weights_as = _checkpoint(args)
    plan = plan_kv(config, memory=memory, block_size=args.block_size,
                   max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
                   dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                   swap_space=args.swap_space, weight_bytes=weights,
                   device_memory=device)
    if weights_as:
        plan = dataclasses.replace(plan, weights_as=weights_as, quantization="gguf")
    if args.json:
        print(json.dumps({"model": str(path), **plan.to_dict()}, indent=2))
    else:
        print("\n".join(report_lines(plan, str(path))))
    return 0


def _checkpoint(args: argparse.Namespace) -> tuple[Any, Any, int | None, str | None]:
    """(path, config, weight bytes, how they were counted) of a model folder or a .gguf file
    (its metadata's config; its weights as transformers loads them: dequantized)."""
    import torch

    from batchgen.model import loader
    from batchgen.quantization import (
        checkpoint_bytes,
        gguf_parameters,
        gguf_source,
        load_gguf_config,
    )

    try:
        gguf = gguf_source(args.model)
        if gguf is None:
            path = loader.resolve_model_dir(args.model, "--model")
            return path, loader.load_config(path, args.trust_remote_code), (
                checkpoint_bytes(path) or None), None
        config = load_gguf_config(*gguf, args.trust_remote_code)
    except ValueError as e:
        raise CliError(str(e)) from None
    file = gguf[0] / gguf[1]
    size = torch.empty((), dtype=loader.resolve_dtype(args.dtype, config)).element_size()
    return file, config, gguf_parameters(file) * size, (
        f"as loaded: dequantized from the {format_bytes(file.stat().st_size)} GGUF file")


def report_lines(plan: KvPlan, model: str) -> list[str]:
    """The human-readable plan: geometry, β, one sequence, the pool, concurrency, LLM's line."""
    beta, s = plan.bytes_per_token, plan.max_model_len
    budget = (f"{format_bytes(plan.memory_bytes)} (the CPU default: no --memory given; on a "
              "GPU LLM sizes the pool from the memory left after the weights)"
              if plan.memory_is_default else f"{format_bytes(plan.memory_bytes)} "
              f"({plan.memory_bytes:,} bytes)")
    widths, formula = f"d_h={plan.head_dim}", "2 * L * H_kv * d_h * b"
    if plan.latent:  # an MLA latent: one head, the values are its first d_v columns
        widths = (f"latent d_h={plan.head_dim} (kv_lora_rank {plan.head_dim_v} + rope "
                  f"{plan.head_dim - (plan.head_dim_v or 0)}; values are its first "
                  f"{plan.head_dim_v})")
        formula = "L * H_kv * d_h * b"
    elif plan.head_dim_v is not None:  # keys and values of different widths (MLA)
        widths = f"d_k={plan.head_dim}, d_v={plan.head_dim_v} (K and V widths differ)"
        formula = "L * H_kv * (d_k + d_v) * b"
    lines = [
        f"model: {model} ({plan.model_type}, {plan.model_dtype})",
        f"geometry: L={plan.num_layers} layers, H_kv={plan.num_kv_heads} KV heads, "
        f"{widths}, KV dtype {plan.kv_dtype} (b={plan.dtype_bytes} bytes)",
        f"beta = {formula} = {beta:,} bytes/token = {beta / 2**20:.3f} MiB/token",
        f"block: {plan.block_size} tokens = {plan.bytes_per_block:,} bytes "
        f"({format_bytes(plan.bytes_per_block)})",
        f"one sequence of max_model_len={s} tokens: {format_bytes(plan.seq_bytes)} "
        f"({plan.seq_bytes:,} bytes), {plan.seq_blocks} blocks in its block table",
        *_weight_lines(plan),
        f"memory: {budget}",
        f"pool: {plan.num_blocks:,} blocks = {plan.num_tokens:,} tokens, "
        f"{format_bytes(plan.pool_bytes)}",
    ]
    if plan.capped_by_max_num_seqs:
        lines.append(f"  (capped at what max_num_seqs={plan.max_num_seqs} sequences of {s} "
                     "tokens can use, as LLM does with its default budget)")
    if s < plan.model_max_len:
        lines.append(f"max_model_len = {s}, what the KV pool holds (the model allows "
                     f"{plan.model_max_len})")
    lines.append(f"max concurrency at max_model_len={s}: {plan.max_concurrency:.2f}x")
    if plan.num_host_blocks:
        lines.append(
            f"swap pool: {plan.swap_space:g} GiB of CPU RAM / {plan.bytes_per_block:,} bytes "
            f"per block = {plan.num_host_blocks:,} blocks = "
            f"{plan.num_host_blocks * plan.block_size:,} tokens "
            f"({plan.num_host_blocks / plan.seq_blocks:.2f} max_model_len sequences "
            "swapped out at once)")
    lines += _beside_the_pool(plan)
    lines.append(f"LLM logs: {plan.capacity_line()}")
    return lines


def _beside_the_pool(plan: KvPlan) -> list[str]:
    """What the pool's figures leave out: sliding windows it does not save, mixer state and
    image features kept beside it."""
    s, lines = plan.max_model_len, []
    if plan.sliding is not None:
        sw, windowed = plan.sliding, plan.windowed_seq_bytes or 0
        lines.append(
            f"sliding windows: {sw.num_windowed} of {sw.num_layers} layers slide over "
            f"{sw.window} tokens; a window-aware allocator would need {format_bytes(windowed)} "
            f"({windowed:,} bytes) per {s}-token sequence instead of "
            f"{format_bytes(plan.seq_bytes)}: batchgen does NOT save this yet (its pool keeps "
            "every token of every layer)")
    if plan.state_bytes_per_seq:
        per = plan.state_bytes_per_seq
        lines.append(
            f"mixer state (SSM / linear attention / conv layers): {format_bytes(per)} "
            f"({per:,} bytes) per sequence, whatever its length; {plan.max_num_seqs} "
            f"sequences: {format_bytes(per * plan.max_num_seqs)} beside the KV pool")
    if plan.encoder_cache_bytes:
        lines.append(
            f"images: each image's placeholder tokens are tokens of the pool above; the encoder "
            f"cache keeps up to {format_bytes(plan.encoder_cache_bytes)} of image features "
            "beside it (kept out of a GPU pool sized from free memory)")
    return lines


def _weight_lines(plan: KvPlan) -> list[str]:
    """The checkpoint's weights (bytes as stored, its quantization) and, with a device size,
    how the KV budget came from them."""
    lines = []
    if plan.weight_bytes is not None:
        quant = (f", quantized: {plan.quantization}" if plan.quantization
                 else ", not quantized")
        lines.append(f"weights: {format_bytes(plan.weight_bytes)} ({plan.weight_bytes:,} bytes "
                     f"{plan.weights_as}{quant})")
    derived = (plan.device_memory is not None and plan.memory_bytes == int(
        plan.device_memory * 0.9) - (plan.weight_bytes or 0))
    if derived:
        lines.append(f"KV budget: 0.9 x {format_bytes(plan.device_memory)} of device memory - "
                     f"the weights = {format_bytes(plan.memory_bytes)} (activations not "
                     "counted: LLM profiles them on a GPU)")
    return lines

"""`batchgen bench`: offline throughput of batchgen's engine on random token-id prompts.

Like `vllm bench throughput`: N prompts of uniform random length, a fixed number of output
tokens each (EOS ignored), one untimed warm-up on two prompts, then timed runs of the whole
workload; the fastest is reported (on a shared machine other load only ever adds time).
Without --model, a random-weight Llama of the benchmarks' default shape is written to a
temporary folder, so the command runs from an installed package with nothing downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from batchgen.checks import check
from batchgen.cli.common import CliError
from batchgen.defaults import MODEL_DTYPES

if TYPE_CHECKING:  # torch is imported when the command runs, not for --help
    import torch

# The random model: benchmarks/throughput.py's default shape (a small GQA Llama).
RANDOM_MODEL = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
                "num_key_value_heads": 2, "intermediate_size": 688, "head_dim": 32}
RANDOM_VOCAB = 4096
BOS_ID = 1  # batchgen's tiny models: <pad> 0, <s> 1, </s> 2
FIRST_REGULAR_ID = 3  # prompts' other ids avoid the special tokens
WARMUP_PROMPTS = 2
WARMUP_TOKENS = 8
T = TypeVar("T")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the bench subcommand."""
    p = sub.add_parser("bench", help="offline throughput on random prompts (like vllm bench "
                       "throughput)", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, metavar="DIR",
                   help="model folder or cached hub id (default: a random-weight Llama, "
                        "hidden 256, 4 layers, 8/2 q/kv heads, ffn 688, vocab 4096)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--n", type=int, default=1,
                   help="samples per prompt (n > 1 samples at temperature 1, else greedy)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts, weights and sampling")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs after the warm-up; the fastest is reported")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--dtype", default="auto", choices=MODEL_DTYPES)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N ranks (processes; GPUs on CUDA) (default 1)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the results as JSON to PATH")
    p.set_defaults(run=run)


@dataclass(frozen=True)
class BenchResult:
    """One benchmark: the workload, the fastest timed run, and the engine's KV figures."""

    model: str
    num_prompts: int
    n: int
    output_len: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    wall_s_all: list[float]
    kv_stats: dict[str, int]
    capacity_line: str  # the pool as LLM logged it (see `batchgen kv-plan`)
    attention_backend: str
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_prompts / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        """Prompt tokens (once per request) plus every generated token, per second."""
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
            d[name] = getattr(self, name)
        return d


def random_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int
                   ) -> list[list[int]]:
    """Token-id prompts of uniform random length in [min_len, max_len]: BOS, then ids uniform
    in [3, vocab_size) (no pad/BOS/EOS); the same for a given seed."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    return [[BOS_ID] + [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(n - 1)]
            for n in lengths]


def check_args(args: argparse.Namespace) -> None:
    """A ValueError (or CliError) naming the flag for a workload that cannot run."""
    for flag, value in (("--num-prompts", args.num_prompts), ("--output-len", args.output_len),
                        ("--n", args.n), ("--repeats", args.repeats),
                        ("--tensor-parallel-size", args.tensor_parallel_size)):
        check(value >= 1, flag, ">= 1", value)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        raise CliError(f"need 1 <= --min-prompt-len <= --max-prompt-len, got "
                       f"{args.min_prompt_len} and {args.max_prompt_len}")
    if args.json is not None and not args.json.parent.is_dir():
        raise CliError(f"--json: folder {str(args.json.parent)!r} does not exist")


@contextlib.contextmanager
def model_folder(model: str | None, max_len: int, seed: int) -> Iterator[str]:
    """The --model folder, or a random-weight Llama (no tokenizer) written to a temporary
    folder whose positions cover `max_len`, deleted afterwards."""
    if model is not None:
        from batchgen.model.loader import resolve_model_dir

        yield str(resolve_model_dir(model, "--model"))
        return
    from transformers.utils import logging as hf_logging

    from batchgen.tools.make_tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmp:
        bars_were_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a scratch folder
        try:
            make_tiny_model(tmp, family="llama", vocab_size=RANDOM_VOCAB, seed=seed,
                            with_tokenizer=False, max_position_embeddings=max(1024, max_len),
                            **RANDOM_MODEL)
        finally:
            if bars_were_on:
                hf_logging.enable_progress_bar()
        yield tmp


def random_model_name() -> str:
    """How the report names the random model."""
    m = RANDOM_MODEL
    return (f"random-weight Llama (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
            f"{m['num_attention_heads']}/{m['num_key_value_heads']} q/kv heads, head_dim "
            f"{m['head_dim']}, ffn {m['intermediate_size']}, vocab {RANDOM_VOCAB}, float32)")


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the figures depend on: torch, threads, CPUs, device."""
    import torch

    import batchgen

    info: dict[str, Any] = {"batchgen": batchgen.__version__, "torch": torch.__version__,
                            "torch_threads": torch.get_num_threads(),
                            "host_cpus": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """fn()'s result and its wall seconds, queued GPU work included."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _d: None)
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    """Load, warm up, time the workload, print (and write) the figures."""
    from batchgen import LLM, SamplingParams

    check_args(args)
    needed = args.max_prompt_len + args.output_len
    with model_folder(args.model, needed, args.seed) as folder:
        llm = LLM(folder, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  dtype=args.dtype, device=args.device, seed=args.seed,
                  tensor_parallel_size=args.tensor_parallel_size)
        if needed > llm.max_model_len:
            raise CliError(f"--max-prompt-len + --output-len ({needed}) must be <= "
                           f"max_model_len ({llm.max_model_len})")
        prompts = random_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                                 llm.vocab_size, args.seed)
        requests = [{"prompt_token_ids": p} for p in prompts]

        def params(max_tokens: int) -> SamplingParams:
            return SamplingParams(temperature=0 if args.n == 1 else 1.0, n=args.n,
                                  seed=args.seed, max_tokens=max_tokens, ignore_eos=True)

        llm.generate(requests[:WARMUP_PROMPTS], params(min(args.output_len, WARMUP_TOKENS)),
                     use_tqdm=False)
        walls, output_tokens = [], 0
        for _ in range(args.repeats):
            llm.reset_prefix_cache()  # each run computes its prompts (no hits on the last's)
            outs, wall = _timed(lambda: llm.generate(requests, params(args.output_len),
                                                     use_tqdm=False), llm.device)
            walls.append(wall)
            output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        result = BenchResult(
            model=str(llm.model_path) if args.model else random_model_name(),
            num_prompts=len(prompts), n=args.n, output_len=args.output_len,
            prompt_tokens=sum(map(len, prompts)), output_tokens=output_tokens,
            wall_s=min(walls), wall_s_all=walls, kv_stats=asdict(llm.kv_stats()),
            capacity_line=llm.cache_config.capacity_line(llm.max_model_len),
            attention_backend=llm.attention_backend, machine=machine_info(llm.device))
    print("\n".join(report_lines(result, args)))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": _args_dict(args), **result.to_dict()},
                                        indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _args_dict(args: argparse.Namespace) -> dict[str, Any]:
    """The flags, JSON-ready."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
            if k not in ("run", "command")}


def report_lines(r: BenchResult, args: argparse.Namespace) -> list[str]:
    """The human-readable result: workload, throughput, KV figures, machine."""
    kv, m = r.kv_stats, r.machine
    mode = "greedy" if r.n == 1 else f"n={r.n} samples at temperature 1"
    walls = ", ".join(f"{w:.3f}" for w in r.wall_s_all)
    gpu = f" ({m['gpu']})" if "gpu" in m else ""
    tp = args.tensor_parallel_size
    ranks = f", {tp} tensor-parallel ranks (processes)" if tp > 1 else ""
    return [
        f"model: {r.model}",
        f"workload: {r.num_prompts} prompts, lengths {args.min_prompt_len}-"
        f"{args.max_prompt_len} ({r.prompt_tokens} prompt tokens), {r.output_len} output "
        f"tokens per sample, {mode}, EOS ignored",
        f"timed runs: {walls} s (fastest {r.wall_s:.3f} s)",
        f"throughput: {r.requests_per_s:.2f} requests/s, {r.output_tokens_per_s:.1f} output "
        f"tokens/s, {r.total_tokens_per_s:.1f} total tokens/s ({r.output_tokens} output tokens)",
        f"KV: {kv['num_blocks']} blocks x {kv['block_size']} tokens, peak "
        f"{kv['peak_blocks_in_use']} in use, {kv['preemptions']} preemptions, "
        f"{kv['cow_copies']} COW copies, {kv['prefix_hit_tokens']} prefix-hit tokens",
        f"machine: torch {m['torch']}, {m['torch_threads']} threads on {m['host_cpus']} CPUs, "
        f"device {m['device']}{gpu}, attention backend {r.attention_backend}{ranks}",
    ]

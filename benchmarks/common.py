"""Shared helpers for batchgen's benchmarks (throughput, sampling, prefix cache, ...).

Everything a benchmark script needs besides the systems it measures:

* command-line flags for the random-weight model and the workload (:func:`add_model_args`,
  :func:`add_workload_args`, :func:`add_run_args`),
* writing that model folder (:func:`prepare_model_dir`) and loading it with plain
  transformers (:func:`load_hf_model`),
* seeded random token-id prompts (:func:`make_prompts`),
* timing (:func:`timed`, :func:`sync`), result rows (:class:`Result`), a markdown table
  (:func:`markdown_table`), a machine-info line (:func:`machine_info`) and JSON output
  (:func:`write_json`).

Run benchmarks from the repository root with ``PYTHONPATH=.``, e.g.
``PYTHONPATH=. python benchmarks/throughput.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# Token ids 0, 1, 2 are <pad>, <s>, </s> in batchgen's tiny models; prompts avoid them.
FIRST_REGULAR_ID = 3
PAD_ID = 0

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- command line ---------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags describing the random-weight Llama model (and where to keep its folder)."""
    g = p.add_argument_group("model (random weights, Llama family)")
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--num-heads", type=int, default=8)
    g.add_argument("--num-kv-heads", type=int, default=2)
    g.add_argument("--intermediate-size", type=int, default=688)
    g.add_argument("--vocab-size", type=int, default=4096)
    g.add_argument("--model-dir", type=Path, default=None,
                   help="existing model folder to use, or where to write the random one "
                        "(default: a temporary folder, deleted at exit)")
    g.add_argument("--dtype", default="float32", choices=sorted(DTYPES))


def add_workload_args(p: argparse.ArgumentParser, num_prompts: int = 32, min_prompt_len: int = 16,
                      max_prompt_len: int = 384, output_len: int = 64) -> None:
    """Flags of the synthetic workload: N prompts of uniform random length, fixed output length."""
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--min-prompt-len", type=int, default=min_prompt_len)
    g.add_argument("--max-prompt-len", type=int, default=max_prompt_len)
    g.add_argument("--output-len", type=int, default=output_len)
    g.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompts")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every benchmark run: device, JSON output."""
    g = p.add_argument_group("run")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--repeats", type=int, default=1,
                   help="timed runs per system after the warm-up; the fastest is reported "
                        "(use 3+ on a busy machine)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: leave torch's default)")
    g.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the results as JSON to PATH")


def check_workload_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error() on inconsistent workload flags."""
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if args.output_len < 1:
        p.error("--output-len must be >= 1")
    if getattr(args, "repeats", 1) < 1:
        p.error("--repeats must be >= 1")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.vocab_size <= FIRST_REGULAR_ID:
        p.error(f"--vocab-size must be > {FIRST_REGULAR_ID}")


# ---- model ----------------------------------------------------------------------------------
def model_overrides(args: argparse.Namespace, max_len: int) -> dict[str, Any]:
    """Config overrides for make_tiny_model from the model flags; positions cover ``max_len``."""
    if args.hidden_size % args.num_heads:
        raise ValueError("--hidden-size must be a multiple of --num-heads")
    if args.num_heads % args.num_kv_heads:
        raise ValueError("--num-heads must be a multiple of --num-kv-heads")
    return {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "intermediate_size": args.intermediate_size,
        "head_dim": args.hidden_size // args.num_heads,
        "max_position_embeddings": max(1024, max_len),
    }


@contextlib.contextmanager
def prepare_model_dir(args: argparse.Namespace, max_len: int) -> Iterator[Path]:
    """Yield a model folder: ``--model-dir`` if it already holds a config.json, else a freshly
    written random Llama (fp32 safetensors, no tokenizer) in ``--model-dir`` or a temp dir."""
    from batchgen.tools.make_tiny_model import make_tiny_model

    given = getattr(args, "model_dir", None)
    if given is not None and (Path(given) / "config.json").is_file():
        yield Path(given)
        return
    with contextlib.ExitStack() as stack:
        if given is None:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchgen-bench-")))
        else:
            out = Path(given)
        make_tiny_model(out, family="llama", vocab_size=args.vocab_size, seed=args.seed,
                        with_tokenizer=False, **model_overrides(args, max_len))
        yield out


def load_hf_model(model_dir: str | os.PathLike, dtype: torch.dtype, device: str | torch.device,
                  attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The folder's model through plain transformers, in eval mode, pad id set."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    model = model.to(device).eval()
    model.generation_config.pad_token_id = PAD_ID
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- workload -------------------------------------------------------------------------------
def make_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int,
                 seed: int = 0) -> list[list[int]]:
    """``num_prompts`` token-id prompts, lengths uniform in [min_len, max_len], ids uniform in
    [3, vocab_size) (no pad/BOS/EOS); deterministic for a given seed."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    return [[rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(n)] for n in lengths]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = PAD_ID,
             device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and the matching ``attention_mask`` (0 on padding)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def hf_generate_all(model: torch.nn.Module, prompts: list[list[int]], batch_size: int,
                    n_tokens: int, device: str, rows_per_prompt: int, **gen_kwargs: Any
                    ) -> list[list[int]]:
    """HF generate over all prompts in input order, ``batch_size`` prompts per left-padded call;
    returns the new tokens of every returned row (``rows_per_prompt`` per prompt)."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, mask = left_pad(chunk, PAD_ID, device)
        seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_tokens,
                              min_new_tokens=n_tokens, pad_token_id=PAD_ID, **gen_kwargs)
        new = seqs[:, ids.shape[1]:]
        assert new.shape == (len(chunk) * rows_per_prompt, n_tokens), (
            f"HF generate returned {tuple(new.shape)} new tokens, expected "
            f"{(len(chunk) * rows_per_prompt, n_tokens)}")
        out.extend(new.tolist())
    return out


# ---- timing and results ---------------------------------------------------------------------
def sync(device: str | torch.device) -> None:
    """Wait for queued GPU work so wall-clock timings are honest (no-op on CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], Any], device: str | torch.device = "cpu") -> tuple[Any, float]:
    """Run ``fn`` under inference mode; return its result and the wall time in seconds."""
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        return out, time.perf_counter() - t0


def timed_repeats(fn: Callable[[], Any], repeats: int = 1, device: str | torch.device = "cpu"
                  ) -> tuple[Any, list[float]]:
    """Time ``fn`` ``repeats`` times (see :func:`timed`); return the first result and all wall
    times. Report ``min`` of them: on a shared CPU, other load only ever adds time."""
    out, walls = None, []
    for i in range(max(1, repeats)):
        res, wall = timed(fn, device)
        if i == 0:
            out = res
        walls.append(wall)
    return out, walls


@dataclass
class Contender:
    """One system, loaded and warmed up, ready to run the whole workload: `run()` returns its
    tokens; `describe()` (config string, extra fields) is read after the timed runs."""

    system: str
    run: Callable[[], Any]
    describe: Callable[[], tuple[str, dict[str, Any]]]
    close: Callable[[], None] = lambda: None


def interleaved_repeats(contenders: Sequence[Contender], repeats: int,
                        device: str | torch.device = "cpu",
                        on_round: Callable[[int], None] | None = None
                        ) -> list[tuple[Any, list[float]]]:
    """Time every contender ``repeats`` times in rounds (A B C, A B C, ...) rather than all of
    A's runs first: on a shared machine whose load drifts over seconds, each system then
    samples the same quiet and busy periods, and ``min`` compares like with like. Returns, per
    contender, its first result and all its wall times."""
    out: list[tuple[Any, list[float]]] = [(None, []) for _ in contenders]
    for r in range(max(1, repeats)):
        for i, c in enumerate(contenders):
            res, wall = timed(c.run, device)
            first, walls = out[i]
            out[i] = (res if r == 0 else first, walls + [wall])
        if on_round is not None:
            on_round(r)
    return out


@dataclass
class Result:
    """One timed run of one system over the whole workload."""

    system: str
    config: str
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("inf")

    @property
    def total_tok_s(self) -> float:
        total = self.output_tokens + self.prompt_tokens
        return total / self.wall_s if self.wall_s > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["output_tok_s"] = self.output_tok_s
        d["total_tok_s"] = self.total_tok_s
        return d


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(_is_number(r[i]) for r in cells) for i in range(len(headers))]

    def line(vals: Sequence[str]) -> str:
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)]
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                         for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def _is_number(s: str) -> bool:
    try:
        float(s.rstrip("x"))
    except ValueError:
        return False
    return True


def fmt_ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x" if den > 0 else "n/a"


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What the numbers depend on: CPUs, threads, library versions, device, date."""
    import transformers

    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device": str(device),
    }
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(dev)
    try:
        import batchgen

        info["batchgen"] = batchgen.__version__
    except ImportError:  # pragma: no cover - benchmarks run with PYTHONPATH=.
        pass
    return info


def machine_line(info: dict[str, Any]) -> str:
    gpu = f", gpu {info['gpu']}" if "gpu" in info else ""
    return (f"machine: {info['host_cpus']} CPUs ({info['torch_threads']} torch threads), "
            f"{info['processor']}, torch {info['torch']}, transformers {info['transformers']}, "
            f"device {info['device']}{gpu}, {info['date']}")


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """Write ``payload`` (Paths and other odd values stringified) as indented JSON."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def args_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


# ---- small helpers for benchmark scripts ----------------------------------------------------
def parse_int_list(p: argparse.ArgumentParser, value: str, flag: str, minimum: int = 1
                   ) -> list[int]:
    """Comma-separated integers (each >= ``minimum``), or parser.error() naming ``flag``."""
    try:
        out = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        p.error(f"{flag} must be comma-separated integers, e.g. 1,2,4")
    if not out or min(out) < minimum:
        p.error(f"{flag} needs at least one value, each >= {minimum}")
    return out


def resolve_model(spec: str) -> Path:
    """A folder, or 'smollm2' / 'tiny' made (once) by batchgen.tools (the real-model
    benchmarks' --model)."""
    if spec == "smollm2":
        from batchgen.tools import smollm2

        return smollm2.smollm2_folder(smollm2.default_folder())
    if spec == "tiny":
        from batchgen.tools.demo_model import tiny_model

        return tiny_model()
    return Path(spec).expanduser()


def quiet_logging() -> None:
    """Silence transformers' warnings / progress bars, generate_batch's logger and batchgen's
    info lines, as the benchmarks do unless ``--verbose``."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    logging.getLogger("batchgen").setLevel(logging.WARNING)


def common_prefix_frac(a: Sequence[int], b: Sequence[int]) -> float:
    """Length of the common prefix of two token lists over the longer one's length."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k / max(len(a), len(b), 1)

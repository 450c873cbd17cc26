"""The benchmarks' shared harness: flags, the run's start and end (machine line, JSON), the
random-weight Llama, prompts, systems timed in interleaved rounds, checks, tables, child
processes, and last the engine internals some scripts read, one function each.

Run benchmarks from the repository root: ``PYTHONPATH=. python benchmarks/throughput.py``.
"""

import argparse
import contextlib
import datetime as _dt
import json
import logging
import math
import os
import platform
import random
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.utils import logging as hf_logging

ROOT = Path(__file__).resolve().parents[1]
FIRST_REGULAR_ID = 3  # ids 0, 1, 2 are <pad>, <s>, </s> in batchgen's tiny models
PAD_ID = 0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARMUP_PROMPTS, WARMUP_TOKENS = 2, 8  # every system's untimed warm-up run
QUESTIONS = [json.loads(line)["prompt"]  # chat prompts for trained models: the examples' 20
             for line in (ROOT / "examples" / "data" / "prompts.jsonl").read_text().splitlines()]


# ---- command line ---------------------------------------------------------------------------
def parser(doc: str, model: dict | None = None, workload: dict | None = None,
           run: dict | None = None, engine: dict | None = None, hf: dict | None = None
           ) -> argparse.ArgumentParser:
    """A parser (the docstring's first line) with the named flag groups, each a dict over its
    defaults (a workload or run default of None drops that flag)."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if model is not None:  # the random-weight Llama
        g = p.add_argument_group("model (random weights, Llama family)")
        ints = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2,
                "intermediate_size": 688, "vocab_size": 4096, **model}
        g.add_argument("--model-dir", type=Path, default=None,
                       help="existing model folder to use, or where to write the random one "
                            "(default: a temporary folder, deleted at exit)")
        g.add_argument("--dtype", default=ints.pop("dtype", "float32"), choices=sorted(DTYPES))
        add_ints(g, **ints)
    if workload is not None:  # token-id prompts of uniform random length; --seed: weights too
        w = {"num_prompts": 32, "min_prompt_len": 16, "max_prompt_len": 384, "output_len": 64,
             "seed": 0, **workload}
        add_ints(p.add_argument_group("workload"), **{k: v for k, v in w.items() if v is not None})
    if run is not None:
        g, run = p.add_argument_group("run"), {"device": "cpu", "repeats": 1, **run}
        if run["device"] is not None:
            g.add_argument("--device", default=run["device"], help="cpu, cuda or cuda:N")
        if run["repeats"] is not None:
            g.add_argument("--repeats", type=int, default=run["repeats"],
                           help="timed runs per system, in interleaved rounds; the fastest counts")
        g.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
        g.add_argument("--json", type=Path, default=None, metavar="PATH",
                       help="also write the results as JSON to PATH")
    if engine is not None:
        add_ints(p.add_argument_group("batchgen engine (generate_batch: the same limits)"), **{
            "block_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
            "num_kv_blocks": None, **engine})
    if hf is not None:  # HF generate at several batch sizes (the best counts), generate_batch
        g = p.add_argument_group("HF baselines")
        g.add_argument("--hf-batch-sizes", type=int_list, default=hf.get("batch_sizes", "8,32"),
                       help="comma-separated HF generate batch sizes (prompts)")
        g.add_argument("--skip-hf", action="store_true")
        if hf.get("generate_batch", True):
            g.add_argument("--gb-page-size", type=int, default=256,
                           help="generate_batch page size in tokens (transformers' default)")
            g.add_argument("--skip-generate-batch", action="store_true")
    return p


def add_ints(g: Any, **defaults: int | None) -> None:
    """An integer flag per keyword (``max_tokens=16``: ``--max-tokens``, default 16)."""
    for name, default in defaults.items():
        g.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                       help="(default: %(default)s)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, *positive: str
               ) -> argparse.Namespace:
    """parser.error() on inconsistent flags (``positive``: more that must be >= 1 if given)."""
    for flag in ("num_prompts", "output_len", "repeats", "threads", "block_size", "max_num_seqs",
                 "max_num_batched_tokens", "num_kv_blocks", "gb_page_size", *positive):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if hasattr(args, "min_prompt_len") and not 1 <= args.min_prompt_len <= args.max_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if hasattr(args, "vocab_size") and (args.vocab_size <= FIRST_REGULAR_ID
                                        or args.hidden_size % args.num_heads
                                        or args.num_heads % args.num_kv_heads):
        p.error(f"need --vocab-size > {FIRST_REGULAR_ID}, --hidden-size a multiple of "
                "--num-heads, and --num-heads of --num-kv-heads")
    return args


def int_list(value: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1 (e.g. 1,2,4)."""
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not comma-separated integers >= 1")
    return out


def engine_kwargs(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments from the engine, model and run flags the script has."""
    keys = ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "dtype",
            "device", "seed")
    return {**{k: getattr(args, k) for k in keys if hasattr(args, k)}, **overrides}


# ---- the run's start and end ----------------------------------------------------------------
def start(args: argparse.Namespace) -> dict[str, Any]:
    """Logging quieted, --threads, the seed; the machine's facts."""
    import batchgen

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    logging.getLogger("batchgen").setLevel(logging.WARNING)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    torch.manual_seed(getattr(args, "seed", 0))
    device = torch.device(getattr(args, "device", "cpu"))
    info = {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "device": str(device),
            "batchgen": batchgen.__version__}
    if device.type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def finish(args: argparse.Namespace, info: dict[str, Any], payload: dict[str, Any]
           ) -> dict[str, Any]:
    """Print the machine line; write ``{machine, args, **payload}`` to --json; return it."""
    gpu = f", gpu {info['gpu']}" if "gpu" in info else ""
    print(f"machine: {info['host_cpus']} CPUs ({info['torch_threads']} torch threads), "
          f"{info['processor']}, torch {info['torch']}, transformers {info['transformers']}, "
          f"device {info['device']}{gpu}, {info['date']}")
    payload = {"machine": info, "args": {k: str(v) if isinstance(v, Path) else v
                                         for k, v in vars(args).items()}, **payload}
    if getattr(args, "json", None):
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return payload


# ---- model and prompts ----------------------------------------------------------------------
@contextlib.contextmanager
def prepare_model_dir(args: argparse.Namespace, max_len: int, tokenizer: bool = False,
                      eos_boost: float = 0.0, init_device: str | None = None) -> Iterator[Path]:
    """``--model-dir`` if it holds a config.json, else a random Llama of the model flags there or
    in a temporary folder (``init_device``: built there by transformers, fast for 1B on a GPU)."""
    from batchgen.tools.make_tiny_model import make_config, make_tiny_model

    given, dtype = getattr(args, "model_dir", None), DTYPES[args.dtype]
    if given is not None and (Path(given) / "config.json").is_file():
        yield Path(given)
        return
    shape = {"hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers,
             "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads,
             "intermediate_size": args.intermediate_size,
             "head_dim": args.hidden_size // args.num_heads,
             "max_position_embeddings": max(1024, max_len)}
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmp:
        out = Path(given or tmp)
        if init_device is None:
            make_tiny_model(out, family="llama", vocab_size=args.vocab_size, seed=args.seed,
                            dtype=dtype, eos_boost=eos_boost, with_tokenizer=tokenizer, **shape)
        else:
            torch.manual_seed(args.seed)
            with torch.device(init_device):
                model = AutoModelForCausalLM.from_config(
                    make_config("llama", vocab_size=args.vocab_size, **shape), dtype=dtype)
            model.save_pretrained(out, safe_serialization=True)
            del model
        yield out


def count_params(model_dir: str | os.PathLike) -> int:
    """Parameters stored in a folder's safetensors files (read from their headers)."""
    total = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118
    return total


def model_line(args: argparse.Namespace, n_params: int | None = None) -> str:
    """The model a run measures: the --model-dir folder's (from its config) when it holds
    one, else the random Llama of the model flags."""
    size = f"{n_params / 1e6:.2f}M params, " if n_params is not None else ""
    given = getattr(args, "model_dir", None)
    if given is not None and (Path(given) / "config.json").is_file():
        cfg = json.loads((Path(given) / "config.json").read_text())
        return (f"model: {Path(given).name} ({cfg.get('model_type', '?')}), {size}hidden "
                f"{cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers, "
                f"{cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} q/kv heads, "
                f"ffn {cfg.get('intermediate_size')}, vocab {cfg.get('vocab_size')}, "
                f"{args.dtype}")
    return (f"model: random Llama, {size}hidden {args.hidden_size}, {args.num_layers} layers, "
            f"{args.num_heads}/{args.num_kv_heads} q/kv heads, ffn {args.intermediate_size}, "
            f"vocab {args.vocab_size}, {args.dtype}")


def resolve_model(spec: str) -> Path:
    """--model of the real-model benchmarks: a folder, or 'smollm2' / 'tiny' (made once)."""
    from batchgen.tools import demo_model, smollm2

    if spec in ("smollm2", "tiny"):
        return (smollm2.smollm2_folder(smollm2.default_folder()) if spec == "smollm2"
                else demo_model.tiny_model())
    if not (Path(spec).expanduser() / "config.json").is_file():
        raise SystemExit(f"error: --model {spec}: no config.json there")
    return Path(spec).expanduser()


def load_hf_model(model_dir: str | os.PathLike, dtype: torch.dtype, device: str | torch.device
                  ) -> torch.nn.Module:
    """The folder's model through plain transformers (sdpa), in eval mode, pad id set."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 attn_implementation="sdpa").to(device).eval()
    model.generation_config.pad_token_id = PAD_ID
    return model


def make_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int,
                 seed: int = 0) -> list[list[int]]:
    """Seeded token-id prompts, lengths uniform in [min_len, max_len], ids in [3, vocab)."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    return [[rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(n)] for n in lengths]


def workload_prompts(args: argparse.Namespace) -> list[list[int]]:
    return make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                        args.vocab_size, args.seed)


def workload_line(args: argparse.Namespace, prompts: Sequence[Sequence[int]], rest: str) -> str:
    n = sum(map(len, prompts))
    return (f"workload: {len(prompts)} prompts, lengths {args.min_prompt_len}-"
            f"{args.max_prompt_len} (mean {n / len(prompts):.0f}, {n} prompt tokens), {rest}")


def sentences(count: int, min_words: int, max_words: int, seed: int) -> list[str]:
    """Seeded English-like sentences of the tiny models' corpus words."""
    from batchgen.tools.make_tiny_model import CORPUS

    words, rng = sorted(set(re.findall(r"[a-z]{2,}", CORPUS.lower()))), random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(min_words, max_words))).capitalize()
            + rng.choice(".?!.") for _ in range(count)]


def chat_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text as a user message through the chat template (if any), as token ids."""
    if not tokenizer.chat_template:
        return [list(tokenizer(t)["input_ids"]) for t in texts]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False))
            for t in texts]


def token_prompts(prompts: Sequence[Sequence[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": list(p)} for p in prompts]


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def greedy(max_tokens: int, **kwargs: Any) -> Any:
    """Greedy ``SamplingParams`` producing exactly ``max_tokens`` tokens (EOS ignored)."""
    from batchgen import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# ---- systems --------------------------------------------------------------------------------
@dataclass
class Contender:
    """One system, warmed up: ``run()`` gives the whole workload's output (or a Measured)."""

    system: str
    run: Callable[[], Any]
    describe: Callable[[], tuple[str, dict[str, Any]]] = lambda: ("", {})
    close: Callable[[], None] = lambda: None


@dataclass
class Measured:
    """An output with the wall time the system measured itself (e.g. in a child process)."""

    value: Any
    wall_s: float


def warm_up(go: Callable[[list[list[int]], int], Any], prompts: list[list[int]],
            n_tokens: int) -> None:
    """One untimed ``go(prompts, tokens)`` on the first prompts, a few tokens each."""
    with torch.inference_mode():
        go(prompts[:WARMUP_PROMPTS], min(n_tokens, WARMUP_TOKENS))


def bg_tokens(llm: Any, prompts: Sequence[Sequence[int]], params: Any) -> list[list[int]]:
    """``llm.generate`` on token-id prompts: every sample's tokens, n per prompt, in order."""
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    return [list(c.token_ids) for o in outs for c in o.outputs]


def batchgen_contender(llm: Any, prompts: list[list[int]], params: Callable[[int], Any],
                       n_tokens: int, describe: Callable[[], tuple[str, dict[str, Any]]]
                       | None = None, system: str = "batchgen") -> Contender:
    """``llm.generate`` with ``params(max_tokens)``, warmed up; output: token rows, n per prompt."""
    def go(ps: list[list[int]], k: int) -> list[list[int]]:
        return bg_tokens(llm, ps, params(k))

    warm_up(go, prompts, n_tokens)
    return Contender(system, lambda: go(prompts, n_tokens),
                     describe or (lambda: kv_describe(llm)))


def fresh_contender(system: str, model_dir: Path, llm_kwargs: dict[str, Any],
                    go: Callable[[Any], Any], config: str) -> Contender:
    """A fresh ``LLM`` per run (empty prefix cache; start-up timed); output: ``go(llm)``."""
    from batchgen import LLM

    last: list[Any] = []

    def run() -> Any:
        last[:] = [LLM(str(model_dir), **llm_kwargs)]
        return go(last[0])

    return Contender(system, run, lambda: (config, kv_describe(last[0])[1]))


def kv_describe(llm: Any) -> tuple[str, dict[str, Any]]:
    """batchgen's config string and extra fields: the KV figures of its last call."""
    st = llm.kv_stats()
    return (f"block {st.block_size}, peak {st.peak_blocks_in_use}/{st.num_blocks} blocks, "
            f"{st.preemptions} preempt"), {
        **asdict(st), "peak_tokens": st.peak_blocks_in_use * st.block_size, **engine_facts(llm)}


def hf_generate_all(model: torch.nn.Module, prompts: list[list[int]], batch_size: int,
                    n_tokens: int, device: str, rows_per_prompt: int = 1, **gen_kwargs: Any
                    ) -> list[list[int]]:
    """HF generate in left-padded batches; every row's ``n_tokens`` new tokens (asserted)."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[start:start + batch_size], device)
        new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_tokens,
                             min_new_tokens=n_tokens, pad_token_id=PAD_ID,
                             **gen_kwargs)[:, ids.shape[1]:]
        want = (len(ids) * rows_per_prompt, n_tokens)
        assert new.shape == want, f"HF generate: {tuple(new.shape)} new tokens, not {want}"
        out.extend(new.tolist())
    return out


def left_pad(prompts: Sequence[Sequence[int]], device: str | torch.device = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and the matching ``attention_mask`` (0 on padding)."""
    width = max(map(len, prompts))
    ids = [[PAD_ID] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def hf_contenders(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace,
                  n_tokens: int, label: str = "", rows_per_prompt: int = 1, width: int = 1,
                  **gen_kwargs: Any) -> list[Contender]:
    """HF generate at each of --hf-batch-sizes, warmed up, seeded; ``width`` rows per prompt."""
    def go(ps: list[list[int]], k: int, bs: int) -> list[list[int]]:
        torch.manual_seed(args.seed)
        return hf_generate_all(model, ps, bs, k, args.device, rows_per_prompt, **gen_kwargs)

    def describe(bs: int) -> tuple[str, dict[str, Any]]:
        rows = f" ({bs * width} rows)" if width > 1 else ""
        return f"{label + ', ' if label else ''}sdpa, batch {bs}{rows}, left-padded", {
            "batch_size": bs}

    warm_up(lambda ps, k: go(ps, k, WARMUP_PROMPTS), prompts, n_tokens)
    return [Contender("HF generate", lambda bs=bs: go(prompts, n_tokens, bs),
                      lambda bs=bs: describe(bs)) for bs in args.hf_batch_sizes]


def generate_batch_contender(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace,
                             n_tokens: int, n: int = 1, **gen_kwargs: Any) -> Contender:
    """transformers' ``generate_batch``, warmed up: EOS off (no ``min_new_tokens`` in its CB),
    a cache for every row at once (its default takes 60% of RAM on CPU), batchgen's limits;
    ``n`` > 1: ``num_return_sequences``, native (prefill once, fork)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf_model(model_dir, DTYPES[args.dtype], args.device)
    page = args.gb_page_size
    cb = ContinuousBatchingConfig(
        page_size=page, max_batch_tokens=args.max_num_batched_tokens,
        num_blocks=sum(n * (math.ceil((len(p) + n_tokens) / page) + 1) for p in prompts),
        max_requests_per_batch=args.max_num_seqs, seed=args.seed)
    gen_config = GenerationConfig(max_new_tokens=n_tokens, eos_token_id=None,
                                  pad_token_id=PAD_ID, num_return_sequences=n, **gen_kwargs)

    def go(ps: list[list[int]], k: int) -> list[list[int]]:
        results = model.generate_batch(inputs=ps, generation_config=gen_config,
                                       continuous_batching_config=cb, max_new_tokens=k,
                                       persistent_manager=True)
        assert len(results) == len(ps) * n, f"generate_batch: {len(results)} of {len(ps)} x {n}"
        bad = [rid for rid, r in results.items() if r.error is not None]
        assert not bad, f"generate_batch failed requests {bad}"
        return [list(r.generated_tokens) for r in results.values()]

    fork = f", num_return_sequences={n} (native fork)" if n > 1 else ""
    config = f"sdpa, page {page}, {cb.num_blocks} blocks, {cb.max_batch_tokens} batch tok{fork}"
    warm_up(go, prompts, n_tokens)
    return Contender("HF generate_batch", lambda: go(prompts, n_tokens),
                     lambda: (config, {"page_size": page, "num_blocks": cb.num_blocks}),
                     close=model.destroy_cached_continuous_batching_manager)


# ---- timing ---------------------------------------------------------------------------------
def sync(device: str | torch.device) -> None:
    """Wait for queued GPU work so wall-clock timings are honest (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))


def timed(fn: Callable[[], Any], device: str | torch.device = "cpu") -> tuple[Any, float]:
    """``fn()`` under inference mode, the device synchronised around it; result, seconds."""
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        return out, time.perf_counter() - t0


def interleaved_repeats(contenders: Sequence[Contender], repeats: int,
                        device: str | torch.device = "cpu") -> list[tuple[Any, list[float]]]:
    """Every contender ``repeats`` times in rounds (A B C, A B C...): on a machine whose load
    drifts, each samples the same spells. Per contender: first result, all wall times."""
    out: list[tuple[Any, list[float]]] = [(None, []) for _ in contenders]
    for r in range(max(1, repeats)):
        for i, c in enumerate(contenders):
            res, wall = timed(c.run, device)
            if isinstance(res, Measured):
                res, wall = res.value, res.wall_s
            out[i] = (res if r == 0 else out[i][0], out[i][1] + [wall])
    return out


def run_contenders(contenders: Sequence[Contender], args: argparse.Namespace,
                   prompt_tokens: int, count: Callable[[Any], int] | None = None,
                   expect: tuple[int, int] | None = None) -> list[tuple["Result", Any]]:
    """Interleaved rounds, contenders closed; per contender its Result (fastest run) and first
    output (token rows; ``expect``: their count and length, asserted)."""
    try:
        timings = interleaved_repeats(contenders, args.repeats, getattr(args, "device", "cpu"))
    finally:
        for c in contenders:
            c.close()
    out = []
    for c, (value, walls) in zip(contenders, timings):
        config, extra = c.describe()
        if expect is not None:
            check_lengths(f"{c.system} ({config})", value, *expect)
        tokens = count(value) if count else sum(map(len, value))
        out.append((Result(c.system, config, min(walls), tokens, prompt_tokens,
                           {**extra, "wall_s_all": walls}), value))
        print(f"  {c.system}" + (f" ({config})" if config else "") + ": "
              + ", ".join(f"{w:.2f}" for w in walls) + " s", flush=True)
    return out


# ---- checks, results, tables ----------------------------------------------------------------
def check_lengths(name: str, rows: Sequence[Sequence[int]], count: int,
                  n_tokens: int | Sequence[int]) -> None:
    """Assert ``count`` token rows of ``n_tokens`` tokens each (or row by row)."""
    want = [n_tokens] * count if isinstance(n_tokens, int) else list(n_tokens)
    got = [len(r) for r in rows]
    assert got == want, (f"{name}: {len(got)} rows of {sorted(set(got))} tokens, expected "
                         f"{count} of {sorted(set(want))}")


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Identical rows and the mean common-prefix fraction (of the longer row) of two runs."""
    def prefix(x: Sequence[int], y: Sequence[int]) -> float:
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        return k / max(len(x), len(y), 1)

    fracs = [prefix(x, y) for x, y in zip(a, b)]
    return {"identical": sum(list(x) == list(y) for x, y in zip(a, b)), "of": len(a),
            "mean_prefix_frac": sum(fracs) / max(len(fracs), 1)}


def agreement_line(a: str, b: str, agree: dict[str, Any]) -> str:
    return (f"greedy agreement {a} vs {b}: {agree['identical']}/{agree['of']} identical, mean "
            f"common prefix {100 * agree['mean_prefix_frac']:.1f}%")


@dataclass
class Result:
    """One system's fastest run over the whole workload."""

    system: str
    config: str
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        total = self.output_tokens + self.prompt_tokens
        return {**asdict(self), "output_tok_s": self.output_tok_s,
                "total_tok_s": total / self.wall_s if self.wall_s > 0 else float("inf")}


def versus(results: Sequence[Result]) -> tuple[list[str], dict[str, Any], str]:
    """batchgen (first) against the HF baselines: labels (the best HF batch size marked), the
    summary and its line (batchgen's tok/s over the best HF generate's and generate_batch's)."""
    bg, parts = results[0], []
    hf = [r for r in results if r.system == "HF generate"]
    best = max(hf, key=lambda r: r.output_tok_s) if hf else None
    gb = next((r for r in results if r.system == "HF generate_batch"), None)
    summary: dict[str, Any] = {"batchgen_output_tok_s": bg.output_tok_s}
    if best is not None:
        summary.update(batchgen_over_hf_generate=bg.output_tok_s / best.output_tok_s,
                       hf_generate_best_batch_size=best.extra["batch_size"],
                       hf_generate_output_tok_s=best.output_tok_s)
        parts.append(f"batchgen / HF generate (best, batch {best.extra['batch_size']}): "
                     f"{summary['batchgen_over_hf_generate']:.2f}x")
    if gb is not None:
        summary.update(batchgen_over_generate_batch=bg.output_tok_s / gb.output_tok_s,
                       generate_batch_output_tok_s=gb.output_tok_s)
        parts.append(f"batchgen / HF generate_batch: "
                     f"{summary['batchgen_over_generate_batch']:.2f}x")
    labels = [r.system + (" (best)" if r is best and len(hf) > 1 else "") for r in results]
    return labels, summary, ", ".join(parts)


def wall_head(repeats: int) -> str:
    return "wall s" if repeats == 1 else f"wall s (best of {repeats})"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table, numeric columns right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(re.fullmatch(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?[x%]?", r[i])
                                   for r in cells) for i in range(len(headers))]

    def line(vals: Sequence[str]) -> str:
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)]
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                         for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print("\n" + markdown_table(headers, rows), flush=True)


def fmt_ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x" if den > 0 else "n/a"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# ---- child processes ------------------------------------------------------------------------
def child_env(**extra: str) -> dict[str, str]:
    """A child's environment: offline, the repository importable, ``extra`` on top."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **extra}


class Child:
    """A child process timed launch to exit and reaped by ``os.wait4`` (peak RSS, CPU time)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path | None,
                 stdin: Any = subprocess.DEVNULL, stdout: Any = None,
                 own_group: bool = False) -> None:
        self.argv, self.log, self.own_group = argv, log, own_group
        self._log = open(log, "wb") if log is not None else None  # noqa: SIM115
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=stdin,
                                     stdout=stdout or self._log, stderr=self._log,
                                     start_new_session=own_group)
        self.wall_s: float | None = None
        self.maxrss_kib = self.cpu_s = None  # KiB; user + system seconds

    def poll(self, block: bool = False) -> bool:
        """Whether the child has exited (reaped if so: its wall time, peak RSS, CPU time)."""
        if self.wall_s is None:
            pid, status, usage = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
            if pid:
                self.wall_s = time.perf_counter() - self.t0
                self.maxrss_kib, self.cpu_s = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                if self._log is not None:
                    self._log.close()
        return self.wall_s is not None

    def wait(self, timeout: float) -> int:
        """Its exit status, once exited; killed after ``timeout`` seconds."""
        timer = threading.Timer(timeout, self.kill)
        timer.start()
        try:
            self.poll(block=True)
        finally:
            timer.cancel()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL unless reaped (not Popen.kill, whose poll() would reap behind os.wait4)."""
        if self.wall_s is None:
            with contextlib.suppress(ProcessLookupError):
                (os.killpg if self.own_group else os.kill)(self.proc.pid, signal.SIGKILL)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.is_file() else ""

    def log_tail(self, lines: int = 15) -> str:
        """The log's first error line and last lines, for error messages."""
        text = self.output.splitlines()
        cause = next((ln for ln in text if ln.split(" ", 1)[0].endswith(
            ("Error:", "Exception:"))), None)
        first = f"; first error: {cause.strip()}" if cause else ""
        return f"{first}; last lines of {self.log}:\n  " + "\n  ".join(text[-lines:])

    def check(self, timeout: float) -> str:
        """Its output once it exited with 0 (killed after ``timeout``), else RuntimeError."""
        if self.wait(timeout) != 0:
            raise RuntimeError(f"{' '.join(self.argv)} exited with {self.proc.returncode}"
                               f"{self.log_tail(40)}")
        return self.output


# ---- engine internals: the only reads past batchgen's public API, one function each ---------
def engine_facts(llm: Any) -> dict[str, Any]:
    """Attention backend, per-step token budget, EOS ids, whether decode runs CUDA graphs."""
    return {"attention_backend": llm.attention_backend,
            "max_num_batched_tokens": llm.max_num_batched_tokens,
            "eos_token_ids": list(llm.eos_token_ids),
            "cuda_graphs": getattr(engine_runner(llm), "graphs", None) is not None}


def engine_runner(llm: Any) -> Any:  # its execute(rows) runs one step's forward
    return llm.engine.runner


def step_is_decode(rows: Any) -> bool:  # execute's rows: one new token each
    return len(rows.token_ids) == rows.num_rows


def engine_model(llm: Any) -> torch.nn.Module:  # the transformers module batchgen runs
    return llm.model


def kv_bytes_per_token(llm: Any) -> int:  # all layers, K and V
    return llm.cache_config.bytes_per_token


def request_peak_blocks(prompt_len: int, width: int, max_tokens: int, block_size: int) -> int:
    """The admission bound: blocks one request of ``width`` rows may peak at."""
    from batchgen.engine.kv_manager import request_peak_blocks as bound

    return bound(prompt_len, width, max_tokens, block_size)


def grammar_timers(llm: Any) -> tuple[float, int]:
    """Structured outputs: seconds spent filling and applying token bitmasks, and steps."""
    return llm.requests.grammars.mask_seconds, llm.requests.grammars.mask_steps


def tp_group_class() -> Any:
    """The tensor-parallel group; its ``send`` broadcasts each step to the workers."""
    from batchgen.distributed.group import TPGroup

    return TPGroup

"""Tensor parallelism: the same greedy workload through ``LLM(tensor_parallel_size=k)`` for each
``--tp`` size, with the communication of a step measured on rank 0.

Every size runs the same random-weight Llama and random token-id prompts (greedy, EOS ignored,
every prompt generates ``--output-len`` tokens, asserted). All sizes are loaded and warmed up
first, then timed in ``--repeats`` interleaved rounds (TP=1, TP=2; again; ...), the fastest run
of each counting; then each size k > 1 runs once more with rank 0's communication calls
wrapped and timed:

* control: ``TPGroup.send``, the broadcast that carries each step's block copies and rows to
  the workers (pickled, over the gloo control group); bytes are the pickle's size;
* all-reduce: ``torch.distributed.all_reduce``, what transformers' rowwise layers (``o_proj``,
  ``down_proj``: two per decoder layer) call on their partial outputs under inference mode
  (``transformers/distributed/tensor_parallel.py``, ``RowwiseParallel``);
* DTensor: the functional collectives DTensor issues for the vocab-sharded embedding (an
  all-reduce) and the ``lm_head`` (an all-gather to the full vocabulary): time in
  ``all_reduce`` / ``all_gather_single`` and in ``wait_tensor``; bytes of the reduced or
  gathered tensors.

Per step, over all steps and over decode steps alone (every row one new token): calls, KiB and
milliseconds of each, against the step's forward (``runner.execute``, communication included)
timed in the same run. On CPU (gloo) a collective's time on rank 0 includes waiting for the
other ranks to reach it, so it is an upper bound on the transfer. On CUDA each wrapped call is
bracketed by ``torch.cuda.synchronize()`` so the time is the collective's kernel (NCCL runs
asynchronously otherwise); that run is slower than the timed ones, which are not
instrumented. The calls and bytes per step do not depend on the device: with a link's latency
and bandwidth they give a GPU estimate.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/tensor_parallel.py
    PYTHONPATH=. python benchmarks/tensor_parallel.py --tp 1,2 --num-prompts 8 --json tp.json
    PYTHONPATH=. python benchmarks/tensor_parallel.py --device cuda --tp 1,2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed import _functional_collectives as funcol  # noqa: E402

from benchmarks.common import (  # noqa: E402
    DTYPES,
    Contender,
    Result,
    add_model_args,
    add_run_args,
    add_workload_args,
    args_dict,
    check_workload_args,
    fmt_ratio,
    interleaved_repeats,
    machine_info,
    machine_line,
    make_prompts,
    markdown_table,
    model_overrides,
    parse_int_list,
    quiet_logging,
    timed,
    write_json,
)

WARMUP_PROMPTS = 2
WARMUP_TOKENS = 8
KINDS = ("control", "all_reduce", "dtensor")
KIND_NAMES = {"control": "control broadcast (TPGroup.send)",
              "all_reduce": "all-reduce (rowwise o_proj, down_proj)",
              "dtensor": "DTensor collectives (embedding, lm_head)",
              "total": "communication, total",
              "execute": "step forward (execute), comm included"}
PHASES = ("all", "decode")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p)
    add_workload_args(p)
    add_run_args(p)
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tp", default="1,2",
                   help="comma-separated tensor_parallel_size values, timed in interleaved "
                        "rounds (at most one > 1)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool blocks per rank (default: batchgen's own sizing on CPU, "
                        "--kv-cache-gib on CUDA)")
    g.add_argument("--kv-cache-gib", type=float, default=4.0,
                   help="KV pool GiB per rank on CUDA, where batchgen would otherwise size it "
                        "from free memory (the TP=1 and TP=2 LLMs share GPU 0)")
    g.add_argument("--verbose", action="store_true", help="keep transformers/batchgen logging")
    args = p.parse_args(argv)
    check_workload_args(p, args)
    args.tp = parse_int_list(p, args.tp, "--tp")
    if sum(k > 1 for k in args.tp) > 1 or len(set(args.tp)) < len(args.tp):
        p.error("--tp takes distinct sizes, at most one of them > 1 (a process holds one "
                "tensor-parallel group at a time)")
    for k in args.tp:
        if args.num_heads % k or args.num_kv_heads % k:
            p.error(f"--tp {k} must divide --num-heads ({args.num_heads}) and --num-kv-heads "
                    f"({args.num_kv_heads})")
    return args


# ---- measuring rank 0's communication -------------------------------------------------------
@dataclass
class Tally:
    """Calls, bytes and seconds of one kind of communication."""

    calls: int = 0
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class CommMeter:
    """Counts steps (``runner.execute`` calls) and, when ``timing``, times each step's
    ``execute`` and rank 0's communication calls inside it, over all steps and over decode
    steps (every row one new token) alone (see the module docstring)."""

    device: torch.device
    timing: bool = False
    steps: int = 0
    in_step: bool = False
    decoding: bool = False
    tallies: dict[str, dict[str, Tally]] = field(default_factory=lambda: {
        phase: {k: Tally() for k in (*KINDS, "execute")} for phase in PHASES})

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
        """``fn``'s result and seconds, the device synchronized before and after."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out, time.perf_counter() - t0

    def add(self, kind: str, seconds: float, calls: int, nbytes: int) -> None:
        for phase in PHASES if self.decoding else PHASES[:1]:
            tally = self.tallies[phase][kind]
            tally.seconds += seconds
            tally.calls += calls
            tally.nbytes += nbytes

    def wrap(self, kind: str, fn: Callable[..., Any], size: Callable[..., int] | None
             ) -> Callable[..., Any]:
        """``fn`` timed into ``kind`` while inside a step; ``size(*args)`` gives its bytes (None:
        time only, as for ``wait_tensor``, whose collective was counted when issued)."""
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            if not (self.timing and self.in_step):
                return fn(*args, **kwargs)
            out, seconds = self.call(fn, *args, **kwargs)
            self.add(kind, seconds, int(size is not None), size(*args, **kwargs) if size else 0)
            return out
        return timed_call

    def count_steps(self, execute: Callable[..., Any]) -> Callable[..., Any]:
        """``execute`` counting the steps (timed when ``timing``), marking when one runs."""
        def step(rows: Any) -> Any:
            self.steps += 1
            self.in_step, self.decoding = True, len(rows.token_ids) == rows.num_rows
            try:
                if not self.timing:
                    return execute(rows)
                out, seconds = self.call(execute, rows)
                self.add("execute", seconds, 1, 0)
                return out
            finally:
                self.in_step = False
        return step


def _nbytes(t: Any, *_: Any, **__: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


@contextlib.contextmanager
def metered(llm: Any, meter: CommMeter, tp: int) -> Iterator[CommMeter]:
    """``meter`` counting ``llm``'s steps and, for tp > 1, wrapping the communication calls of
    this process (rank 0); everything is put back afterwards."""
    from batchgen.distributed.group import TPGroup

    runner = llm.engine.runner
    patches = [(runner, "execute", meter.count_steps(runner.execute))]
    if tp > 1:
        patches += [
            (TPGroup, "send", meter.wrap("control", TPGroup.send,
                                         lambda _group, msg: len(pickle.dumps(msg)))),
            (dist, "all_reduce", meter.wrap("all_reduce", dist.all_reduce, _nbytes)),
            (funcol, "all_reduce", meter.wrap("dtensor", funcol.all_reduce, _nbytes)),
            (funcol, "all_gather_single", meter.wrap(
                "dtensor", funcol.all_gather_single, lambda t, *a, **kw: tp * _nbytes(t))),
            (funcol, "wait_tensor", meter.wrap("dtensor", funcol.wait_tensor, None))]
    saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)
    try:
        yield meter
    finally:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)  # an instance's own attribute: the class's shows again
            else:
                setattr(obj, name, old)


# ---- one tensor-parallel size ---------------------------------------------------------------
@dataclass
class SizeRun:
    """One tensor_parallel_size: its timed runs, steps, tokens and (k > 1) communication."""

    tp: int
    walls: list[float]
    steps: int
    tokens: list[list[int]]
    comm: dict[str, dict[str, Tally]] | None = None  # phase -> kind -> tally
    comm_wall_s: float = 0.0  # the instrumented run's own wall time

    def ms_per_step(self) -> float:
        return 1000 * min(self.walls) / max(self.steps, 1)


@contextlib.contextmanager
def model_dir(args: argparse.Namespace, max_len: int) -> Iterator[Path]:
    """The random Llama written in ``--dtype`` (a 1B-shaped one stays small on disk in bf16),
    or ``--model-dir`` when it already holds a model."""
    import tempfile

    from batchgen.tools.make_tiny_model import make_tiny_model

    if args.model_dir is not None and (args.model_dir / "config.json").is_file():
        yield args.model_dir
        return
    with tempfile.TemporaryDirectory(prefix="batchgen-tp-") as tmp:
        out = args.model_dir or Path(tmp)
        make_tiny_model(out, family="llama", vocab_size=args.vocab_size, seed=args.seed,
                        dtype=DTYPES[args.dtype], with_tokenizer=False,
                        **model_overrides(args, max_len))
        yield out


def load_size(path: Path, tp: int, prompts: list[list[int]], args: argparse.Namespace,
              stack: contextlib.ExitStack) -> tuple[Contender, CommMeter]:
    """``LLM(tensor_parallel_size=tp)``, warmed up and metered until ``stack`` closes."""
    from batchgen import LLM

    gpu_pool = args.num_kv_blocks is None and torch.device(args.device).type == "cuda"
    llm = LLM(str(path), tensor_parallel_size=tp, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_kv_blocks=args.num_kv_blocks, dtype=args.dtype, device=args.device,
              kv_cache_memory=int(args.kv_cache_gib * 2**30) if gpu_pool else None,
              seed=args.seed, enable_prefix_caching=False)  # repeats reuse the prompts
    go = _generator(llm, prompts)
    with torch.inference_mode():
        go(WARMUP_PROMPTS, min(args.output_len, WARMUP_TOKENS))
    meter = stack.enter_context(metered(llm, CommMeter(llm.device), tp))

    def run() -> list[list[int]]:
        meter.steps = 0  # the steps of the last run
        return go(len(prompts), args.output_len)
    return Contender(f"TP={tp}", run, lambda: (f"tensor_parallel_size={tp}", {})), meter


def run_sizes(path: Path, prompts: list[list[int]], args: argparse.Namespace) -> list[SizeRun]:
    """Every size loaded, then timed in interleaved rounds (TP=1, TP=2; again; ...), then one
    instrumented run per size > 1. The LLMs are gone when this returns."""
    with contextlib.ExitStack() as stack:
        loaded = [load_size(path, tp, prompts, args, stack) for tp in args.tp]
        timings = interleaved_repeats(
            [c for c, _ in loaded], args.repeats, args.device,
            on_round=lambda r: print(f"  round {r + 1}/{args.repeats} done", flush=True))
        runs = [SizeRun(tp, walls, meter.steps, tokens)
                for tp, (_, meter), (tokens, walls) in zip(args.tp, loaded, timings)]
        for run, pair in zip(runs, loaded):
            if run.tp > 1:
                time_comm(run, *pair, args.device)
        del loaded, timings, pair
    gc.collect()  # the LLMs' finalizers stop their workers and leave the process group
    if dist.is_initialized():
        raise RuntimeError("the process group outlived its LLM")
    return runs


def time_comm(run: SizeRun, contender: Contender, meter: CommMeter, device: str) -> None:
    """One more run of the workload with rank 0's communication calls timed into ``run``."""
    meter.timing = True
    _, run.comm_wall_s = timed(contender.run, device)
    run.comm = meter.tallies


def _generator(llm: Any, prompts: list[list[int]]) -> Callable[[int, int], list[list[int]]]:
    """Greedy generation of the first ``count`` prompts, ``tokens`` each; returns the tokens."""
    from batchgen import SamplingParams

    def go(count: int, tokens: int) -> list[list[int]]:
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:count]], sp,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return go


# ---- report ---------------------------------------------------------------------------------
def comm_table(run: SizeRun) -> str:
    """Rank 0's communication per step (all steps; decode steps alone) of the instrumented run,
    against the step's ``execute`` (the forward, communication included)."""
    assert run.comm is not None
    rows = []
    for kind in (*KINDS, "total", "execute"):
        cells = [KIND_NAMES[kind]]
        for phase in PHASES:
            tallies = run.comm[phase]
            steps = max(tallies["execute"].calls, 1)
            t = (Tally(*(sum(getattr(tallies[k], f) for k in KINDS)
                         for f in ("calls", "nbytes", "seconds"))) if kind == "total"
                 else tallies[kind])
            calls = "-" if kind == "execute" else f"{t.calls / steps:.1f}"
            kib = "-" if kind == "execute" else f"{t.nbytes / steps / 1024:.1f}"
            cells += [calls, kib, f"{1000 * t.seconds / steps:.2f}"]
        rows.append(cells)
    return markdown_table(["per step", "calls", "KiB", "ms", "decode: calls", "KiB", "ms"], rows)


def comm_share(run: SizeRun, phase: str) -> float:
    """Communication seconds over ``execute`` seconds in ``phase``."""
    assert run.comm is not None
    tallies = run.comm[phase]
    return sum(tallies[k].seconds for k in KINDS) / max(tallies["execute"].seconds, 1e-12)


def report(runs: list[SizeRun], n_prompt: int, args: argparse.Namespace) -> list[Result]:
    """Print the tables and the greedy agreement with the first size; returns the results."""
    results, rows = [], []
    base = runs[0]
    for r in runs:
        comm = None if r.comm is None else {
            phase: {k: asdict(t) for k, t in tallies.items()} for phase, tallies in r.comm.items()}
        res = Result(f"batchgen tp={r.tp}", f"tensor_parallel_size={r.tp}", min(r.walls),
                     sum(map(len, r.tokens)), n_prompt,
                     {"wall_s_all": r.walls, "steps": r.steps, "ms_per_step": r.ms_per_step(),
                      "comm_run": comm, "comm_run_wall_s": r.comm_wall_s})
        results.append(res)
        rows.append([str(r.tp), f"{res.wall_s:.2f}", f"{res.output_tok_s:.1f}",
                     fmt_ratio(min(base.walls), res.wall_s), str(r.steps),
                     f"{r.ms_per_step():.2f}"])
    wall_head = "wall s" if args.repeats == 1 else f"wall s (best of {args.repeats})"
    print()
    print(markdown_table(["TP", wall_head, "output tok/s", f"speed vs TP={base.tp}", "steps",
                          "ms/step"], rows))
    for r in runs:
        if r.comm is not None:
            steps = r.comm["all"]["execute"].calls
            print(f"\nrank 0's communication, TP={r.tp} (instrumented run: {r.comm_wall_s:.2f} s, "
                  f"{steps} steps, {r.comm['decode']['execute'].calls} of them decode):\n")
            print(comm_table(r))
            print(f"\ncommunication share of the step forward: {100 * comm_share(r, 'all'):.0f}% "
                  f"(decode steps: {100 * comm_share(r, 'decode'):.0f}%)")
    print()
    for r in runs[1:]:
        same = sum(a == b for a, b in zip(base.tokens, r.tokens))
        print(f"greedy agreement TP={r.tp} vs TP={base.tp}: {same}/{len(r.tokens)} identical")
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.verbose:
        quiet_logging()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                           args.vocab_size, args.seed)
    n_prompt, expected = sum(map(len, prompts)), len(prompts) * args.output_len
    info = machine_info(args.device)
    print(f"model: random Llama, hidden {args.hidden_size}, {args.num_layers} layers, "
          f"{args.num_heads}/{args.num_kv_heads} q/kv heads, ffn {args.intermediate_size}, "
          f"vocab {args.vocab_size}, {args.dtype}")
    print(f"workload: {len(prompts)} prompts, lengths {args.min_prompt_len}-"
          f"{args.max_prompt_len} ({n_prompt} prompt tokens), {args.output_len} output tokens "
          f"each, greedy, EOS ignored; tensor_parallel_size {', '.join(map(str, args.tp))}",
          flush=True)
    with model_dir(args, args.max_prompt_len + args.output_len) as path:
        runs = run_sizes(path, prompts, args)
    for r in runs:
        print(f"  TP={r.tp}: " + ", ".join(f"{w:.2f}" for w in r.walls) + " s")
    for r in runs:
        got = sum(map(len, r.tokens))
        assert got == expected, f"TP={r.tp} produced {got} output tokens, expected {expected}"
    results = report(runs, n_prompt, args)
    print(machine_line(info))
    print("note: ms/step is the timed runs' wall time over their steps; the communication "
          "tables come from one extra instrumented run per TP > 1 (rank 0's calls; on CPU they "
          "include waiting for the other ranks).")
    payload = {"machine": info, "args": args_dict(args), "prompt_tokens": n_prompt,
               "expected_output_tokens": expected, "results": [r.to_dict() for r in results]}
    if args.json is not None:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()

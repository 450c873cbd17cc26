"""Tensor parallelism: the same greedy workload through ``LLM(tensor_parallel_size=k)`` for each
``--tp`` size, with the communication of a step measured on rank 0.

Every size runs the same random Llama and token-id prompts (greedy, EOS ignored, counts
asserted), loaded and warmed up, then timed in ``--repeats`` interleaved rounds (fastest run
kept). Each size k > 1 then runs once more with rank 0's communication wrapped and timed, per
step over all steps and over decode steps (calls, KiB, ms), against the step's forward (the
runner's ``execute``, communication included): the control broadcast ``TPGroup.send`` (pickled
rows and block copies over gloo; bytes: the pickle's), ``torch.distributed.all_reduce`` (the
rowwise ``o_proj`` / ``down_proj``: two per layer) and DTensor's functional collectives (the
vocab-sharded embedding's all-reduce, ``lm_head``'s all-gather; ``wait_tensor`` time). On CPU a
collective's time on rank 0 includes waiting for the other ranks (an upper bound); on CUDA each
wrapped call is synchronised (so that run is slower than the timed ones). Calls and bytes per
step do not depend on the device: with a link's latency and bandwidth they give a GPU estimate.

    PYTHONPATH=. python benchmarks/tensor_parallel.py --repeats 3
    PYTHONPATH=. python benchmarks/tensor_parallel.py --device cuda --tp 1,2 --dtype bfloat16
"""

from __future__ import annotations

import contextlib
import gc
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed import _functional_collectives as funcol  # noqa: E402

from benchmarks import common as h  # noqa: E402

KINDS = ("control", "all_reduce", "dtensor")
KIND_NAMES = {"control": "control broadcast (TPGroup.send)",
              "all_reduce": "all-reduce (rowwise o_proj, down_proj)",
              "dtensor": "DTensor collectives (embedding, lm_head)",
              "total": "communication, total",
              "execute": "step forward (execute), comm included"}
PHASES = ("all", "decode")


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = h.parser(__doc__)
    h.add_model_args(p)
    h.add_workload_args(p)
    h.add_run_args(p, verbose=True)
    h.add_engine_args(p, num_kv_blocks_help="KV pool blocks per rank (default: batchgen's own "
                                            "sizing on CPU, --kv-cache-gib on CUDA)")
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--tp", default="1,2",
                   help="comma-separated tensor_parallel_size values, timed in interleaved "
                        "rounds (at most one > 1)")
    g.add_argument("--kv-cache-gib", type=float, default=4.0,
                   help="KV pool GiB per rank on CUDA, where batchgen would otherwise size it "
                        "from free memory (the TP=1 and TP=2 LLMs share GPU 0)")
    args = h.check_args(p, p.parse_args(argv))
    args.tp = h.parse_int_list(p, args.tp, "--tp")
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
    """Counts steps (``execute`` calls) and, when ``timing``, times each step's ``execute`` and
    rank 0's communication calls inside it, over all steps and over decode steps alone."""

    device: torch.device
    timing: bool = False
    steps: int = 0
    in_step: bool = False
    decoding: bool = False
    tallies: dict[str, dict[str, Tally]] = field(default_factory=lambda: {
        phase: {k: Tally() for k in (*KINDS, "execute")} for phase in PHASES})

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
            out, seconds = h.timed(lambda: fn(*args, **kwargs), self.device)
            self.add(kind, seconds, int(size is not None), size(*args, **kwargs) if size else 0)
            return out
        return timed_call

    def count_steps(self, execute: Callable[..., Any]) -> Callable[..., Any]:
        """``execute`` counting the steps (timed when ``timing``), marking when one runs."""
        def step(rows: Any) -> Any:
            self.steps += 1
            self.in_step, self.decoding = True, h.step_is_decode(rows)
            try:
                if not self.timing:
                    return execute(rows)
                out, seconds = h.timed(lambda: execute(rows), self.device)
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
    runner, group = h.engine_runner(llm), h.tp_group_class()
    patches = [(runner, "execute", meter.count_steps(runner.execute))]
    if tp > 1:
        patches += [
            (group, "send", meter.wrap("control", group.send,
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


# ---- the sizes ------------------------------------------------------------------------------
def load_size(path: Path, tp: int, prompts: list[list[int]], args: Any,
              stack: contextlib.ExitStack) -> tuple[h.Contender, CommMeter]:
    """``LLM(tensor_parallel_size=tp)``, warmed up, then metered until ``stack`` closes."""
    from batchgen import LLM, SamplingParams

    gpu_pool = args.num_kv_blocks is None and torch.device(args.device).type == "cuda"
    llm = LLM(str(path), **h.engine_kwargs(
        args, tensor_parallel_size=tp, enable_prefix_caching=False,  # repeats reuse prompts
        kv_cache_memory=int(args.kv_cache_gib * 2**30) if gpu_pool else None))
    c = h.batchgen_contender(llm, prompts, lambda k: SamplingParams(
        temperature=0, max_tokens=k, ignore_eos=True), args.output_len,
        lambda: (f"tensor_parallel_size={tp}", {"steps": meter.steps}), f"batchgen tp={tp}")
    meter = stack.enter_context(metered(llm, CommMeter(torch.device(args.device)), tp))

    def run(go: Callable[[], Any] = c.run) -> Any:
        meter.steps = 0  # the steps of the last run
        return go()

    c.run = run
    return c, meter


def run_sizes(path: Path, prompts: list[list[int]], args: Any) -> list[tuple[h.Result, Any]]:
    """Every size loaded, timed in interleaved rounds, then one instrumented run per size > 1
    (its tallies in ``extra["comm"]``). The LLMs are gone when this returns."""
    with contextlib.ExitStack() as stack:
        loaded = [load_size(path, tp, prompts, args, stack) for tp in args.tp]
        runs = h.run_contenders([c for c, _ in loaded], args, sum(map(len, prompts)))
        for tp, (r, _), (c, meter) in zip(args.tp, runs, loaded):
            r.extra.update(tp=tp, ms_per_step=1000 * r.wall_s / max(r.extra["steps"], 1))
            if tp > 1:
                meter.timing = True
                r.extra["comm_run_wall_s"] = h.timed(c.run, args.device)[1]
                r.extra["comm"] = meter.tallies
        del loaded, c, meter  # the last LLM's references
    gc.collect()  # the LLMs' finalizers stop their workers and leave the process group
    if dist.is_initialized():
        raise RuntimeError("the process group outlived its LLM")
    return runs


# ---- report ---------------------------------------------------------------------------------
def comm_table(comm: dict[str, dict[str, Tally]]) -> str:
    """Rank 0's communication per step (all steps; decode steps alone) of the instrumented run,
    against the step's ``execute`` (the forward, communication included)."""
    rows = []
    for kind in (*KINDS, "total", "execute"):
        cells = [KIND_NAMES[kind]]
        for phase in PHASES:
            tallies = comm[phase]
            steps = max(tallies["execute"].calls, 1)
            t = (Tally(*(sum(getattr(tallies[k], f) for k in KINDS)
                         for f in ("calls", "nbytes", "seconds"))) if kind == "total"
                 else tallies[kind])
            calls = "-" if kind == "execute" else f"{t.calls / steps:.1f}"
            kib = "-" if kind == "execute" else f"{t.nbytes / steps / 1024:.1f}"
            cells += [calls, kib, f"{1000 * t.seconds / steps:.2f}"]
        rows.append(cells)
    return h.markdown_table(["per step", "calls", "KiB", "ms", "decode: calls", "KiB", "ms"],
                            rows)


def comm_share(comm: dict[str, dict[str, Tally]], phase: str) -> float:
    """Communication seconds over ``execute`` seconds in ``phase``."""
    tallies = comm[phase]
    return sum(tallies[k].seconds for k in KINDS) / max(tallies["execute"].seconds, 1e-12)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    info = h.start(args)
    prompts = h.workload_prompts(args)
    n_prompt, expected = sum(map(len, prompts)), len(prompts) * args.output_len
    print(h.model_line(args))
    print(f"workload: {len(prompts)} prompts, lengths {args.min_prompt_len}-"
          f"{args.max_prompt_len} ({n_prompt} prompt tokens), {args.output_len} output tokens "
          f"each, greedy, EOS ignored; tensor_parallel_size {', '.join(map(str, args.tp))}",
          flush=True)
    with h.prepare_model_dir(args, args.max_prompt_len + args.output_len) as path:
        runs = run_sizes(path, prompts, args)
    (base, base_tokens), rows = runs[0], []
    for r, tokens in runs:
        h.check_lengths(f"TP={r.extra['tp']}", tokens, len(prompts), args.output_len)
        rows.append([str(r.extra["tp"]), f"{r.wall_s:.2f}", f"{r.output_tok_s:.1f}",
                     h.fmt_ratio(base.wall_s, r.wall_s), str(r.extra["steps"]),
                     f"{r.extra['ms_per_step']:.2f}"])
    print()
    print(h.markdown_table(["TP", h.wall_head(args.repeats), "output tok/s",
                            f"speed vs TP={args.tp[0]}", "steps", "ms/step"], rows))
    for r, _ in runs:
        if "comm" in r.extra:
            comm = r.extra["comm"]
            print(f"\nrank 0's communication, TP={r.extra['tp']} (instrumented run: "
                  f"{r.extra['comm_run_wall_s']:.2f} s, {comm['all']['execute'].calls} steps, "
                  f"{comm['decode']['execute'].calls} of them decode):\n")
            print(comm_table(comm))
            print(f"\ncommunication share of the step forward: {100 * comm_share(comm, 'all'):.0f}"
                  f"% (decode steps: {100 * comm_share(comm, 'decode'):.0f}%)")
            r.extra["comm_run"] = {phase: {k: asdict(t) for k, t in tallies.items()}
                                   for phase, tallies in r.extra.pop("comm").items()}
    print()
    for r, tokens in runs[1:]:
        print(h.agreement_line(f"TP={r.extra['tp']}", f"TP={args.tp[0]}",
                               h.agreement(tokens, base_tokens)))
    print("note: ms/step is the timed runs' wall time over their steps; the communication "
          "tables come from one extra instrumented run per TP > 1 (rank 0's calls; on CPU they "
          "include waiting for the other ranks).")
    return h.finish(args, info, {"prompt_tokens": n_prompt, "expected_output_tokens": expected,
                                 "results": [r.to_dict() for r, _ in runs]})


if __name__ == "__main__":
    main()

"""Tensor parallelism: the same greedy workload through ``LLM(tensor_parallel_size=k)`` for each
``--tp`` size, with the communication of a step measured on rank 0.

Sizes timed in interleaved rounds, then run once more metered: steps, and above TP=1 rank 0's
calls, bytes and time per step against the step's ``execute`` (on CPU a collective's time
includes waiting for the other ranks).

    PYTHONPATH=. python benchmarks/tensor_parallel.py --repeats 3
    PYTHONPATH=. python benchmarks/tensor_parallel.py --device cuda --tp 1,2 --dtype bfloat16
"""

import contextlib
import gc
import pickle
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from batchgen import LLM
from benchmarks import common as h

KINDS = {"control": "control broadcast (TPGroup.send)",
         "all_reduce": "all-reduce (rowwise o_proj, down_proj)",
         "dtensor": "DTensor collectives (embedding, lm_head)"}
PHASES = ("all", "decode")
CUDA_KV_GIB = 4  # KV pool per rank on CUDA without --num-kv-blocks (TP=1 and 2 share GPU 0)


class CommMeter:
    """Until ``stack`` closes: ``llm``'s steps, and ``tallies[phase][kind]`` = [calls, bytes,
    seconds] of each ``execute`` and, for tp > 1, of rank 0's communication inside it."""

    def __init__(self, llm, tp: int, device: torch.device, stack: contextlib.ExitStack):
        self.device, self.steps, self.in_step, self.decoding = device, 0, False, False
        self.tallies = {ph: {k: [0, 0, 0.0] for k in (*KINDS, "execute")} for ph in PHASES}
        runner, group = h.engine_runner(llm), h.tp_group_class()
        patches = [(runner, "execute", self.count_steps(runner.execute))]
        if tp > 1:
            patches += [
                (group, "send", self.wrap("control", group.send,
                                          lambda _group, msg: len(pickle.dumps(msg)))),
                (dist, "all_reduce", self.wrap("all_reduce", dist.all_reduce, _nbytes)),
                (funcol, "all_reduce", self.wrap("dtensor", funcol.all_reduce, _nbytes)),
                (funcol, "all_gather_single", self.wrap(
                    "dtensor", funcol.all_gather_single, lambda t, *a, **kw: tp * _nbytes(t))),
                (funcol, "wait_tensor", self.wrap("dtensor", funcol.wait_tensor, None))]
        for obj, name, fn in patches:
            stack.enter_context(mock.patch.object(obj, name, fn))

    def add(self, kind: str, calls: int, nbytes: int, seconds: float) -> None:
        for phase in PHASES if self.decoding else PHASES[:1]:
            for i, v in enumerate((calls, nbytes, seconds)):
                self.tallies[phase][kind][i] += v

    def wrap(self, kind: str, fn, size):
        """``fn`` timed into ``kind`` inside a step; ``size``: its bytes (None: time only)."""
        def timed_call(*args, **kwargs):
            if not self.in_step:
                return fn(*args, **kwargs)
            out, seconds = h.timed(lambda: fn(*args, **kwargs), self.device)
            self.add(kind, int(size is not None), size(*args, **kwargs) if size else 0, seconds)
            return out
        return timed_call

    def count_steps(self, execute):
        def step(rows):
            self.steps += 1
            self.in_step, self.decoding = True, h.step_is_decode(rows)
            try:
                out, seconds = h.timed(lambda: execute(rows), self.device)
            finally:
                self.in_step = False
            self.add("execute", 1, 0, seconds)
            return out
        return step


def _nbytes(t, *_, **__) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def run_sizes(path: Path, prompts: list[list[int]], args) -> list[tuple[h.Result, list]]:
    gpu_pool = args.num_kv_blocks is None and torch.device(args.device).type == "cuda"
    loaded = []
    for tp in args.tp:
        llm = LLM(str(path), **h.engine_kwargs(
            args, tensor_parallel_size=tp, enable_prefix_caching=False,  # repeats reuse prompts
            kv_cache_memory=CUDA_KV_GIB << 30 if gpu_pool else None))
        loaded.append((tp, llm, h.batchgen_contender(llm, prompts, h.greedy, args.output_len, (
            lambda tp=tp: (f"tensor_parallel_size={tp}", {})), f"batchgen tp={tp}")))
    runs = h.run_contenders([c for *_, c in loaded], args, sum(map(len, prompts)),
                            expect=(len(prompts), args.output_len))
    for (tp, llm, c), (r, _) in zip(loaded, runs):
        with contextlib.ExitStack() as stack:
            meter = CommMeter(llm, tp, torch.device(args.device), stack)
            r.extra["comm_run_wall_s"] = h.timed(c.run, args.device)[1]
        r.extra.update(tp=tp, steps=meter.steps, ms_per_step=1000 * r.wall_s / meter.steps)
        if tp > 1:
            r.extra["comm"] = meter.tallies
    del loaded, llm, c  # the last LLM's references
    gc.collect()  # the LLMs' finalizers stop their workers and leave the process group
    if dist.is_initialized():
        raise RuntimeError("the process group outlived its LLM")
    return runs


def comm_report(r: h.Result) -> None:
    comm, rows = r.extra["comm"], []
    for phase in PHASES:
        comm[phase]["total"] = [sum(comm[phase][k][i] for k in KINDS) for i in range(3)]
    for kind, name in (*KINDS.items(), ("total", "communication, total"),
                       ("execute", "step forward (execute), comm included")):
        cells = [name]
        for phase in PHASES:
            steps = max(comm[phase]["execute"][0], 1)
            calls, nbytes, seconds = comm[phase][kind]
            cells += (["-", "-"] if kind == "execute" else
                      [f"{calls / steps:.1f}", f"{nbytes / steps / 1024:.1f}"])
            cells.append(f"{1000 * seconds / steps:.2f}")
        rows.append(cells)
    print(f"\nrank 0's communication, TP={r.extra['tp']} (instrumented run: "
          f"{r.extra['comm_run_wall_s']:.2f} s, {comm['all']['execute'][0]} steps, "
          f"{comm['decode']['execute'][0]} of them decode):")
    h.table(["per step", "calls", "KiB", "ms", "decode: calls", "KiB", "ms"], rows)
    share = {ph: comm[ph]["total"][2] / max(comm[ph]["execute"][2], 1e-12) for ph in PHASES}
    print(f"\ncommunication share of the step forward: {100 * share['all']:.0f}% (decode "
          f"steps: {100 * share['decode']:.0f}%)")


def main(argv: list[str] | None = None) -> dict:
    p = h.parser(__doc__, model={}, workload={}, run={}, engine={})
    p.add_argument("--tp", type=h.int_list, default="1,2",
                   help="comma-separated tensor_parallel_size values (at most one > 1)")
    args = h.check_args(p, p.parse_args(argv))
    if sum(k > 1 for k in args.tp) > 1 or len(set(args.tp)) < len(args.tp):
        p.error("--tp takes distinct sizes, at most one of them > 1 (a process holds one "
                "tensor-parallel group at a time)")
    if any(args.num_heads % k or args.num_kv_heads % k for k in args.tp):
        p.error("every --tp size must divide --num-heads and --num-kv-heads")
    info = h.start(args)
    prompts = h.workload_prompts(args)
    print(h.model_line(args))
    print(h.workload_line(args, prompts, f"{args.output_len} output tokens each, greedy, EOS "
                          f"ignored; tensor_parallel_size {', '.join(map(str, args.tp))}"))
    with h.prepare_model_dir(args, args.max_prompt_len + args.output_len) as path:
        runs = run_sizes(path, prompts, args)
    base, base_tokens = runs[0]
    h.table(["TP", h.wall_head(args.repeats), "output tok/s", f"speed vs TP={args.tp[0]}",
             "steps", "ms/step"],
            [[r.extra["tp"], f"{r.wall_s:.2f}", f"{r.output_tok_s:.1f}",
              h.fmt_ratio(base.wall_s, r.wall_s), r.extra["steps"],
              f"{r.extra['ms_per_step']:.2f}"] for r, _ in runs])
    for r, _ in runs:
        if "comm" in r.extra:
            comm_report(r)
    print()
    for r, tokens in runs[1:]:
        print(h.agreement_line(f"TP={r.extra['tp']}", f"TP={args.tp[0]}",
                               h.agreement(tokens, base_tokens)))
    return h.finish(args, info, {"prompt_tokens": sum(map(len, prompts)),
                                 "expected_output_tokens": len(prompts) * args.output_len,
                                 "results": [r.to_dict() for r, _ in runs]})


if __name__ == "__main__":
    main()

"""Host overhead per decode step: what batchgen's Python costs around the model forward.

Hooks time every forward of a near-free model; a step's host time is the gap between two decode
forwards: the median over the decode steps of tokens ``--window``, lowest of ``--repeats``, and
in the growth run (64 rows) of the last tokens too, with the host's function calls per step.
``--overlap`` instead times whole decode steps of the weightless engine around a stand-in
forward that waits ``--standin-ms`` like a device (a sleep: the GIL is free), serial vs async
scheduling (the forward and sampler on the ForwardQueue while the host plans the next step).

    PYTHONPATH=. python benchmarks/host_overhead.py --repeats 3 --threads 2

``--beams``: instead, beam search of width ``BEAM_WIDTH`` over ``BEAM_PROMPTS`` prompts (256 rows
a step), host ms per decode step at tokens ``--beam-windows`` (early, late: flat in length?),
against HF ``generate(num_beams=4)``'s own host time per beam step on the same rows (early);
then the same beams with the model's forward stubbed (logits rows looked up from a table; the
rest of the step as before), and stubbed but reading as many bytes as the real forward's
attention reads of the K/V (a sum over a buffer that size): on the CPU a real forward streams
the K/V through the caches the host's work then misses in (the late steps' host time grows
with the forward's, and grows as much with the stub that only reads those bytes), which a
GPU's forward does not.

    PYTHONPATH=. python benchmarks/host_overhead.py --beams --repeats 3
    PYTHONPATH=. python benchmarks/host_overhead.py --overlap --rows 256 --repeats 5
"""

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.factory import EngineShape, build_engine, build_frontend
from batchgen.kinds import SAMPLES
from benchmarks import common as h

LONG_ROWS = 64  # rows of the growth run
BEAM_PROMPTS, BEAM_WIDTH = 64, 4  # the beam case: 256 rows per decode step
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2)
TOP_P = dict(temperature=0.8, top_p=0.95)
KV_READ = "batchgen, forward stubbed, K/V read"
STUBS = {"batchgen, forward stubbed": False, KV_READ: True}  # stub -> reads the K/V's bytes
SCENARIOS = {  # name -> (n, SamplingParams kwargs); the stop strings never match
    "greedy": (1, dict(temperature=0.0)),
    "n8 top-p": (8, TOP_P),
    "n8 top-p + penalties": (8, dict(**TOP_P, **PENALTIES)),
    "penalties + stop": (1, dict(**TOP_P, stop=["\x00never\x00", "@@@@@@"], **PENALTIES)),
}


class ForwardClock:
    """Times every forward (start, end, tokens); counts calls between them (``count_calls``)."""

    def __init__(self, model: torch.nn.Module, device: str) -> None:
        self.calls, self.counts, self.device = [], [], device
        self._start, self._count, self.count_calls = 0.0, 0, False
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs) -> None:
        if self.count_calls:
            sys.setprofile(None)
            self.counts.append(self._count)
        h.sync(self.device)
        self._start = time.perf_counter()

    def _post(self, module, args, kwargs, out) -> None:
        h.sync(self.device)
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append((self._start, time.perf_counter(), int(ids.shape[-1] * ids.shape[0])))
        if self.count_calls:
            self._count = 0
            sys.setprofile(self._profile)

    def _profile(self, frame, event: str, arg) -> None:
        if event in ("call", "c_call"):  # Python functions and builtins (torch ops included)
            self._count += 1

    def measure(self, fn, rows: int) -> tuple[list[float], list[float], list[float]]:
        """Run ``fn()``: per decode forward after a decode forward, host gap, forward, calls."""
        self.calls, self.counts = [], []
        try:
            with torch.inference_mode():
                fn()
        finally:
            sys.setprofile(None)
        idx = [i for i, (_, _, t) in enumerate(self.calls)
               if t == rows and i > 0 and self.calls[i - 1][2] == rows]
        return ([(self.calls[i][0] - self.calls[i - 1][1]) * 1e3 for i in idx],
                [(self.calls[i][1] - self.calls[i][0]) * 1e3 for i in idx],
                [float(self.counts[i]) for i in idx if i < len(self.counts)])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class StandInRunner:
    """The engine's Runner with a forward that is a fixed device time, as a GPU's is to the
    host: `execute` returns at once (kernels queued) with each logits row from a fixed random
    table indexed by the row's last query token (so tokens feed the next step as a model's
    would) and the device is busy `forward_ms` from then; reading the sampled tokens waits for
    it (`ClockedSampler`: a sleep, the GIL free). Block moves are free."""

    def __init__(self, forward_ms: float, vocab_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size, vocab_size, generator=g) * 3
        self.wait = forward_ms / 1e3
        self.start = self.ready = 0.0
        self.forwards: list[float] = []  # device start to the tokens read, per step

    def copy_blocks(self, copies) -> None:
        pass

    def swap_blocks(self, swap_in, swap_out) -> None:
        pass

    def execute(self, rows) -> torch.Tensor:
        self.start = time.perf_counter()
        self.ready = self.start + self.wait
        ends = np.cumsum(rows.num_new)[rows.num_logits > 0] - 1
        return self.table[torch.from_numpy(rows.token_ids[ends])]

    def synchronize(self) -> None:
        """Wait for the device: until the step's forward is done."""
        left = self.ready - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self.forwards.append(time.perf_counter() - self.start)


class ClockedSampler:
    """The engine's sampler, whose draws are read once the stand-in device is done (its
    kernels' launch, here the CPU sampler itself, overlaps the forward, as on a GPU)."""

    def __init__(self, sampler, runner: StandInRunner) -> None:
        self.sampler, self.runner = sampler, runner

    def __call__(self, logits, cols):
        out = self.sampler(logits, cols)
        self.runner.synchronize()
        return out


def overlap_case(args, rows: int, overlap: bool, tokens: int) -> tuple[float, float, int]:
    """Median decode-step wall time (ms) and stand-in forward time (ms) of `rows` greedy rows
    generating `tokens` tokens on the weightless engine, and the steps launched blind."""
    shape = EngineShape(num_blocks=rows * h.blocks_for(32 + tokens, 16) + 16, block_size=16,
                        max_model_len=64 + tokens, max_num_seqs=rows,
                        max_num_batched_tokens=max(8192, rows * 32), vocab_size=args.vocab_size,
                        eos_token_ids=[2])
    runner = StandInRunner(args.standin_ms, args.vocab_size)
    engine = build_engine(shape, runner, overlap)
    engine.sampler = ClockedSampler(engine.sampler, runner)
    requests, _ = build_frontend(shape, None)
    prompts = [{"prompt_token_ids": p}
               for p in h.make_prompts(rows, 16, 32, args.vocab_size, seed=0)]
    groups = requests.build(prompts, SamplingParams(temperature=0, max_tokens=tokens,
                                                    ignore_eos=True), SAMPLES)
    marks: list[float] = []

    def on_step(stats) -> None:
        if stats.prompt_tokens == 0 and stats.output_tokens == rows:
            marks.append(time.perf_counter())

    engine.run(groups, on_step)
    if engine.overlap is not None:
        engine.overlap.queue.close()
    steps = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    ahead = engine.overlap.steps_blind if engine.overlap is not None else 0
    return (statistics.median(steps[4:]), statistics.median(runner.forwards) * 1e3, ahead)


def model_overlap(args, rows: int, tokens: int) -> dict[str, float]:
    """Wall ms per decode step (a call's wall over its tokens, lowest of the repeats) of the
    random model, serial vs async scheduling, asserting both give the same tokens."""
    prompts = h.make_prompts(rows, 16, 32, args.vocab_size, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    best: dict[str, float] = {}
    with h.prepare_model_dir(args, 64 + tokens + 64) as model_dir:
        llms = {mode: LLM(str(model_dir), max_num_seqs=rows, enable_prefix_caching=False,
                          seed=0, device=args.device, async_scheduling=mode == "async")
                for mode in ("serial", "async")}
        for llm in llms.values():  # untimed warm-up
            h.bg_tokens(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=4))
        outs = {}
        for _ in range(args.repeats):
            for mode, llm in llms.items():
                outs[mode], wall = h.timed(lambda llm=llm: h.bg_tokens(llm, prompts, sp),
                                           args.device)
                best[mode] = min(best.get(mode, math.inf), wall * 1e3 / tokens)
        if outs["serial"] != outs["async"]:
            raise RuntimeError("async scheduling changed the tokens")
    return best


def overlap_main(args) -> dict:
    """Serial vs async step time around the stand-in forward, lowest median of the repeats;
    with --overlap-model also around the random model's real forward."""
    info = h.start(args)
    tokens = args.window[1]
    best: dict = {}
    for _ in range(args.repeats):
        for rows in args.rows:
            for mode in ("serial", "async"):
                step, fwd, ahead = overlap_case(args, rows, mode == "async", tokens)
                if (mode, rows) not in best or step < best[(mode, rows)][0]:
                    best[(mode, rows)] = (step, fwd, ahead)
    model = {rows: model_overlap(args, rows, tokens) for rows in args.rows
             } if args.overlap_model else {}
    if model:
        print(h.markdown_table(["model forward", "rows", "serial ms / step", "async ms / step"],
                               [["random Llama", rows, f"{m['serial']:.3f}", f"{m['async']:.3f}"]
                                for rows, m in model.items()]))
    print(h.markdown_table(
        ["engine", "rows", "stand-in forward ms", "step ms", "host ms not hidden",
         "steps launched before the last one's tokens"],
        [[mode, rows, f"{fwd:.3f}", f"{step:.3f}", f"{step - fwd:.3f}", ahead]
         for (mode, rows), (step, fwd, ahead) in best.items()]))
    return h.finish(args, info, {"overlap": [
        dict(engine=mode, rows=rows, step_ms=step, forward_ms=fwd, steps_ahead=ahead)
        for (mode, rows), (step, fwd, ahead) in best.items()], "overlap_model": [
        dict(rows=rows, **m) for rows, m in model.items()]})


def window(values: list[float], first: int, last: int) -> float:
    """Median over the decode steps sampling tokens first..last (token 1: the prefill's)."""
    picked = values[max(first - 2, 0):max(last - 1, 1)]
    if not picked:
        raise RuntimeError(f"no decode steps measured in tokens {first}..{last}")
    return statistics.median(picked)


def parse_args(argv: list[str] | None):
    p = h.parser(__doc__, run={"repeats": 3}, model=dict(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
        vocab_size=300, seed=0))
    p.add_argument("--rows", type=h.int_list, default="64,256", help="decode rows per step")
    p.add_argument("--window", type=h.int_list, default="9,72",
                   help="first,last generated token whose decode steps are measured")
    h.add_ints(p, long_tokens=1024)  # 0: no growth run
    p.add_argument("--scenarios", type=lambda v: [s.strip() for s in v.split(",") if s.strip()],
                   default=",".join(SCENARIOS), help=f"a subset of {', '.join(SCENARIOS)}")
    p.add_argument("--skip-hf", action="store_true", help="skip HF generate")
    p.add_argument("--beams", action="store_true",
                   help=f"run the beam case ({BEAM_PROMPTS} prompts x width {BEAM_WIDTH}) instead")
    p.add_argument("--beam-windows", type=h.int_list, default="9,24,497,512",
                   help="the beam case's early and late windows: first,last,first,last token")
    p.add_argument("--overlap", action="store_true",
                   help="only the overlap case: serial vs async steps around a stand-in forward")
    p.add_argument("--standin-ms", type=float, default=2.0,
                   help="the stand-in forward's wait (--overlap)")
    p.add_argument("--overlap-model", action="store_true",
                   help="with --overlap: also serial vs async around the random model's forward")
    args = h.check_args(p, p.parse_args(argv))
    w = args.beam_windows
    if len(w) != 4 or not 2 <= w[0] <= w[1] < w[2] <= w[3]:
        p.error("--beam-windows must be 4 tokens a,b,c,d with 2 <= a <= b < c <= d")
    if set(args.scenarios) - set(SCENARIOS):
        p.error(f"unknown --scenarios {args.scenarios}; choose from {list(SCENARIOS)}")
    if len(args.window) != 2 or args.window[0] > args.window[1]:
        p.error("--window must be first,last with first <= last")
    if 0 < args.long_tokens < 2 * args.window[1]:
        p.error("--long-tokens must be 0 or at least twice the window's last token")
    return args


def beam_case(args, info: dict) -> dict:
    """Beam search, 64 prompts x width 4 (256 rows a step): batchgen's host ms per decode step
    early and late in a long run (lowest of --repeats; the real forward, stubbed, stubbed
    reading the K/V's bytes) and its function calls per step there, HF ``generate``'s host ms
    on the same rows early."""
    rows, (a, b, c, d) = BEAM_PROMPTS * BEAM_WIDTH, args.beam_windows
    prompts = h.make_prompts(BEAM_PROMPTS, 16, 32, args.vocab_size, seed=0)
    figures: dict = {}  # (system, tokens) -> (host ms, forward ms), the lowest host of the runs

    def keep(system: str, gaps_fwd: tuple, first: int, last: int) -> None:
        host, fwd = (window(v, first, last) for v in gaps_fwd[:2])
        key = (system, f"{first}-{last}")
        if key not in figures or host < figures[key][0]:
            figures[key] = (host, fwd)

    def bg_run(tokens: int) -> tuple:
        bp = BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=tokens, ignore_eos=True)
        return clock.measure(lambda: llm.beam_search(h.token_prompts(prompts), bp,
                                                     use_tqdm=False), rows)

    with h.prepare_model_dir(args, d + 64, tokenizer=True) as model_dir:
        llm = LLM(str(model_dir), max_num_seqs=rows, max_model_len=d + 64,
                  enable_prefix_caching=False, seed=0, device=args.device)
        clock = ForwardClock(h.engine_model(llm), args.device)
        bg_run(4)  # warm-up
        for _ in range(args.repeats):
            out = bg_run(d)
            keep("batchgen", out, a, b)
            keep("batchgen", out, c, d)
        for system, kv_bytes in STUBS.items():
            model = h.engine_model(llm)  # K/V bytes: every row at the longest length
            with stub_forward(model, args.vocab_size,
                              kv_bytes and kv_bytes_per_token(model) * rows * (d + 64)):
                for _ in range(args.repeats):
                    out = bg_run(d)
                    keep(system, out, a, b)
                    keep(system, out, c, d)
        clock.count_calls = True  # once more, untimed: the host's function calls per step
        counts = bg_run(d)[2]
        calls = [window(counts, a, b), window(counts, c, d)]
        clock.close()
        if not args.skip_hf:
            hf = h.load_hf_model(model_dir, torch.float32, args.device)
            clock = ForwardClock(hf, args.device)
            beams = dict(num_beams=BEAM_WIDTH, num_return_sequences=1, do_sample=False,
                         early_stopping=False, length_penalty=1.0)

            def hf_run(tokens: int) -> tuple:
                return clock.measure(lambda: h.hf_generate_all(
                    hf, prompts, BEAM_PROMPTS, tokens, args.device, **beams), rows)

            hf_run(4)  # warm-up
            for _ in range(args.repeats):
                keep("HF generate", hf_run(b), a, b)
            clock.close()
    print(h.markdown_table(["system", "beams", "tokens", "host ms / step", "forward ms / step"],
                           [[s, f"{BEAM_PROMPTS} x W={BEAM_WIDTH}", t, f"{host:.3f}",
                             f"{fwd:.3f}"] for (s, t), (host, fwd) in figures.items()]))
    growth = {}
    for system in ("batchgen", *STUBS):
        early, late = figures[(system, f"{a}-{b}")][0], figures[(system, f"{c}-{d}")][0]
        growth[system] = late / early
        print(f"growth (beams, {system}): host ms at tokens {c}-{d} / at {a}-{b} = "
              f"{late / early:.2f}x")
    print(f"function calls per decode step (beams): {calls[0]:.0f} at tokens {a}-{b}, "
          f"{calls[1]:.0f} at {c}-{d} ({calls[1] / calls[0]:.2f}x)")
    return h.finish(args, info, {"figures": [dict(system=s, tokens=t, host_ms=host, forward_ms=f)
                                             for (s, t), (host, f) in figures.items()],
                                 "growth": growth["batchgen"],
                                 "growth_stubbed": growth["batchgen, forward stubbed"],
                                 "growth_stubbed_kv_read": growth[KV_READ],
                                 "calls_per_step": calls})


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of K and V one token keeps over all the model's layers (what attention reads)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.finfo(cfg.dtype).bits // 8


@contextlib.contextmanager
def stub_forward(model: torch.nn.Module, vocab_size: int, kv_bytes: int = 0
                 ) -> Iterator[None]:
    """The model's forward replaced by a lookup (each kept position's logits row from a fixed
    random table, by its token): every step's host work runs as before (scheduling, step
    inputs, the attention plan, block copies, the beams' scoring and bookkeeping), around a
    forward that costs nothing and leaves the caches warm. With ``kv_bytes`` (a buffer that
    size), the stub also reads as many of its bytes as the step's attention reads of K/V
    (each row's keys and values up to its last position, once: a decode step's exactly):
    the real forward's memory traffic through the CPU's caches, without its compute."""
    table = torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    table = table.to(next(model.parameters()).device)
    per_token = kv_bytes_per_token(model)
    pool = torch.ones(kv_bytes // 4 if kv_bytes else 0, device=table.device)

    def forward(input_ids=None, logits_to_keep=None, position_ids=None, **kwargs):
        if kv_bytes:  # each row's keys and values once: up to its last position
            last = position_ids[0] if logits_to_keep is None else position_ids[0, logits_to_keep]
            read = int((last + 1).sum()) * per_token // 4
            if read > pool.numel():
                raise RuntimeError(f"the stub's K/V buffer holds {kv_bytes} bytes; the step "
                                   f"reads {read * 4}")
            pool[:read].sum()
        ids = input_ids[0] if logits_to_keep is None else input_ids[0, logits_to_keep]
        return SimpleNamespace(logits=table[ids][None])

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.overlap:
        return overlap_main(args)
    info = h.start(args)
    if args.beams:
        return beam_case(args, info)
    (first, last), long = args.window, args.long_tokens
    early, late = f"{first}-{last}", f"{long - (last - first)}-{long}"
    max_rows = max(*args.rows, LONG_ROWS)
    prompts = h.make_prompts(max_rows, 16, 32, args.vocab_size, seed=0)
    figures = {}  # (system, scenario, rows, tokens) -> the lowest host ms and its forward ms

    def keep(system: str, scenario: str, rows: int, gaps_fwd: tuple, tokens: str = early):
        host, fwd = (window(v, *map(int, tokens.split("-"))) for v in gaps_fwd[:2])
        key = (system, scenario, rows, tokens)
        if key not in figures or host < figures[key][0]:
            figures[key] = (host, fwd)

    def bg_run(scenario: str, rows: int, tokens: int) -> tuple:
        n, kw = SCENARIOS[scenario]
        sp = SamplingParams(n=n, max_tokens=tokens, ignore_eos=True, seed=None, **kw)
        return clock.measure(lambda: h.check_lengths(
            scenario, h.bg_tokens(llm, prompts[:rows // n], sp), rows, tokens), rows)

    calls = None
    with h.prepare_model_dir(args, max(2048, long + 64), tokenizer=True) as model_dir:
        llm = LLM(str(model_dir), max_num_seqs=max_rows, max_model_len=max(long, last) + 64,
                  enable_prefix_caching=False, seed=0, device=args.device)
        clock = ForwardClock(h.engine_model(llm), args.device)
        bg_run("greedy", 16, 8)  # warm-up
        for _ in range(args.repeats):
            for scenario in args.scenarios:
                for rows in args.rows:
                    keep("batchgen", scenario, rows, bg_run(scenario, rows, last))
            if long:  # the growth run: early and late in one long run
                out = bg_run("penalties + stop", LONG_ROWS, long)
                keep("batchgen", "penalties + stop", LONG_ROWS, out)
                keep("batchgen", "penalties + stop", LONG_ROWS, out, late)
        if long:  # once more, untimed, counting the host's function calls per step
            clock.count_calls = True
            counts = bg_run("penalties + stop", LONG_ROWS, long)[2]
            calls = [window(counts, *map(int, t.split("-"))) for t in (early, late)]
        clock.close()
        if not args.skip_hf:
            hf = h.load_hf_model(model_dir, torch.float32, args.device)
            clock = ForwardClock(hf, args.device)

            def hf_run(rows: int, tokens: int) -> tuple:
                return clock.measure(lambda: h.hf_generate_all(
                    hf, prompts[:rows], rows, tokens, args.device, do_sample=False), rows)

            hf_run(8, 4)  # warm-up
            for _ in range(args.repeats):
                for rows in args.rows:
                    keep("HF generate", "greedy", rows, hf_run(rows, last))
            clock.close()
    long_run = {k[3]: host for k, (host, _) in figures.items()
                if k[1:3] == ("penalties + stop", LONG_ROWS)}
    growth = long_run[late] / long_run[early] if late in long_run else None
    print(h.markdown_table(["system", "scenario", "rows", "tokens", "host ms / step",
                            "forward ms / step"],
                           [[*k, f"{host:.3f}", f"{fwd:.3f}"] for k, (host, fwd) in
                            figures.items()]))
    if growth is not None:
        print(f"growth (penalties + stop, 64 rows): host ms at tokens {late} / at {early} = "
              f"{growth:.2f}x")
    if calls is not None:
        print(f"function calls per decode step (penalties + stop, 64 rows): {calls[0]:.0f} at "
              f"tokens {early}, {calls[1]:.0f} at {late} ({calls[1] / calls[0]:.2f}x)")
    keys = ("system", "scenario", "rows", "tokens")
    return h.finish(args, info, {"figures": [dict(zip(keys, k), host_ms=host, forward_ms=fwd)
                                             for k, (host, fwd) in figures.items()],
                                 "growth": growth, "calls_per_step": calls})


if __name__ == "__main__":
    main()

"""Host overhead per decode step: what batchgen's Python costs around the model forward.

On a model whose forward is nearly free (Llama, 2 layers, hidden 64, vocab 300), forward hooks
time every forward; a step's host time (sampling, stop checks, results, scheduling, inputs, the
attention plan) is the gap between two decode forwards (on CUDA each forward is synchronised,
so the sampler's kernels count too). Scenarios (``ignore_eos``): ``greedy``; ``n8 top-p`` (n=8,
temperature 0.8, top-p 0.95); ``n8 top-p + penalties`` (repetition 1.1, presence and frequency
0.2); ``penalties + stop`` (n=1, and two stop strings that never match: every row detokenized
every step), each at ``--rows`` rows: the median host ms over the decode steps of tokens
``--window``, lowest of ``--repeats`` rounds. The growth run decodes ``--long-tokens`` tokens
(``penalties + stop``, 64 rows) and compares the window's median with the last tokens'; an
untimed rerun counts the host's function calls per step (independent of load and caches). HF
``generate`` (greedy, same model and rows) is measured the same way. ``--evict-mb`` writes
that much memory after every forward, so every host gap starts with cold CPU caches (a late
CPU forward streams far more K/V through them than an early one; a GPU's does not).

    PYTHONPATH=. python benchmarks/host_overhead.py --repeats 3 --threads 2
    PYTHONPATH=. python benchmarks/host_overhead.py --scenarios greedy --rows 64 --evict-mb 64
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common as h  # noqa: E402

PROMPT_LEN = (16, 32)
STOP_STRINGS = ["\x00never\x00", "@@@@@@"]  # never produced: every row decodes to the end
LONG_ROWS = 64  # rows of the growth run
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2)
SCENARIOS: dict[str, tuple[int, dict[str, Any]]] = {  # name -> (n, SamplingParams kwargs)
    "greedy": (1, dict(temperature=0.0)),
    "n8 top-p": (8, dict(temperature=0.8, top_p=0.95)),
    "n8 top-p + penalties": (8, dict(temperature=0.8, top_p=0.95, **PENALTIES)),
    "penalties + stop": (1, dict(temperature=0.8, top_p=0.95, stop=STOP_STRINGS, **PENALTIES)),
}


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = h.parser(__doc__)
    h.add_model_args(p, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=128, vocab_size=300, seed=0)
    h.add_run_args(p, repeats=3)
    p.add_argument("--rows", default="64,256", help="decode rows (sequences) per step")
    p.add_argument("--window", default="9,72",
                   help="first,last generated token whose decode steps are measured")
    p.add_argument("--long-tokens", type=int, default=1024,
                   help="tokens of the growth run (penalties + stop, 64 rows); 0 skips it")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated subset of: " + ", ".join(SCENARIOS))
    p.add_argument("--skip-hf", action="store_true", help="skip HF generate")
    p.add_argument("--evict-mb", type=int, default=0,
                   help="write this many MiB at the end of every forward (timed as forward), so "
                        "every host gap starts from cold CPU caches (0: off)")
    args = h.check_args(p, p.parse_args(argv))
    args.rows = h.parse_int_list(p, args.rows, "--rows")
    args.window = h.parse_int_list(p, args.window, "--window")
    if len(args.window) != 2 or args.window[0] > args.window[1]:
        p.error("--window must be first,last with first <= last")
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if set(args.scenarios) - set(SCENARIOS):
        p.error(f"unknown --scenarios {args.scenarios}; choose from {list(SCENARIOS)}")
    if args.long_tokens and args.long_tokens < 2 * args.window[1]:
        p.error("--long-tokens must be 0 or at least twice the window's last token")
    return args


class ForwardClock:
    """Times every forward of a model with hooks: (start, end, query tokens) per call; or, with
    ``count_calls``, counts the host's function calls between forwards instead."""

    def __init__(self, model: torch.nn.Module, device: str = "cpu", evict_mb: int = 0) -> None:
        self.calls: list[tuple[float, float, int]] = []
        self.device = device
        # written at the end of every forward (timed as forward): each host gap starts with
        # cold CPU caches, however much K/V the forward touched (on a GPU it touches none)
        self._evict = torch.ones(evict_mb << 18) if evict_mb else None
        self._start = 0.0
        self.count_calls = False
        self.counts: list[int] = []  # function calls in the gap before each forward
        self._count = 0
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if self.count_calls:
            sys.setprofile(None)
            self.counts.append(self._count)
        h.sync(self.device)
        self._start = time.perf_counter()

    def _post(self, module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        h.sync(self.device)
        if self._evict is not None:
            self._evict.add_(1.0)
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append((self._start, time.perf_counter(), int(ids.shape[-1] * ids.shape[0])))
        if self.count_calls:
            self._count = 0
            sys.setprofile(self._profile)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):  # Python functions and builtins (torch ops included)
            self._count += 1

    def reset(self) -> None:
        self.calls, self.counts = [], []

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def decode_gaps(self, rows: int) -> tuple[list[float], list[float], list[float]]:
        """Per decode forward whose predecessor was a decode forward too: the host gap before
        it and its own time (ms), and the function calls in that gap (when counted)."""
        idx = [i for i, (_, _, t) in enumerate(self.calls)
               if t == rows and i > 0 and self.calls[i - 1][2] == rows]
        return ([(self.calls[i][0] - self.calls[i - 1][1]) * 1e3 for i in idx],
                [(self.calls[i][1] - self.calls[i][0]) * 1e3 for i in idx],
                [float(self.counts[i]) for i in idx if i < len(self.counts)])


@dataclass
class Figure:
    system: str
    scenario: str
    rows: int
    tokens: str  # the generated tokens whose decode steps were measured
    host_ms: float  # median host ms per decode step
    forward_ms: float  # median forward ms per decode step


def window(values: list[float], first: int, last: int) -> float:
    """Median over the decode steps that sample tokens first..last: token 1 comes from the
    prefill, decode forward k samples token k + 1, and gap j (before decode forward j + 2)
    holds the sampling of token j + 2."""
    picked = values[max(first - 2, 0):max(last - 1, 1)]
    if not picked:
        raise RuntimeError(f"no decode steps measured in tokens {first}..{last}")
    return statistics.median(picked)


def run_batchgen(llm: Any, clock: ForwardClock, prompts: list[list[int]], scenario: str,
                 rows: int, max_tokens: int) -> tuple[list[float], ...]:
    from batchgen import SamplingParams

    n, kw = SCENARIOS[scenario]
    sp = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=None, **kw)
    clock.reset()
    tokens = h.bg_tokens(llm, prompts[:rows // n], sp)
    h.check_lengths(scenario, tokens, rows, max_tokens)
    return clock.decode_gaps(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from batchgen import LLM

    args = parse_args(argv)
    info = h.start(args)
    first, last = args.window
    long_tokens = args.long_tokens
    late = f"{long_tokens - (last - first)}-{long_tokens}"
    max_rows = max(*args.rows, LONG_ROWS)
    prompts = h.make_prompts(max_rows, *PROMPT_LEN, args.vocab_size, seed=0)
    figures: dict[tuple[str, str, int, str], Figure] = {}

    def keep(system: str, scenario: str, rows: int, gaps: list[float], fwd: list[float],
             lo: int = first, hi: int = last) -> None:
        """The run with the lowest median host time of each measurement."""
        fig = Figure(system, scenario, rows, f"{lo}-{hi}", window(gaps, lo, hi),
                     window(fwd, lo, hi))
        key = (system, scenario, rows, fig.tokens)
        if key not in figures or fig.host_ms < figures[key].host_ms:
            figures[key] = fig

    calls = None
    with h.prepare_model_dir(args, max(2048, long_tokens + 64), tokenizer=True) as model_dir:
        llm = LLM(str(model_dir), max_num_seqs=max_rows, max_model_len=max(long_tokens, last)
                  + 64, enable_prefix_caching=False, seed=0, device=args.device)
        clock = ForwardClock(h.engine_model(llm), args.device, args.evict_mb)
        run_batchgen(llm, clock, prompts, "greedy", 16, 8)  # warm-up
        for _ in range(args.repeats):
            for scenario in args.scenarios:
                for rows in args.rows:
                    gaps, fwd, _ = run_batchgen(llm, clock, prompts, scenario, rows, last)
                    keep("batchgen", scenario, rows, gaps, fwd)
            if long_tokens:  # the growth run: early and late in one long run
                gaps, fwd, _ = run_batchgen(llm, clock, prompts, "penalties + stop", LONG_ROWS,
                                            long_tokens)
                keep("batchgen", "penalties + stop", LONG_ROWS, gaps, fwd)
                keep("batchgen", "penalties + stop", LONG_ROWS, gaps, fwd,
                     long_tokens - (last - first), long_tokens)
        if long_tokens:  # once more, untimed, counting the host's function calls per step
            clock.count_calls = True
            try:
                *_, counts = run_batchgen(llm, clock, prompts, "penalties + stop", LONG_ROWS,
                                          long_tokens)
            finally:
                sys.setprofile(None)
                clock.count_calls = False
            calls = (window(counts, first, last),
                     window(counts, long_tokens - (last - first), long_tokens))
        clock.close()
        if not args.skip_hf:
            hf = h.load_hf_model(model_dir, torch.float32, args.device)
            clock = ForwardClock(hf, args.device, args.evict_mb)

            def hf_run(rows: int, n_tokens: int) -> tuple[list[float], ...]:
                clock.reset()
                with torch.inference_mode():
                    h.hf_generate_all(hf, prompts[:rows], rows, n_tokens, args.device,
                                      do_sample=False)
                return clock.decode_gaps(rows)

            hf_run(8, 4)  # warm-up
            for _ in range(args.repeats):
                for rows in args.rows:
                    gaps, fwd, _ = hf_run(rows, last)
                    keep("HF generate", "greedy", rows, gaps, fwd)
            clock.close()

    long_run = {f.tokens: f.host_ms for f in figures.values()
                if f.scenario == "penalties + stop" and f.rows == LONG_ROWS}
    growth = long_run[late] / long_run[f"{first}-{last}"] if late in long_run else None
    print(h.markdown_table(["system", "scenario", "rows", "tokens", "host ms / step",
                            "forward ms / step"],
                           [[f.system, f.scenario, f.rows, f.tokens, f"{f.host_ms:.3f}",
                             f"{f.forward_ms:.3f}"] for f in figures.values()]))
    if growth is not None:
        print(f"growth (penalties + stop, 64 rows): host ms at tokens {late} / at "
              f"{first}-{last} = {growth:.2f}x")
    if calls is not None:
        print(f"function calls per decode step (penalties + stop, 64 rows): {calls[0]:.0f} at "
              f"tokens {first}-{last}, {calls[1]:.0f} at {late} ({calls[1] / calls[0]:.2f}x)")
    return h.finish(args, info, {"figures": [asdict(f) for f in figures.values()],
                                 "growth": growth, "calls_per_step": calls})


if __name__ == "__main__":
    main()

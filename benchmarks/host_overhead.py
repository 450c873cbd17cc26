"""Host overhead per decode step: what batchgen's Python costs around the model forward.

On a GPU the forward of a decode step takes a few milliseconds; everything the host does
between two forwards (sampling the last step, stop checks, results, scheduling, step inputs,
the attention plan) must cost far less, whatever the batch and however long sequences have
grown. This benchmark measures exactly that on a model whose forward is nearly free (Llama,
2 layers, hidden 64, vocab 300): forward pre/post hooks on the model time every forward, and
a step's host time is the gap between the end of one forward and the start of the next. Only
gaps between two decode forwards count (every row one query token).

Scenarios (all ``ignore_eos``, every row generates the same number of tokens):

* ``greedy``: temperature 0, n = 1;
* ``n8 top-p``: n = 8, temperature 0.8, top-p 0.95 (rows / 8 prompts);
* ``n8 top-p + penalties``: the same with repetition 1.1, presence 0.2, frequency 0.2;
* ``penalties + stop``: n = 1, temperature 0.8, top-p 0.95, the three penalties and two stop
  strings that never match (so every row is detokenized every step).

Each runs at 64 and 256 rows (``--rows``); the figure is the median host ms over the decode
steps of tokens ``--window`` (default 9..72), the lowest of ``--repeats`` runs done in rounds
(on a shared machine other load only adds time). The growth run decodes ``--long-tokens`` tokens
(default 1,024) for ``penalties + stop`` at 64 rows and compares the median over the window
ending at token 64 with the one ending at the last token. HF ``generate`` (greedy, the same
model, rows and prompts) is measured the same way, with the same hooks: its own host time.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/host_overhead.py
    PYTHONPATH=. python benchmarks/host_overhead.py --rows 64 --long-tokens 0 --json out.json
    PYTHONPATH=. python benchmarks/host_overhead.py --scenarios greedy --rows 64 --evict-mb 64

The last one reads the growth with cold caches at every step: late in a long run the CPU
forward streams far more K/V through the caches than early, which slows the host's next
step on a CPU (not on a GPU, whose forward reads HBM); evicting after every forward takes
that difference out. The profile count of function calls per step (growth run) is a second
figure that does not depend on load or caches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    PAD_ID,
    left_pad,
    load_hf_model,
    machine_info,
    machine_line,
    make_prompts,
    markdown_table,
    parse_int_list,
    quiet_logging,
    write_json,
)

VOCAB = 300
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", default="64,256", help="decode rows (sequences) per step")
    p.add_argument("--window", default="9,72",
                   help="first,last generated token whose decode steps are measured")
    p.add_argument("--long-tokens", type=int, default=1024,
                   help="tokens of the growth run (penalties + stop, 64 rows); 0 skips it")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated subset of: " + ", ".join(SCENARIOS))
    p.add_argument("--skip-hf", action="store_true", help="skip HF generate")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every measurement, in rounds; the one with the lowest median "
                        "host time counts (on a shared machine other load only adds time)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda (on CUDA every forward is synchronised, so a gap is the "
                        "host's work plus the sampler's kernels)")
    p.add_argument("--evict-mb", type=int, default=0,
                   help="write this many MiB at the end of every forward (timed as forward), so "
                        "every host gap starts from cold CPU caches, early or late in a run: "
                        "the growth then shows the host's work, not the K/V the CPU forward "
                        "pushed through the caches (0: off)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    args.rows = parse_int_list(p, args.rows, "--rows")
    args.window = parse_int_list(p, args.window, "--window")
    if len(args.window) != 2 or args.window[0] > args.window[1]:
        p.error("--window must be first,last with first <= last")
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown --scenarios {unknown}; choose from {list(SCENARIOS)}")
    if args.long_tokens and args.long_tokens < 2 * args.window[1]:
        p.error("--long-tokens must be 0 or at least twice the window's last token")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


class ForwardClock:
    """Times every forward of a model with hooks: (start, end, query tokens) per call."""

    def __init__(self, model: torch.nn.Module, device: str = "cpu", evict_mb: int = 0) -> None:
        self.calls: list[tuple[float, float, int]] = []
        self.cuda = torch.device(device).type == "cuda"
        # read at the end of every forward (timed as forward): each host gap starts with cold
        # CPU caches, however much K/V the forward touched (on a GPU it touches none of them)
        self._evict = torch.ones(evict_mb << 18) if evict_mb else None
        self._start = 0.0
        self.count_calls = False  # count the host's function calls between forwards instead
        self.counts: list[int] = []  # function calls in the gap before each forward
        self._count = 0
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if self.count_calls:
            sys.setprofile(None)
            self.counts.append(self._count)
        if self.cuda:
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def _post(self, module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
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
        for h in self._handles:
            h.remove()

    def decode_gaps(self, rows: int) -> tuple[list[float], list[float]]:
        """(host gap before each decode forward, that forward's time), in ms, for every
        decode forward whose predecessor was a decode forward too."""
        decode = [i for i, (_, _, t) in enumerate(self.calls) if t == rows]
        gaps, fwd = [], []
        for i in decode:
            if i > 0 and self.calls[i - 1][2] == rows:
                gaps.append((self.calls[i][0] - self.calls[i - 1][1]) * 1e3)
                fwd.append((self.calls[i][1] - self.calls[i][0]) * 1e3)
        return gaps, fwd

    def decode_counts(self, rows: int) -> list[float]:
        """Function calls in the gap before each decode forward that follows a decode
        forward (with `count_calls` on; the gaps of `decode_gaps`)."""
        return [float(self.counts[i]) for i, (_, _, t) in enumerate(self.calls)
                if t == rows and i > 0 and self.calls[i - 1][2] == rows]


@dataclass
class Figure:
    system: str
    scenario: str
    rows: int
    tokens: str  # the generated tokens whose decode steps were measured
    host_ms: float  # median host ms per decode step
    forward_ms: float  # median forward ms per decode step

    def row(self) -> list[Any]:
        return [self.system, self.scenario, self.rows, self.tokens, f"{self.host_ms:.3f}",
                f"{self.forward_ms:.3f}"]


def window(gaps: list[float], fwd: list[float], first: int, last: int) -> tuple[float, float]:
    """Median host and forward ms of the decode steps that sample tokens first..last: token 1
    is sampled from the prefill, decode forward k samples token k + 1, and gaps[j] (before
    decode forward j + 2) holds the sampling of token j + 2."""
    lo, hi = max(first - 2, 0), max(last - 1, 1)
    g, f = gaps[lo:hi], fwd[lo:hi]
    if not g:
        raise RuntimeError(f"no decode steps measured in tokens {first}..{last}")
    return statistics.median(g), statistics.median(f)


def run_batchgen(llm: Any, clock: ForwardClock, prompts: list[list[int]], scenario: str,
                 rows: int, max_tokens: int) -> tuple[list[float], list[float]]:
    from batchgen import SamplingParams

    n, kw = SCENARIOS[scenario]
    sp = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=None, **kw)
    ps = [{"prompt_token_ids": p} for p in prompts[:rows // n]]
    clock.reset()
    outs = llm.generate(ps, sp, use_tqdm=False)
    got = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert got == rows * max_tokens, f"{scenario}: {got} tokens, expected {rows * max_tokens}"
    return clock.decode_gaps(rows)


def run_hf(model: torch.nn.Module, clock: ForwardClock, prompts: list[list[int]], rows: int,
           max_tokens: int) -> tuple[list[float], list[float]]:
    ids, mask = left_pad(prompts[:rows], device=model.device)
    clock.reset()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False, pad_token_id=PAD_ID)
    return clock.decode_gaps(rows)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_logging()
    import tempfile

    from batchgen import LLM
    from batchgen.tools.make_tiny_model import make_tiny_model

    first, last = args.window
    max_rows = max(args.rows)
    prompts = make_prompts(max(max_rows, LONG_ROWS), *PROMPT_LEN, VOCAB, seed=0)
    figures: dict[tuple[str, str, int, str], Figure] = {}

    def keep(fig: Figure) -> None:
        """The run with the lowest median host time of each measurement."""
        key = (fig.system, fig.scenario, fig.rows, fig.tokens)
        if key not in figures or fig.host_ms < figures[key].host_ms:
            figures[key] = fig

    with tempfile.TemporaryDirectory(prefix="batchgen-host-") as tmp:
        make_tiny_model(tmp, family="llama", vocab_size=VOCAB, seed=0, hidden_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128,
                        max_position_embeddings=max(2048, args.long_tokens + 64))
        llm = LLM(tmp, max_num_seqs=max(max_rows, LONG_ROWS), max_model_len=max(args.long_tokens, last) + 64,
                  enable_prefix_caching=False, seed=0, device=args.device)
        clock = ForwardClock(llm.model, args.device, args.evict_mb)
        run_batchgen(llm, clock, prompts, "greedy", 16, 8)  # warm-up
        for _ in range(args.repeats):
            for scenario in args.scenarios:
                for rows in args.rows:
                    gaps, fwd = run_batchgen(llm, clock, prompts, scenario, rows, last)
                    keep(Figure("batchgen", scenario, rows, f"{first}-{last}",
                                *window(gaps, fwd, first, last)))
            if args.long_tokens:
                _growth_run(llm, clock, prompts, args, keep)
        calls = count_growth(llm, clock, prompts, args) if args.long_tokens else None
        clock.close()
        if not args.skip_hf:
            hf = load_hf_model(tmp, torch.float32, args.device)
            clock = ForwardClock(hf, args.device, args.evict_mb)
            run_hf(hf, clock, prompts, 8, 4)  # warm-up
            for _ in range(args.repeats):
                for rows in args.rows:
                    gaps, fwd = run_hf(hf, clock, prompts, rows, last)
                    keep(Figure("HF generate", "greedy", rows, f"{first}-{last}",
                                *window(gaps, fwd, first, last)))
            clock.close()
    report(args, list(figures.values()), calls)


def _growth_run(llm: Any, clock: ForwardClock, prompts: list[list[int]],
                args: argparse.Namespace, keep: Any) -> None:
    """One long run (penalties + stop, 64 rows): host ms early and late in it."""
    first, last = args.window
    long_tokens = args.long_tokens
    gaps, fwd = run_batchgen(llm, clock, prompts, "penalties + stop", LONG_ROWS, long_tokens)
    early = window(gaps, fwd, first, last)
    late = window(gaps, fwd, long_tokens - (last - first), long_tokens)
    keep(Figure("batchgen", "penalties + stop", LONG_ROWS, f"{first}-{last}", *early))
    keep(Figure("batchgen", "penalties + stop", LONG_ROWS,
                f"{long_tokens - (last - first)}-{long_tokens}", *late))


def count_growth(llm: Any, clock: ForwardClock, prompts: list[list[int]],
                 args: argparse.Namespace) -> tuple[float, float]:
    """The growth run once more, untimed, counting the host's function calls per decode step
    (a profile hook): median calls early and late. Unlike time, the count does not depend on
    the machine's load or its caches: flat means the host's work per step does not grow."""
    first, last = args.window
    long_tokens = args.long_tokens
    clock.count_calls = True
    try:
        run_batchgen(llm, clock, prompts, "penalties + stop", LONG_ROWS, long_tokens)
    finally:
        sys.setprofile(None)
        clock.count_calls = False
    counts = clock.decode_counts(LONG_ROWS)
    early = window(counts, counts, first, last)[0]
    late = window(counts, counts, long_tokens - (last - first), long_tokens)[0]
    return early, late


def report(args: argparse.Namespace, figures: list[Figure],
           calls: tuple[float, float] | None = None) -> None:
    """The table (and the JSON) of the kept figures, the growth of the long run's host time
    (late / early, each the best of the repeats) and of its function calls per step."""
    first, last = args.window
    long_tokens = args.long_tokens
    late = f"{long_tokens - (last - first)}-{long_tokens}"
    long_run = {f.tokens: f.host_ms for f in figures
                if f.scenario == "penalties + stop" and f.rows == LONG_ROWS}
    growth = long_run[late] / long_run[f"{first}-{last}"] if late in long_run else None
    info = machine_info(args.device)
    print(machine_line(info))
    print(markdown_table(["system", "scenario", "rows", "tokens", "host ms / step",
                          "forward ms / step"], [f.row() for f in figures]))
    if growth is not None:
        print(f"growth (penalties + stop, 64 rows): host ms at tokens "
              f"{long_tokens - (last - first)}-{long_tokens} / at {first}-{last} = {growth:.2f}x")
    if calls is not None:
        print(f"function calls per decode step (penalties + stop, 64 rows): {calls[0]:.0f} at "
              f"tokens {first}-{last}, {calls[1]:.0f} at {late} ({calls[1] / calls[0]:.2f}x)")
    if args.json:
        write_json(args.json, {"machine": info, "args": vars(args),
                               "figures": [f.__dict__ for f in figures], "growth": growth,
                               "calls_per_step": calls})


if __name__ == "__main__":
    main()

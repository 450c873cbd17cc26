"""What a user meets first: `import batchgen`, `batchgen --help` and argument errors import
neither torch nor transformers' model code (fresh interpreters, so nothing a test imported
counts); `from batchgen import LLM` brings torch but not transformers' model code, which loads
with the first model; the one-line messages name the flag given; the thread warning; the
progress bar's rates are what they say (input: prompt tokens per second of prefill)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.progress import CallMeter, format_rate
from batchgen.threads import thread_advice

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "transformers.modeling_utils", "torch.distributed.tensor",
         "datasets", "pyarrow", "ray", "lm_eval", "xgrammar", "flashinfer")


def loaded_after(code: str) -> tuple[list[str], str]:
    """The HEAVY modules a fresh interpreter holds after running `code`, and its stderr."""
    probe = (f"import sys\n{code}\nimport json\n"
             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


def run_cli(argv: list[str]) -> str:
    return ("from batchgen.cli import main\ntry:\n"
            f"    code = main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
            "print('exit', code, file=sys.stderr)")


def test_import_batchgen_is_light() -> None:
    loaded, _ = loaded_after("import batchgen\nfrom batchgen import SamplingParams, "
                             "BeamSearchParams, TextPrompt, TokensPrompt, Logprob")
    assert loaded == []


def test_llm_brings_torch_but_not_transformers_model_code() -> None:
    loaded, _ = loaded_after("from batchgen import LLM")
    assert "torch" in loaded
    assert "transformers.modeling_utils" not in loaded
    assert "torch.distributed.tensor" not in loaded


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["run-batch", "--help"],
                                  ["kv-plan", "--help"], ["bench", "--help"], ["eval", "--help"]])
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    loaded, err = loaded_after(run_cli(argv))
    assert loaded == [] and "exit 0" in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "m", "--input", "x.jsonl", "--output", "o",
      "--kv-cache-memory", "4gigs"], "batchgen: error: --kv-cache-memory must be a positive "
                                     "size"),
    (["run-batch", "-i", __file__, "-o", "o.jsonl", "--model", "m", "--kv-cache-memory",
      "4gigs"], "batchgen: error: --kv-cache-memory must be a positive size"),
    (["eval", "--model", "m", "--kv-cache-memory", "4gigs"], "--kv-cache-memory must be"),
    (["kv-plan", "--model", "m", "--memory", "4gigs"], "--memory must be a positive size"),
    (["run-batch", "-i", "missing.jsonl", "-o", "o.jsonl", "--model", "m"],
     "batchgen: error: -i 'missing.jsonl' is not a file"),
    (["run-batch", "-i", __file__, "-o", __file__, "--model", "m"],
     f"batchgen: error: -o {__file__!r} exists: pass --resume"),
    (["generate", "--model", "m"], "the following arguments are required: --input, --output"),
])
def test_argument_errors_are_one_line_and_import_nothing_heavy(argv: list[str], message: str
                                                               ) -> None:
    loaded, err = loaded_after(run_cli(argv))
    lines = err.splitlines()
    assert lines[-1] == "exit 2" and len(lines) == 2 and message in lines[0], err
    assert loaded == []


def test_thread_advice() -> None:
    assert thread_advice(1, 2, 5.0) is None  # one thread never waits on a sibling
    assert thread_advice(2, 2, 1.0) is None  # this process alone
    busy = thread_advice(2, 2, 2.7)
    assert busy is not None and "load average 2.7 on 2 cores" in busy
    assert "OMP_NUM_THREADS" in busy and "torch.set_num_threads" in busy
    over = thread_advice(8, 2, None)
    assert over is not None and over.startswith("torch uses 8 CPU threads but this process "
                                                "may run on 2 cores")


def test_rates_keep_small_figures() -> None:
    assert [format_rate(x) for x in (0, 0.35, 3.456, 12.3, 4729.4)] == [
        "0", "0.35", "3.5", "12", "4,729"]


class Recorder:
    """A tqdm-like bar that keeps its postfixes."""

    def __init__(self, **kw) -> None:
        self.total, self.n, self.postfixes = kw.get("total"), 0, []

    def update(self, k: int) -> None:
        self.n += k

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfixes.append(text)

    def close(self) -> None:
        pass


def test_the_bar_shows_prompt_tokens_per_second_of_prefill(tiny_model_factory,
                                                           monkeypatch) -> None:
    """With a clock that ticks one second per step, input tok/s is the prompt tokens over the
    steps that computed them, however long the decode steps after them take."""
    from batchgen import LLM, SamplingParams
    from batchgen import llm as llm_module

    llm = LLM(str(tiny_model_factory("llama")), device="cpu", num_kv_blocks=128)
    bars: list[Recorder] = []
    ticks = iter(range(10_000))
    monkeypatch.setattr(llm_module, "CallMeter", lambda *a: CallMeter(
        *a, clock=lambda: float(next(ticks))))
    llm.generate(["the cat", "a dog runs"], SamplingParams(max_tokens=20, ignore_eos=True),
                 use_tqdm=lambda **kw: bars.append(Recorder(**kw)) or bars[-1])
    prompt = llm.kv_stats().prompt_tokens_computed
    steps = 20  # one prefill step (both prompts fit), then 19 decode steps
    assert bars[0].postfixes[-1] == (f"input: {format_rate(prompt / 1)} tok/s, "
                                     f"output: {format_rate(40 / steps)} tok/s")
    meter = CallMeter(llm.engine, 1, False)
    assert meter.postfix(meter.clock()).startswith("output: ")  # no input figure yet

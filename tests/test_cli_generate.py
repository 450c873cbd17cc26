"""`batchgen generate` / `batchgen beam`: a real subprocess killed with SIGKILL and then
interrupted with Ctrl-C (SIGINT) mid-run resumes to exactly the rows of an uninterrupted run
(also when only the clock closed its shards); a row that cannot run stops the job naming its
row and line, or is skipped with `--on-error skip`; bad flags and inputs print one line and
exit with code 2 before the model is loaded; `--help` shows every default."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch.distributed as dist

from batchgen.cli import build_parser, main
from batchgen.cli.engine import engine_kwargs
from batchgen.data.shards import MANIFEST

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
ROWS_PER_SHARD = 20  # small shards: a short job still spans many, so signals land mid-run
WORDS = "the a cat dog runs jumps over under blue red green house tree river".split()


def write_jsonl(path: Path, count: int) -> Path:
    with path.open("w") as f:
        for i in range(count):
            text = " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(2 + i % 9))
            f.write(json.dumps({"question": text, "k": i}) + "\n")
    return path


def command(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "batchgen", "generate", "--model", str(model), "--input",
            str(data), "--prompt-column", "question", "--n", "4", "--temperature", "0.9",
            "--max-tokens", "12", "--seed", "3", "--rows-per-shard", str(ROWS_PER_SHARD),
            "--max-num-seqs", "64", "--output", str(out), "--quiet", *extra]


def shards(out: Path) -> int:
    return len(list(out.glob("part-*.parquet"))) if out.is_dir() else 0


def start_then_signal(cmd: list[str], out: Path, min_shards: int, sig: int
                      ) -> subprocess.CompletedProcess:
    """Run `cmd`, send `sig` once `out` holds `min_shards` shards, and wait for it to end."""
    # a background shell starts pytest with SIGINT ignored, which a child would inherit
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 120
    while shards(out) < min_shards and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the job ended before it could be interrupted: make it longer"
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C's default action, so Python installs its handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def rows_by_id(out: Path) -> list[dict]:
    table = pq.read_table(out)
    return sorted(table.to_pylist(), key=lambda r: r["row_id"])


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model, data, output) of one uninterrupted job, run in-process (no interpreter start-up)
    and shared by the kill tests below as the rows every resumed job must equal."""
    model = tiny_model_factory("llama", eos_boost=0.06)
    folder = tmp_path_factory.mktemp("uninterrupted")
    data, whole = write_jsonl(folder / "in.jsonl", 800), folder / "whole"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(command(model, data, whole)[3:]) == 0
    assert "batchgen: 800 rows, 3200 samples" in out.getvalue()
    return model, data, whole


def test_sigkill_then_ctrl_c_then_resume_equals_an_uninterrupted_run(uninterrupted,
                                                                      tmp_path: Path) -> None:
    model, data, whole = uninterrupted
    broken = tmp_path / "broken"
    killed = start_then_signal(command(model, data, broken), broken, 3, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    manifest = json.loads((broken / MANIFEST).read_text())
    # 3 shards were on disk; the kill may land before the third is listed
    assert not manifest["complete"] and 2 * ROWS_PER_SHARD <= manifest["rows"] < 800

    interrupted = start_then_signal(command(model, data, broken, "--resume"), broken,
                                    shards(broken) + 3, signal.SIGINT)
    assert interrupted.returncode == 130, interrupted.stderr[-2000:]
    assert "interrupted; the finished rows are in" in interrupted.stderr
    assert "rerun with --resume" in interrupted.stderr
    after_ctrl_c = json.loads((broken / MANIFEST).read_text())
    assert not after_ctrl_c["complete"] and manifest["rows"] < after_ctrl_c["rows"] < 800

    resumed = subprocess.run(command(model, data, broken, "--resume"), cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((broken / MANIFEST).read_text())["complete"]
    expected, got = rows_by_id(whole), rows_by_id(broken)
    assert [r["row_id"] for r in got] == list(range(800))  # none lost, none twice
    assert got == expected  # row by row: inputs, prompt lengths, every sample
    assert file_bytes(broken) == file_bytes(whole)  # and file by file: the same bytes


def file_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# ---- exit code 2 before the model loads -------------------------------------------------------
@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "in.jsonl", 5)


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("extra, message", [
    (["--prompt-column", "prompt"], "--prompt-column 'prompt' is not a column of"),
    (["--messages-column", "messages"], "--messages-column 'messages' is not a column of"),
    (["--prompt-column", "question", "--n", "0"], "n must be"),
    (["--prompt-column", "question", "--rows-per-shard", "0"], "--rows-per-shard must be >= 1"),
    (["--prompt-column", "question", "--temperature", "-1"], "temperature"),
    (["--prompt-column", "question", "--chat-template", "/nonexistent/t.jinja"],
     "--chat-template '/nonexistent/t.jinja' cannot be read"),
    (["--prompt-column", "question", "--tensor-parallel-size", "0"],
     "--tensor-parallel-size must be >= 1, got 0"),
    (["--prompt-column", "question", "--kv-cache-memory", "4gigs"],
     "--kv-cache-memory must be a positive size: plain bytes"),
    (["--prompt-column", "question", "--shard-seconds", "-1"],
     "--shard-seconds must be >= 0 (0: by rows only), got -1.0"),
])
def test_bad_values_exit_2_before_loading(jsonl: Path, tmp_path: Path, extra: list[str],
                                          message: str, capsys) -> None:
    """--model names no folder: each error is found before the model would load."""
    code, err = run_main(["generate", "--model", str(tmp_path / "no-model"), "--input",
                          str(jsonl), "--output", str(tmp_path / "out"), *extra], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("batchgen: error: "), err
    assert message in err
    assert not (tmp_path / "out").exists()


def test_bad_inputs_exit_2(tmp_path: Path, jsonl: Path, capsys) -> None:
    model = tmp_path / "no-model"
    cases = {
        "does not exist": tmp_path / "missing.jsonl",
        "data has no rows": tmp_path / "empty.parquet",
        "cannot be read": tmp_path / "broken.jsonl",
        "must be a .jsonl/.json/.parquet/.csv file": tmp_path / "notes.txt",
    }
    import pyarrow as pa
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), cases["data has no rows"])
    cases["cannot be read"].write_text('{"question": "a"}\n{oops\n')
    cases["must be a .jsonl/.json/.parquet/.csv file"].write_text("hi")
    for message, path in cases.items():
        code, err = run_main(["generate", "--model", str(model), "--input", str(path),
                              "--output", str(tmp_path / "out"), "--prompt-column", "question"],
                             capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, (message, err)


def test_existing_output_without_resume_exits_2(tiny_model_factory, jsonl: Path,
                                                tmp_path: Path, capsys) -> None:
    model = tiny_model_factory("llama", eos_boost=0.06)
    out = tmp_path / "out"
    argv = ["generate", "--model", str(model), "--input", str(jsonl), "--output", str(out),
            "--prompt-column", "question", "--max-tokens", "4", "--quiet"]
    assert main(argv) == 0
    assert "batchgen: 5 rows, 5 samples" in capsys.readouterr().out
    code, err = run_main([*argv[:1], "--model", str(tmp_path / "no-model"), *argv[3:]], capsys)
    assert code == 2 and "already holds shards of a job: pass resume=True (--resume)" in err
    code, err = run_main([*argv, "--resume", "--n", "2"], capsys)
    assert code == 2 and "holds a different job (params differ)" in err
    assert main([*argv, "--resume"]) == 0  # the finished job resumes to itself


def test_output_format_jsonl_holds_the_parquet_rows(tiny_model_factory, jsonl: Path,
                                                   tmp_path: Path, capsys) -> None:
    from batchgen.data.writers import WRITERS

    model = tiny_model_factory("llama", eos_boost=0.06)
    argv = ["generate", "--model", str(model), "--input", str(jsonl), "--prompt-column",
            "question", "--n", "2", "--max-tokens", "4", "--rows-per-shard", "2", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "pq")]) == 0
    assert main([*argv, "--output", str(tmp_path / "js"), "--output-format", "jsonl"]) == 0
    assert "batchgen: 5 rows, 10 samples" in capsys.readouterr().out
    files = sorted((tmp_path / "js").glob("part-*"))
    assert [f.name for f in files] == [f"part-{i:05d}.jsonl" for i in range(3)]
    got = sorted((r for f in files for r in WRITERS["jsonl"].read(f).to_pylist()),
                 key=lambda r: r["row_id"])
    assert got == rows_by_id(tmp_path / "pq")
    code, err = run_main([*argv, "--output", str(tmp_path / "js"), "--resume"], capsys)
    assert code == 2 and "holds a different job (output_format differ)" in err


@pytest.mark.parametrize("command", [["generate"], ["beam", "--beam-width", "2"]])
def test_tensor_parallel_size_reaches_the_llm_arguments(command: list[str]) -> None:
    argv = [*command, "--model", "m", "--input", "x.jsonl", "--output", "o"]
    assert engine_kwargs(build_parser().parse_args(argv), None)["tensor_parallel_size"] == 1
    args = build_parser().parse_args([*argv, "--tensor-parallel-size", "2"])
    assert engine_kwargs(args, None)["tensor_parallel_size"] == 2


def test_swap_flags_reach_the_llm_arguments() -> None:
    argv = ["generate", "--model", "m", "--input", "x.jsonl", "--output", "o"]
    kw = engine_kwargs(build_parser().parse_args(argv), None)
    assert (kw["swap_space"], kw["preemption_mode"]) == (0, None)
    args = build_parser().parse_args([*argv, "--swap-space", "1.5", "--preemption-mode",
                                      "recompute"])
    kw = engine_kwargs(args, None)
    assert (kw["swap_space"], kw["preemption_mode"]) == (1.5, "recompute")


def test_the_async_scheduling_and_logprobs_mode_flags_reach_the_llm_arguments(
        jsonl: Path, tmp_path: Path, capsys) -> None:
    argv = ["generate", "--model", "m", "--input", "x.jsonl", "--output", "o"]
    kw = engine_kwargs(build_parser().parse_args(argv), None)
    assert (kw["async_scheduling"], kw["logprobs_mode"]) == (None, "raw_logprobs")
    for flag, value in (("--async-scheduling", True), ("--no-async-scheduling", False)):
        args = build_parser().parse_args([*argv, flag])
        assert engine_kwargs(args, None)["async_scheduling"] is value
    for command in (argv, ["run-batch", "-i", "x.jsonl", "-o", "o.jsonl", "--model", "m"]):
        args = build_parser().parse_args([*command, "--logprobs-mode", "processed_logprobs"])
        assert engine_kwargs(args, None)["logprobs_mode"] == "processed_logprobs"
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args([*argv, "--logprobs-mode", "processed"])
    assert "--logprobs-mode: invalid choice: 'processed'" in capsys.readouterr().err
    # beams sum log-probabilities: a logits mode is refused before the model would load
    code, err = run_main(["beam", "--model", str(tmp_path / "no-model"), "--input", str(jsonl),
                          "--output", str(tmp_path / "out"), "--beam-width", "2",
                          "--logprobs-mode", "raw_logits"], capsys)
    assert code == 2 and "--logprobs-mode must be one of ('raw_logprobs', 'processed_logprobs') " \
        "for beam search" in err, err


def test_two_ranks_write_the_rows_of_one(tiny_model_factory, jsonl: Path, tmp_path: Path,
                                         capsys) -> None:
    """A real --tensor-parallel-size 2 job (one worker process, a few seconds to start):
    greedy rows equal the one-process job's; the worker and the process group end with it."""
    model = tiny_model_factory("llama", eos_boost=0.06)
    argv = ["generate", "--model", str(model), "--input", str(jsonl), "--prompt-column",
            "question", "--temperature", "0", "--max-tokens", "6", "--device", "cpu", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "one")]) == 0
    assert main([*argv, "--output", str(tmp_path / "two"), "--tensor-parallel-size", "2"]) == 0
    assert "batchgen: 5 rows, 5 samples" in capsys.readouterr().out
    gc.collect()
    assert not dist.is_initialized()
    two, one = rows_by_id(tmp_path / "two"), rows_by_id(tmp_path / "one")
    logprobs = [o.pop("cumulative_logprob") for r in (*two, *one) for o in r["outputs"]]
    assert two == one  # tokens, text, finish reasons: the ranks sum in another order, so
    assert logprobs[:5] == pytest.approx(logprobs[5:], rel=1e-5)  # logprobs agree to ~1e-7


def test_ray_actors_need_a_gpu_per_rank(jsonl: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("ray.data")
    code, err = run_main(["generate", "--model", str(tmp_path / "no-model"), "--input",
                          str(jsonl), "--output", str(tmp_path / "out"), "--prompt-column",
                          "question", "--ray", "--tensor-parallel-size", "2",
                          "--gpus-per-actor", "1"], capsys)
    assert code == 2 and "--gpus-per-actor must be 0 (CPU actors) or >= " \
        "--tensor-parallel-size (2, a GPU per rank), got 1.0" in err, err


def test_beam_command(tiny_model_factory, jsonl: Path, tmp_path: Path, capsys) -> None:
    from batchgen import LLM, BeamSearchParams

    model = tiny_model_factory("llama", eos_boost=0.06)
    out = tmp_path / "beams"
    assert main(["beam", "--model", str(model), "--input", str(jsonl), "--output", str(out),
                 "--prompt-column", "question", "--beam-width", "3", "--max-tokens", "5",
                 "--quiet"]) == 0
    assert "batchgen: 5 rows, 15 samples" in capsys.readouterr().out
    rows = rows_by_id(out)
    prompts = [json.loads(line)["question"] for line in jsonl.read_text().splitlines()]
    expected = LLM(str(model), device="cpu").beam_search(
        prompts, BeamSearchParams(beam_width=3, max_tokens=5), use_tqdm=False)
    for row, want in zip(rows, expected):
        assert [o["token_ids"] for o in row["outputs"]] == [s.token_ids for s in want.sequences]


def test_beam_command_takes_the_beam_controls(tiny_model_factory, jsonl: Path, tmp_path: Path,
                                              capsys) -> None:
    from batchgen import LLM, BeamSearchParams

    model = tiny_model_factory("llama", eos_boost=0.06)
    out = tmp_path / "beams"
    argv = ["beam", "--model", str(model), "--input", str(jsonl), "--output", str(out),
            "--prompt-column", "question", "--beam-width", "4", "--max-tokens", "6", "--quiet",
            "--no-repeat-ngram-size", "2", "--repetition-penalty", "1.3", "--min-tokens", "2",
            "--bad-word", "the", "--num-beam-groups", "2", "--diversity-penalty", "0.5"]
    assert main(argv) == 0
    rows = rows_by_id(out)
    prompts = [json.loads(line)["question"] for line in jsonl.read_text().splitlines()]
    expected = LLM(str(model), device="cpu").beam_search(prompts, BeamSearchParams(
        beam_width=4, max_tokens=6, no_repeat_ngram_size=2, repetition_penalty=1.3,
        min_tokens=2, bad_words=["the"], num_beam_groups=2, diversity_penalty=0.5),
        use_tqdm=False)
    for row, want in zip(rows, expected):
        assert [o["token_ids"] for o in row["outputs"]] == [s.token_ids for s in want.sequences]
        assert [o["score"] for o in row["outputs"]] == [s.score for s in want.sequences]
    assert main([*argv, "--resume"]) == 0  # the finished job resumes to itself
    code, err = run_main([*argv, "--resume", "--diversity-penalty", "0.6"], capsys)
    assert code == 2 and "holds a different job (params differ)" in err
    code, err = run_main([*argv[:-4], "--num-beam-groups", "3"], capsys)
    assert code == 2 and "num_beam_groups must be an integer >= 1 that divides" in err, err


@pytest.mark.parametrize("argv", [
    ["generate", "--input", "x.jsonl", "--output", "o"],  # no --model
    ["generate", "--model", "m", "--input", "x", "--output", "o", "--n", "two"],
    ["beam", "--model", "m", "--input", "x", "--output", "o"],  # no --beam-width
    ["generate", "--model", "m", "--input", "x", "--output", "o", "--output-format", "csv"],
    ["generate", "--model", "m", "--input", "x", "--output", "o", "--prompt-column", "a",
     "--messages-column", "b"],
])
def test_bad_flags_exit_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("batchgen: error: ")


# ---- shards closed by the clock; rows that cannot run; --help --------------------------------
def test_a_shard_closed_by_time_survives_sigkill(uninterrupted, tmp_path: Path) -> None:
    """No shard fills its rows here (--rows-per-shard 100000): only --shard-seconds writes
    them, and what they hold survives a SIGKILL and resumes to the uninterrupted rows."""
    model, data, whole = uninterrupted
    broken = tmp_path / "broken"
    by_time = ["--rows-per-shard", "100000", "--shard-seconds", "0.3"]
    killed = start_then_signal(command(model, data, broken, *by_time), broken, 1,
                               signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    resumed = subprocess.run(command(model, data, broken, *by_time, "--resume"), cwd=ROOT,
                             env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    manifest = json.loads((broken / MANIFEST).read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 1  # written again, whole
    assert rows_by_id(broken) == rows_by_id(whole)


def test_on_error(tiny_model_factory, tmp_path: Path, capsys) -> None:
    model = tiny_model_factory("llama", eos_boost=0.06)
    capsys.readouterr()  # (a model made here says so)
    data = write_jsonl(tmp_path / "in.jsonl", 6)
    lines = data.read_text().splitlines()
    lines[3] = json.dumps({"question": "word " * 1500, "k": 3})  # over max_model_len (1024)
    data.write_text("\n".join(lines) + "\n")
    argv = ["generate", "--model", str(model), "--input", str(data), "--prompt-column",
            "question", "--max-tokens", "4", "--max-model-len", "1024", "--quiet"]
    code, err = run_main([*argv, "--output", str(tmp_path / "fail")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"batchgen: error: row 3 (line 4 of {data}): prompt has " in err
    assert "tokens; max_model_len is 1024, leaving no room to generate" in err
    assert main([*argv, "--output", str(tmp_path / "skip"), "--on-error", "skip"]) == 0
    out = capsys.readouterr().out
    assert "batchgen: 6 rows, 5 samples" in out and "; 1 row skipped with an error" in out
    assert "stopped at --max-tokens 4" in out  # (the tiny model rarely stops by itself)
    rows = rows_by_id(tmp_path / "skip")
    assert [r["error"] is None for r in rows] == [True, True, True, False, True, True]
    assert rows[3]["error"].startswith(f"row 3 (line 4 of {data}): prompt has ")


def test_help_shows_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("(raise it for full answers) (default: 16)", "written once they finish (default: 256)",
                  "(0: when full) (default: 60.0)", "and go on (default: fail)",
                  "--block-size BLOCK_SIZE (default: 16)", "--n N samples per row (default 1)"):
        assert shown in text, shown

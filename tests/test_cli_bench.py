"""`batchgen bench`: the offline throughput benchmark runs from the package, its figures add
up (every sample generates exactly --output-len tokens), and bad flags exit with code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen.cli import main
from batchgen.cli.bench import BOS_ID, FIRST_REGULAR_ID, random_prompts

SMALL = ["--num-prompts", "3", "--output-len", "4", "--min-prompt-len", "4",
         "--max-prompt-len", "20", "--block-size", "8", "--max-num-seqs", "8"]


def run_bench(argv: list[str], tmp_path: Path, capsys) -> tuple[dict, str]:
    """main(["bench", ...]) writing JSON; returns the JSON and stdout."""
    out = tmp_path / "bench.json"
    code = main(["bench", *argv, "--json", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    return json.loads(out.read_text()), stdout


def check_figures(d: dict, num_prompts: int, n: int, output_len: int) -> None:
    assert d["output_tokens"] == num_prompts * n * output_len
    assert d["num_prompts"] == num_prompts and d["n"] == n
    assert len(d["wall_s_all"]) == d["args"]["repeats"] and d["wall_s"] == min(d["wall_s_all"])
    for key in ("wall_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                "prompt_tokens"):
        assert d[key] > 0, key
    assert d["total_tokens_per_s"] == pytest.approx(
        (d["prompt_tokens"] + d["output_tokens"]) / d["wall_s"])
    assert d["kv_stats"]["num_blocks"] > 0 and d["kv_stats"]["peak_blocks_in_use"] > 0
    assert d["kv_stats"]["preemptions"] >= 0
    assert d["capacity_line"].startswith(f"KV cache: {d['kv_stats']['num_blocks']} blocks")
    assert {"torch", "torch_threads", "device"} <= set(d["machine"])


def test_bench_random_model(tmp_path: Path, capsys) -> None:
    """Without --model: the benchmarks' default random Llama in a temporary folder."""
    d, stdout = run_bench(SMALL, tmp_path, capsys)
    check_figures(d, 3, 1, 4)
    assert "random-weight Llama (hidden 256, 4 layers, 8/2 q/kv heads" in d["model"]
    assert 3 * 4 <= d["prompt_tokens"] <= 3 * 20
    for text in ("requests/s", "output tokens/s", "total tokens/s", "KV: ", "machine: torch"):
        assert text in stdout


def test_bench_given_model_n_samples_repeats(tiny_model_factory, tmp_path: Path,
                                             capsys) -> None:
    path = tiny_model_factory("llama")
    d, _ = run_bench([*SMALL, "--model", str(path), "--n", "2", "--repeats", "2",
                      "--device", "cpu", "--dtype", "float32"], tmp_path, capsys)
    check_figures(d, 3, 2, 4)
    assert d["model"] == str(path)
    assert d["kv_stats"]["prefix_hit_tokens"] == 0  # each timed run computes its prompts


def test_random_prompts() -> None:
    prompts = random_prompts(20, 5, 9, 100, seed=3)
    assert prompts == random_prompts(20, 5, 9, 100, seed=3) != random_prompts(20, 5, 9, 100, 4)
    assert all(5 <= len(p) <= 9 and p[0] == BOS_ID for p in prompts)
    assert all(FIRST_REGULAR_ID <= t < 100 for p in prompts for t in p[1:])


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--output-len", "0"], "--output-len must be >= 1"),
    (["--n", "0"], "--n must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--min-prompt-len", "10", "--max-prompt-len", "5"], "--min-prompt-len"),
    (["--max-prompt-len", "2000"], "must be <= max_model_len (1024)"),
    (["--block-size", "0"], "block_size"),
    (["--device", "tpu"], "device"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--tensor-parallel-size", "4"], "tensor_parallel_size=4 must divide"),  # 2 KV heads
])
def test_bench_bad_values_exit_2(tiny_model_factory, argv: list[str], message: str,
                                 capsys) -> None:
    code = main(["bench", "--model", str(tiny_model_factory("llama")), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith("batchgen: error: "), err
    assert message in err


def test_bench_missing_model_or_json_folder_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["bench", "--model", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("batchgen: error: --model must be")
    assert main(["bench", "--json", str(tmp_path / "missing" / "out.json")]) == 2
    assert capsys.readouterr().err.startswith("batchgen: error: --json: folder")


@pytest.mark.parametrize("argv", [["--num-prompts", "abc"], ["--dtype", "int8"], ["--bogus"]])
def test_bench_bad_flags_exit_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1

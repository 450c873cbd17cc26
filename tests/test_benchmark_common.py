"""The benchmarks' shared harness (benchmarks/common.py): interleaved timing, results, checks,
flags, prompts, the model folder and tables."""

import argparse
import types

import pytest

from benchmarks import common as h


def test_interleaved_repeats_runs_rounds_in_order():
    order = []

    def make(name):
        counter = iter(range(100))
        return h.Contender(name, lambda: (order.append(name), f"{name}{next(counter)}")[1],
                           lambda: ("", {}))

    out = h.interleaved_repeats([make("a"), make("b"), make("c")], 3)
    assert order == ["a", "b", "c"] * 3
    assert [first for first, _ in out] == ["a0", "b0", "c0"]  # the first run's result
    assert all(len(walls) == 3 and min(walls) >= 0 for _, walls in out)


def test_a_system_that_measures_itself_reports_its_own_wall_time():
    walls = iter([5.0, 2.0, 3.0])
    c = h.Contender("child", lambda: h.Measured([[1, 2]], next(walls)))
    [(first, times)] = h.interleaved_repeats([c], 3)
    assert first == [[1, 2]] and times == [5.0, 2.0, 3.0]


def run_args(repeats=2):
    return argparse.Namespace(repeats=repeats, device="cpu")


def test_run_contenders_keeps_the_fastest_run_and_closes_every_contender(capsys):
    closed = []
    walls = iter([0.5, 0.2])
    c = h.Contender("sys", lambda: h.Measured([[1, 2, 3], [4]], next(walls)),
                    lambda: ("cfg", {"k": 1}), lambda: closed.append("sys"))
    [(res, tokens)] = h.run_contenders([c], run_args(), prompt_tokens=10)
    assert closed == ["sys"] and tokens == [[1, 2, 3], [4]]
    assert (res.system, res.config, res.wall_s, res.output_tokens) == ("sys", "cfg", 0.2, 4)
    assert res.extra == {"k": 1, "wall_s_all": [0.5, 0.2]}
    assert res.output_tok_s == pytest.approx(20.0)
    assert res.to_dict()["total_tok_s"] == pytest.approx(70.0)
    assert "  sys (cfg): 0.50, 0.20 s" in capsys.readouterr().out


def test_run_contenders_closes_them_when_a_run_fails():
    closed = []

    def boom():
        raise RuntimeError("boom")

    cs = [h.Contender("a", lambda: [[1]], close=lambda: closed.append("a")),
          h.Contender("b", boom, close=lambda: closed.append("b"))]
    with pytest.raises(RuntimeError, match="boom"):
        h.run_contenders(cs, run_args(), 0)
    assert closed == ["a", "b"]


def test_run_contenders_asserts_the_expected_token_counts():
    ok = h.Contender("ok", lambda: [[1, 2], [3, 4]])
    short = h.Contender("short", lambda: [[1, 2], [3]], lambda: ("cfg", {}))
    assert h.run_contenders([ok], run_args(1), 0, expect=(2, 2))[0][1] == [[1, 2], [3, 4]]
    with pytest.raises(AssertionError, match=r"short \(cfg\): 2 rows of \[1, 2\] tokens"):
        h.run_contenders([short], run_args(1), 0, expect=(2, 2))


def test_sentences_and_questions_are_fixed_english_prompts():
    a = h.sentences(5, 4, 8, seed=1)
    assert a == h.sentences(5, 4, 8, seed=1) != h.sentences(5, 4, 8, seed=2)
    assert all(4 <= len(s.split()) <= 8 and s[0].isupper() and s[-1] in ".?!" for s in a)
    assert len(h.QUESTIONS) == 20 and all(isinstance(q, str) and q for q in h.QUESTIONS)


def result(system, wall, tokens=100, **extra):
    return h.Result(system, "", wall, tokens, 0, extra)


def test_versus_marks_the_fastest_hf_batch_size_and_gives_the_ratios():
    rs = [result("batchgen", 1.0), result("HF generate", 4.0, batch_size=8),
          result("HF generate", 2.0, batch_size=32), result("HF generate_batch", 5.0)]
    labels, s, line = h.versus(rs)
    assert labels == ["batchgen", "HF generate", "HF generate (best)", "HF generate_batch"]
    assert s["hf_generate_best_batch_size"] == 32
    assert s["batchgen_over_hf_generate"] == pytest.approx(2.0)
    assert s["batchgen_over_generate_batch"] == pytest.approx(5.0)
    assert line == ("batchgen / HF generate (best, batch 32): 2.00x, "
                    "batchgen / HF generate_batch: 5.00x")
    labels, s, line = h.versus(rs[:2])  # one batch size: nothing to mark, no generate_batch
    assert labels == ["batchgen", "HF generate"] and "batchgen_over_generate_batch" not in s
    assert line == "batchgen / HF generate (best, batch 8): 4.00x"


def test_agreement_counts_identical_rows_and_the_mean_common_prefix():
    a = [[1, 2, 3, 4], [5, 6], [7]]
    b = [[1, 2, 3, 4], [5, 0], [8, 9]]
    assert h.agreement(a, b) == {"identical": 1, "of": 3,
                                 "mean_prefix_frac": pytest.approx((1 + 0.5 + 0) / 3)}
    assert "1/3 identical, mean common prefix 50.0%" in h.agreement_line("x", "y",
                                                                          h.agreement(a, b))


def test_check_lengths_names_the_system_on_a_short_row():
    h.check_lengths("ok", [[1, 2], [3, 4]], 2, 2)
    h.check_lengths("per row", [[1], [2, 3]], 2, [1, 2])
    with pytest.raises(AssertionError, match="short: 2 rows of \\[1, 2\\] tokens"):
        h.check_lengths("short", [[1], [2, 3]], 2, 2)


def parse(argv, **run):
    p = h.parser("A benchmark.\n\nMore.", model={}, workload={}, run=run, engine={}, hf={})
    return h.check_args(p, p.parse_args(argv))


@pytest.mark.parametrize("argv", [
    ["--num-prompts", "0"], ["--min-prompt-len", "9", "--max-prompt-len", "8"],
    ["--repeats", "0"], ["--threads", "0"], ["--vocab-size", "3"], ["--num-heads", "3"],
    ["--num-kv-heads", "3"], ["--hf-batch-sizes", "2,x"], ["--hf-batch-sizes", "0"],
    ["--num-kv-blocks", "0"]])
def test_check_args_rejects_inconsistent_flags(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "error" in capsys.readouterr().err


def test_flags_parse_and_feed_llm_kwargs():
    args = parse(["--hf-batch-sizes", "4,16", "--block-size", "8"])
    assert args.hf_batch_sizes == [4, 16] and args.repeats == 1 and args.output_len == 64
    assert h.engine_kwargs(args, seed=3) == {
        "block_size": 8, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
        "num_kv_blocks": None, "dtype": "float32", "device": "cpu", "seed": 3}
    p = h.parser("x", model={"vocab_size": 99, "dtype": "bfloat16"}, run={"repeats": None},
                 workload={"output_len": None}, hf={"batch_sizes": "2", "generate_batch": False})
    args = p.parse_args([])
    assert (args.vocab_size, args.dtype, args.hf_batch_sizes) == (99, "bfloat16", [2])
    assert not {"repeats", "output_len", "skip_generate_batch"} & set(vars(args))
    h.add_ints(p, max_tokens=16, limit=None)
    assert (p.parse_args(["--max-tokens", "3"]).max_tokens, p.parse_args([]).limit) == (3, None)


def test_make_prompts_is_seeded_and_avoids_special_ids():
    a = h.make_prompts(20, 3, 9, 50, seed=1)
    assert a == h.make_prompts(20, 3, 9, 50, seed=1) != h.make_prompts(20, 3, 9, 50, seed=2)
    assert all(3 <= len(p) <= 9 and min(p) >= h.FIRST_REGULAR_ID and max(p) < 50 for p in a)


def test_left_pad_pads_on_the_left_and_masks_the_padding():
    ids, mask = h.left_pad([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [h.PAD_ID, h.PAD_ID, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_markdown_table_right_aligns_numeric_columns():
    table = h.markdown_table(["name", "tok/s", "ratio", "saving"],
                             [["a", "1,234.5", "1.00x", "12.5%"], ["bb", "7.0", "n/a", "-3.0%"]])
    lines = table.splitlines()
    assert lines[1] == "|------|--------:|-------|-------:|"
    assert lines[2] == "| a    | 1,234.5 | 1.00x |  12.5% |"
    assert lines[3] == "| bb   |     7.0 | n/a   |  -3.0% |"


def test_the_model_folder_is_written_once_and_its_parameters_counted(tmp_path):
    args = types.SimpleNamespace(
        hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64,
        vocab_size=64, dtype="float32", seed=0, model_dir=tmp_path / "m")
    with h.prepare_model_dir(args, 64) as folder:
        assert folder == tmp_path / "m" and (folder / "config.json").is_file()
        model = h.load_hf_model(folder, h.DTYPES["float32"], "cpu")
        assert h.count_params(folder) == sum(p.numel() for p in model.parameters())
        stamp = (folder / "model.safetensors").stat().st_mtime_ns
    with h.prepare_model_dir(args, 64) as again:  # an existing folder is used as it is
        assert again == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert "0." in h.model_line(args, h.count_params(folder))


def test_check_args_also_checks_the_scripts_own_counts(capsys):
    p = h.parser("x")
    p.add_argument("--rows", type=int, default=5)
    p.add_argument("--limit", type=int, default=None)
    assert h.check_args(p, p.parse_args([]), "rows", "limit").rows == 5  # None: not given
    with pytest.raises(SystemExit):
        h.check_args(p, p.parse_args(["--limit", "0"]), "rows", "limit")
    assert "--limit must be >= 1" in capsys.readouterr().err


def test_a_child_is_timed_reaped_and_its_log_kept(tmp_path):
    import sys

    child = h.Child([sys.executable, "-c", "import sys; print('hello'); "
                     "sys.stderr.write('ValueError: bad\\n'); sys.exit(3)"],
                    h.child_env(), tmp_path / "c.log")
    assert child.wait(timeout=60) == 3 and child.poll()
    assert child.wall_s > 0 and child.maxrss_kib > 0 and child.cpu_s >= 0
    assert "hello" in child.output
    with pytest.raises(RuntimeError, match="exited with 3; first error: ValueError: bad"):
        child.check(60)


def test_a_child_past_its_timeout_is_killed(tmp_path):
    import sys

    child = h.Child([sys.executable, "-c", "import time; time.sleep(60)"], h.child_env(),
                    tmp_path / "c.log", own_group=True)
    assert not child.poll()
    assert child.wait(timeout=0.5) == -9 and child.wall_s < 30

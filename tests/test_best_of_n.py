"""The score and select stages of a dataset job (issue 42): every candidate's score equals HF's
own sequence-classification forward; changing `select` reruns only the selection and changing
the scorer only the scoring (counted: no token generated, no candidate scored); until:k spends
fewer candidates than a fixed n for the same k; a SIGKILL in each stage (generate, score,
select) resumes bit-identically; bad input fails before any work; `batchgen generate
--score-model --select`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch
from helpers import head_folder

from batchgen import LLM, SamplingParams
from batchgen.data import generate_dataset

ROWS = datasets.Dataset.from_list([{"prompt": "Tell me a story"}, {"prompt": "Q: 2+2? A:"},
                                   {"prompt": "Hello"}])
VERIFIER = '''
import os, signal, zlib
CALLS = [0]
def verify(prompt, text):
    """A deterministic verifier: 'easy' rows pass always, the others one text in three."""
    CALLS[0] += 1
    if CALLS[0] == int(os.environ.get("BON_KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0 if prompt.startswith("easy") or zlib.crc32(text.encode()) % 3 == 0 else 0.0
'''


@pytest.fixture(scope="module")
def folders(tiny_model_factory, tmp_path_factory):
    """A tiny generator and a one-label reward model (the same body, a random score head)."""
    gen = tiny_model_factory("llama")
    return gen, head_folder(gen, tmp_path_factory.mktemp("bon-rm"), seed=11)


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """The verifier as an importable module (the same qualified name in a subprocess)."""
    root = tmp_path_factory.mktemp("bon-verifier")
    (root / "bon_verify.py").write_text(VERIFIER)
    sys.path.insert(0, str(root))
    import bon_verify

    yield root, bon_verify
    sys.path.remove(str(root))


class Spy:
    """Counts candidates generated (through llm.generate_stream) and scored by a model."""

    def __init__(self, llm, monkeypatch):
        from batchgen.pooling.scorer import RewardModel

        self.generated = self.scored = 0
        self.generator_asleep = []  # at each scoring call: its pool released
        stream, classify = llm.generate_stream, RewardModel.classify

        def counted_stream(*a, **k):
            for i, out in stream(*a, **k):
                self.generated += len(out.outputs)
                yield i, out

        def counted_classify(rm, prompts, *a, **k):
            self.scored += len(prompts)
            self.generator_asleep.append(llm.is_sleeping())
            return classify(rm, prompts, *a, **k)
        monkeypatch.setattr(llm, "generate_stream", counted_stream)
        monkeypatch.setattr(RewardModel, "classify", counted_classify)


def _hf_rewards(folder, texts):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype="float32").eval()
    with torch.no_grad():
        return [hf(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_best_of_n_stages_and_resume_per_stage(folders, tmp_path, monkeypatch):
    gen, rm = folders
    llm = LLM(gen, seed=0, enable_sleep_mode=True, num_kv_blocks=64)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, logprobs=1)
    out = tmp_path / "job"
    spy = Spy(llm, monkeypatch)
    ds = generate_dataset(llm, ROWS, params, score=rm, select="best", output_dir=out,
                          rows_per_shard=2, use_tqdm=False)
    assert spy.generated == spy.scored == 9 and not llm.is_sleeping()
    assert spy.generator_asleep and all(spy.generator_asleep)
    texts = [r["prompt"] + c["text"] for r in ds for c in r["outputs"]]
    scores = [c["score"] for r in ds for c in r["outputs"]]
    assert torch.allclose(torch.tensor(scores, dtype=torch.float64),
                          torch.tensor(_hf_rewards(rm, texts), dtype=torch.float64), atol=1e-5)
    for r in ds:  # candidates keep text, logprobs; the selection is the best one
        s = [c["score"] for c in r["outputs"]]
        assert r["selected"] == [s.index(max(s))] and all(c["logprobs"] for c in r["outputs"])
    generated = _files(out / "generate")
    ds2 = generate_dataset(llm, ROWS, params, score=rm, select="top:2", output_dir=out,
                           resume=True, rows_per_shard=2, use_tqdm=False)
    assert spy.generated == spy.scored == 9  # nothing generated or scored again
    assert [c["score"] for r in ds2 for c in r["outputs"]] == scores
    assert [len(r["selected"]) for r in ds2] == [2, 2, 2]
    calls = []

    def length(prompt, text):
        calls.append(text)
        return float(len(text))
    ds3 = generate_dataset(llm, ROWS, params, score=length, select="pairs", output_dir=out,
                           resume=True, use_tqdm=False)
    assert spy.generated == 9 and _files(out / "generate") == generated  # rescored only
    assert len(calls) == 9 and spy.scored == 9
    assert [c["score"] for r in ds3 for c in r["outputs"]] == [len(t) - len(r["prompt"])
                                                                for r in ds3 for t in
                                                                [r["prompt"] + c["text"]
                                                                 for c in r["outputs"]]]
    assert all(len(r["rejected"]) <= 1 for r in ds3)
    more = datasets.concatenate_datasets([ROWS, datasets.Dataset.from_list([{"prompt": "Hi"}])])
    ds4 = generate_dataset(llm, more, params, score=length, select="pairs", output_dir=out,
                           resume=True, use_tqdm=False)  # a row added: only it runs
    assert spy.generated == 12 and len(calls) == 12 and len(ds4) == 4
    assert ds4.select(range(3)).to_list() == ds3.to_list()


def test_until_k_spends_fewer_candidates(folders, verifier):
    _, bon = verifier
    llm = LLM(folders[0], seed=0, num_kv_blocks=64)
    rows = datasets.Dataset.from_list([{"prompt": p} for p in (
        "easy: say hi", "easy: count", "hard: prove it", "hard: solve", "hard: why")])
    fixed = generate_dataset(llm, rows, SamplingParams(n=8, temperature=1.0, max_tokens=4),
                             score=bon.verify, select="threshold:1", use_tqdm=False)
    until = generate_dataset(llm, rows, SamplingParams(n=2, temperature=1.0, max_tokens=4),
                             score=bon.verify, select="until:1", threshold=1.0,
                             max_candidates=8, use_tqdm=False)
    spent = [len(r["outputs"]) for r in until]
    assert spent[:2] == [2, 2] and all(2 <= s <= 8 and s % 2 == 0 for s in spent)
    for r in until:  # a row stops at its first passing round, or at the budget
        passed = [c["score"] >= 1 for c in r["outputs"]]
        assert r["selected"] == [passed.index(True)] if any(passed) else r["selected"] == []
        assert r["rounds"] == len(r["outputs"]) // 2
        assert (not any(passed[:-2])) and (any(passed) or len(passed) == 8)
    accepted_fixed = sum(bool(r["selected"]) for r in fixed)
    assert sum(bool(r["selected"]) for r in until) == accepted_fixed
    assert sum(spent) < 8 * len(rows)


def test_kill_in_score_stage_resumes_bit_identically(folders, verifier, tmp_path):
    gen, _ = folders
    _, bon = verifier
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                            ("easy a", "hard b", "hard c", "easy d")))
    llm = LLM(gen, seed=0, num_kv_blocks=64)

    def run(name, resume=True):
        return generate_dataset(llm, str(data), SamplingParams(n=2, max_tokens=4),
                                score=bon.verify, select="until:1", threshold=1.0,
                                max_candidates=4, output_dir=tmp_path / name, resume=resume,
                                rows_per_shard=1, score_workers=1, use_tqdm=False)

    def killed_by_the_verifier():  # at its third call from now
        os.environ["BON_KILL_AT"] = str(bon.CALLS[0] + 3)
        run("killed", resume=False)
    _killed_in("", 0, killed_by_the_verifier)
    assert len(list((tmp_path / "killed" / "score").glob("part-*"))) == 1  # row 0 scored, then killed
    runs = {"killed": run("killed"), "whole": run("whole", resume=False)}
    assert runs["killed"].to_list() == runs["whole"].to_list()
    assert _files(tmp_path / "killed") == _files(tmp_path / "whole")
    assert any(r["rounds"] == 2 for r in runs["whole"])  # a second round ran, and resumed


def _killed_in(stage: str, at: int, job) -> None:
    """Run `job()` in a forked child that SIGKILLs itself just before the `at`-th manifest
    write of the `stage` folder (a shard renamed into place, not listed yet; 0: never, the
    job kills itself)."""
    from batchgen.data import shards

    pid = os.fork()
    if pid == 0:  # the child: the parent's modules and models, no interpreter start-up
        try:
            listed, seen = shards.ShardStore._write_manifest, [0]

            def dying(store, complete):
                seen[0] += store.dir.name == stage
                if at and seen[0] == at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return listed(store, complete)
            shards.ShardStore._write_manifest = dying
            job()
        finally:
            os._exit(1)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] and os.WIFSIGNALED(done[1]) and os.WTERMSIG(done[1]) == signal.SIGKILL, stage


def test_kill_in_each_stage_resumes_bit_identically(folders, verifier, tmp_path):
    """A process SIGKILLed in the generate stage (shards closed early by time, one renamed
    but not listed), resumed and killed in the score stage, then in the select stage, then
    resumed to the end: every file equals an uninterrupted run's, byte for byte."""
    gen, _ = folders
    _, bon = verifier
    data = datasets.Dataset.from_list([{"prompt": p} for p in
                                       ("easy a", "hard b", "hard c", "easy d", "hard e")])
    llm = LLM(gen, seed=0, num_kv_blocks=64)

    def run(name, resume=True, shard_seconds=None):
        return generate_dataset(llm, data, SamplingParams(n=2, temperature=1.0, max_tokens=4),
                                score=bon.verify, select="best", rows_per_shard=2,
                                score_workers=1, use_tqdm=False, output_dir=tmp_path / name,
                                resume=resume, shard_seconds=shard_seconds)
    for stage, at, resume in (("generate", 3, False), ("score", 4, True), ("selected", 4, True)):
        _killed_in(stage, at, lambda r=resume: run("killed", r, shard_seconds=1e-9))
        manifest = json.loads((tmp_path / "killed" / stage / "_manifest.json").read_text())
        assert not manifest["complete"] and manifest["shards"], stage  # killed part-way
    killed, whole = run("killed"), run("whole", resume=False)
    assert killed.to_list() == whole.to_list()
    assert {"generate/part-00002.parquet", "selected/part-00002.parquet"} <= set(
        _files(tmp_path / "whole"))
    assert _files(tmp_path / "killed") == _files(tmp_path / "whole")


def test_bad_input_before_any_work(folders, tmp_path):
    gen, rm = folders
    llm = LLM(gen, seed=0, num_kv_blocks=16)
    headless = tmp_path / "headless"
    headless.mkdir()
    (headless / "config.json").write_text(json.dumps({"architectures": ["LlamaModel"]}))
    out = tmp_path / "never"
    cases = [(dict(select="best"), "select needs score"),
             (dict(score=str(gen), select="best"), "is a generator"),
             (dict(score=llm, select="best"), "a generator LLM"),
             (dict(score=str(headless)), "no classification head"),
             (dict(score=rm, select="threshold:high"), "select must be one of"),
             (dict(score=rm, select="until:2", threshold="high"), "threshold must be a number"),
             (dict(score=rm, select="until:2"), "threshold must be a number"),
             (dict(score=rm, select="best", threshold=0.5), "threshold and max_candidates"),
             (dict(score=rm, select="until:1", threshold=0.5, max_candidates=1),
              "max_candidates must be"),
             (dict(score=3), "score must be")]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            generate_dataset(llm, ROWS, SamplingParams(n=2, max_tokens=2), output_dir=out,
                             **kw)
        assert not out.exists()


def test_cli_generate_score_select(folders, tmp_path, capsys):
    from batchgen.cli import main

    gen, rm = folders
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    base = ["generate", "--model", str(gen), "--input", str(rows), "--n", "2",
            "--max-tokens", "3", "--quiet", "--num-kv-blocks", "32"]
    assert main([*base, "--output", str(tmp_path / "a"), "--select", "best"]) != 0
    assert "--select needs score" in capsys.readouterr().err
    assert main([*base, "--output", str(tmp_path / "b"), "--score-model", str(gen)]) != 0
    assert "is a generator" in capsys.readouterr().err and not (tmp_path / "b").exists()
    assert main([*base, "--output", str(tmp_path / "c"), "--score-model", str(rm),
                 "--select", "best"]) == 0
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "c" / "selected").to_pylist()
    assert [len(r["outputs"]) for r in table] == [2, 2, 2]
    for r in table:
        s = [c["score"] for c in r["outputs"]]
        assert r["selected"] == [s.index(max(s))]


def test_prm_as_pooling_llm_scores_equal_hf(folders, tmp_path):
    """A process reward model (a token-classification head, 2 labels) passed as a PoolingLLM:
    under prm_aggregate="last" each candidate's score is the "good" label's probability at its
    last step tag, as HF's own forward gives it."""
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    from batchgen.pooling.llm import PoolingLLM
    from batchgen.pooling.steps import StepScoring

    gen, _ = folders
    config = AutoConfig.from_pretrained(gen)
    config.num_labels, config.architectures = 2, ["LlamaForTokenClassification"]
    torch.manual_seed(5)
    hf = AutoModelForTokenClassification.from_config(config).float().eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 1.0)
    hf.save_pretrained(tmp_path / "prm")
    for f in gen.iterdir():
        if "token" in f.name:
            shutil.copy(f, tmp_path / "prm" / f.name)
    llm = LLM(gen, seed=0, num_kv_blocks=32)
    prm = PoolingLLM(tmp_path / "prm", num_kv_blocks=32, block_size=4)
    ds = generate_dataset(llm, ROWS, SamplingParams(n=2, max_tokens=4), score=prm,
                          select="best", use_tqdm=False, prm_step_tag="</s>",
                          prm_aggregate="last")  # (test_prm_steps.py: every step's score)
    tok = AutoTokenizer.from_pretrained(tmp_path / "prm")
    shared = sum((len(tok(r["prompt"])["input_ids"]) - 1) // 4 * 4 for r in ds)  # blocks
    assert prm.kv_stats().prefix_hit_tokens >= shared > 0  # a row's 2nd candidate hits them
    for r in ds:
        for c in r["outputs"]:
            with torch.no_grad():
                text = StepScoring(tag="</s>").text(r["prompt"], c["text"])
                logits = hf(**tok(text, return_tensors="pt")).logits[0, -1]  # the last tag
            assert abs(c["score"] - torch.softmax(logits, -1)[1].item()) < 1e-5

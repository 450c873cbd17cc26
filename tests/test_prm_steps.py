"""Process reward model step scores in a dataset job's score stage (issue 42): each
candidate's steps (split at the separator, the step tag after each) scored as HF's own
`AutoModelForTokenClassification` forward gives them at the tags (softmax, last label), the
score their aggregate; changing `prm_aggregate` rescores without regenerating; bad tags and
aggregates refused before any work; the CLI flags reach the job."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import datasets
import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.data import generate_dataset
from batchgen.pooling.steps import StepScoring

TAG = "<extra_0>"
ROWS = datasets.Dataset.from_list([{"prompt": "Solve 2+2 step by step:"}, {"prompt": "Hi"}])
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3)


@pytest.fixture(scope="module")
def folders(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny generator and a tiny random PRM (2 labels) whose tokenizer holds `<extra_0>` as a
    special token, as Qwen2.5-Math-PRM's does."""
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    gen = tiny_model_factory("llama")
    prm = tmp_path_factory.mktemp("prm")
    tok = AutoTokenizer.from_pretrained(gen)
    tok.add_special_tokens({"additional_special_tokens": [TAG]})
    config = AutoConfig.from_pretrained(gen)
    config.num_labels, config.vocab_size = 2, len(tok)
    config.architectures = ["LlamaForTokenClassification"]
    torch.manual_seed(9)
    model = AutoModelForTokenClassification.from_config(config).float()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(prm)
    tok.save_pretrained(prm)
    for f in gen.iterdir():
        if f.name.endswith(".jinja") and not (prm / f.name).exists():
            shutil.copy(f, prm / f.name)
    return gen, prm


def _hf_steps(prm: Path, prompt: str, text: str, separator: str) -> list[float]:
    """HF's step scores: the PRM's forward over prompt + each step + tag, softmax of the
    last label at the tag positions."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prm)
    hf = AutoModelForTokenClassification.from_pretrained(prm, dtype="float32").eval()
    steps = [s for s in text.split(separator) if s.strip()] or [""]
    enc = tok(prompt + "".join(s + TAG for s in steps), return_tensors="pt")
    with torch.no_grad():
        logits = hf(**enc).logits[0]
    at = enc["input_ids"][0] == tok.convert_tokens_to_ids(TAG)
    return torch.softmax(logits[at], -1)[:, -1].tolist()


def test_step_scoring_splits_and_aggregates():
    s = StepScoring()
    assert s.steps("a\n\nb\n\n\n\nc \n\n") == ["a", "b", "c "] and s.steps("") == [""]
    assert s.text("Q ", "a\n\nb") == "Q a<extra_0>b<extra_0>"
    vals = [0.5, 0.25, 0.75]
    assert [StepScoring(aggregate=a).reduce(vals) for a in ("min", "last", "mean", "prod")] \
        == [0.25, 0.75, 0.5, 0.5 * 0.25 * 0.75]
    for kw, name in [(dict(aggregate="max"), "prm_aggregate"), (dict(tag=3), "prm_step_tag"),
                     (dict(separator=""), "prm_step_separator")]:
        with pytest.raises(ValueError, match=name):
            StepScoring(**kw)


def test_prm_step_scores_equal_hf_and_aggregate_rescores_only(folders, tmp_path, monkeypatch):
    from batchgen.pooling.scorer import RewardModel

    gen, prm = folders
    calls = []
    token_classify = RewardModel.token_classify
    monkeypatch.setattr(RewardModel, "token_classify",
                        lambda rm, p, *a, **k: calls.append(len(p)) or token_classify(rm, p, *a,
                                                                                       **k))
    llm = LLM(gen, seed=0, enable_sleep_mode=True, num_kv_blocks=64)
    out = tmp_path / "job"
    job = dict(score=str(prm), select="best", output_dir=out, resume=True, use_tqdm=False,
               prm_step_separator=" ")  # random text has spaces, rarely blank lines
    ds = generate_dataset(llm, ROWS, PARAMS, **job)
    assert sum(calls) == 4
    steps_seen = 0
    for r in ds:
        for c in r["outputs"]:
            want = _hf_steps(prm, r["prompt"], c["text"], " ")
            assert len(c["step_scores"]) == len(want)
            assert torch.allclose(torch.tensor(c["step_scores"]), torch.tensor(want), atol=1e-5)
            assert c["score"] == min(c["step_scores"])
            steps_seen += len(want)
        assert r["selected"] == [max(range(2), key=lambda i: (r["outputs"][i]["score"], -i))]
    assert steps_seen > 4  # candidates of several steps
    generated = {p.name: p.read_bytes() for p in (out / "generate").iterdir()}
    ds2 = generate_dataset(llm, ROWS, PARAMS, prm_aggregate="mean", **job)
    assert sum(calls) == 8  # rescored ...
    assert {p.name: p.read_bytes() for p in (out / "generate").iterdir()} == generated
    for r1, r2 in zip(ds, ds2):  # ... not regenerated: same candidates, same step scores
        for c1, c2 in zip(r1["outputs"], r2["outputs"]):
            assert (c1["text"], c1["step_scores"]) == (c2["text"], c2["step_scores"])
            assert math.isclose(c2["score"], sum(c2["step_scores"]) / len(c2["step_scores"]))


def test_prm_bad_input_and_cli_flags(folders, tmp_path, capsys):
    from batchgen.cli import main

    gen, prm = folders
    llm = LLM(gen, seed=0, num_kv_blocks=16)
    for kw, match in [(dict(prm_step_tag="two tags"), "prm_step_tag must be one token"),
                      (dict(prm_aggregate="max"), "prm_aggregate must be one of"),
                      (dict(score=len, prm_aggregate="min"), "prm_aggregate goes with a process")]:
        with pytest.raises(ValueError, match=match):
            generate_dataset(llm, ROWS, PARAMS, **{"score": str(prm), **kw},
                             output_dir=tmp_path / "bad")
        assert not (tmp_path / "bad").exists()
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    base = ["generate", "--model", str(gen), "--input", str(rows), "--n", "2", "--max-tokens",
            "6", "--quiet", "--num-kv-blocks", "32", "--score-model", str(prm)]
    assert main([*base, "--output", str(tmp_path / "a"), "--prm-step-tag", "x y"]) == 2
    assert "--prm-step-tag must be one token" in capsys.readouterr().err
    assert main([*base, "--output", str(tmp_path / "b"), "--prm-aggregate", "last",
                 "--prm-step-tag", TAG, "--select", "best"]) == 0
    from batchgen.data.shards import MANIFEST

    manifest = json.loads((tmp_path / "b" / "score" / MANIFEST).read_text())
    assert manifest["job"]["prm"] == [TAG, "last", "\n\n"]
    import pyarrow.parquet as pq

    for r in pq.read_table(tmp_path / "b" / "selected").to_pylist():
        for c in r["outputs"]:
            assert c["score"] == c["step_scores"][-1]

"""Pooling, issue 42 (embeddings and rerankers): a decoder embedding model served by the paged
engine equals HF's `AutoModel` forward + the same pooling on the same tiny random weights
(last-token, mean and CLS pooling, Matryoshka `dimensions`, normalization) in batches of mixed
lengths, with chunked prefill, block size 1, prefix hits and a pool smaller than the batch's
prompts; `score` is cosine similarity for it and the yes/no-logit probability for a
Qwen3-Reranker-style causal LM (vLLM's hf_overrides form); `batchgen embed` and run-batch's
/v1/embeddings lines; bad input before any work."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from batchgen.pooling import PoolingParams

PROMPTS = ["Q: 2+2? A: 4", "Hello there, how are you doing today my friend?", "x",
           "The capital of France is Paris, and of Italy Rome."]
NORM = torch.nn.functional.normalize


@pytest.fixture(scope="module")
def embed_model(tiny_model_factory, tmp_path_factory) -> Path:
    """A Qwen3-Embedding-like folder: a bare `Qwen3Model` (no LM head) and its tokenizer."""
    from transformers import AutoModel

    src = tiny_model_factory("qwen3")
    dst = tmp_path_factory.mktemp("embed-qwen3")
    AutoModel.from_pretrained(src, dtype="float32").save_pretrained(dst)
    for f in src.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def hf_model(embed_model):
    from transformers import AutoModel

    return AutoModel.from_pretrained(embed_model, dtype="float32").eval()


@pytest.fixture(scope="module")
def hf_states(embed_model, hf_model):
    """HF's own final-norm hidden states [T, H] of each prompt (one at a time: no padding)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embed_model)
    hf = hf_model
    with torch.no_grad():
        return {p: hf(**tok(p, return_tensors="pt")).last_hidden_state[0]
                for p in PROMPTS + ["query: moon"]}


def _want(states: torch.Tensor, kind: str, dims: int | None, normalize: bool) -> torch.Tensor:
    v = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[kind][:dims]
    return NORM(v, dim=-1) if normalize else v


@pytest.mark.parametrize("kind,engine,params", [
    ("LAST", dict(), PoolingParams()),
    ("MEAN", dict(block_size=1, max_num_batched_tokens=5), PoolingParams(dimensions=16)),
    ("CLS", dict(block_size=4), PoolingParams(normalize=False)),
    ("LAST", dict(block_size=2, num_kv_blocks=16, max_num_batched_tokens=6),
     PoolingParams(dimensions=8, normalize=False)),
], ids=["last", "mean-bs1-chunked-matryoshka", "cls-raw", "last-small-pool"])
def test_embed_equals_hf(embed_model, hf_model, hf_states, kind, engine, params):
    from batchgen.pooling.llm import PoolingLLM

    llm = PoolingLLM(embed_model, pooler_config={"pooling_type": kind}, seed=0, **engine)
    outs = llm.embed(PROMPTS, params)
    for p, o in zip(PROMPTS, outs):
        want = _want(hf_states[p], kind, params.dimensions, params.normalize is not False)
        got = torch.tensor(o.outputs.embedding)
        assert o.outputs.hidden_size == len(want) and torch.allclose(got, want, atol=1e-5)
    stats = llm.kv_stats()
    if "num_kv_blocks" in engine:  # the prompts need more blocks than the pool: they wait
        need = sum(-(-len(o.prompt_token_ids) // engine["block_size"]) for o in outs)
        assert stats.peak_blocks_in_use <= engine["num_kv_blocks"] < need
    enc = llm.encode(PROMPTS[:1], params, pooling_task="embed")[0].outputs.data
    assert torch.allclose(enc, torch.tensor(outs[0].outputs.embedding), atol=1e-6)
    cut = llm.embed(PROMPTS[1:2], replace(params, truncate_prompt_tokens=5))[0]
    ids = cut.prompt_token_ids
    assert len(ids) == 5 and ids == outs[1].prompt_token_ids[-5:]
    with torch.no_grad():
        states = hf_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    want = _want(states, kind, params.dimensions, params.normalize is not False)
    assert torch.allclose(torch.tensor(cut.outputs.embedding), want, atol=1e-5)


def test_embed_prefix_hits_and_cosine_score(embed_model, hf_states):
    """Last-token embeddings of texts sharing a cached prefix hit its blocks and equal HF's;
    `score` is the cosine similarity of the two embeddings (vLLM's embedding score)."""
    from batchgen.pooling.llm import PoolingLLM

    llm = PoolingLLM(embed_model, seed=0, block_size=2)
    llm.embed(PROMPTS[1:2])
    again = llm.embed(PROMPTS[1:2])[0].outputs.embedding
    assert llm.kv_stats().prefix_hit_tokens > 0
    assert torch.allclose(torch.tensor(again), NORM(hf_states[PROMPTS[1]][-1], dim=-1),
                          atol=1e-5)
    scores = llm.score("query: moon", PROMPTS[:2])
    q = hf_states["query: moon"][-1]
    for s, p in zip(scores, PROMPTS[:2]):
        want = torch.nn.functional.cosine_similarity(q, hf_states[p][-1], dim=0)
        assert abs(s.outputs.score - float(want)) < 1e-5


def test_sentence_transformers_pooling_is_read(embed_model, tmp_path):
    from batchgen.pooling.embed import pooling_type

    folder = tmp_path / "st"
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    assert pooling_type(folder) == "MEAN"
    assert pooling_type(folder, {"pooling_type": "cls"}) == "CLS"  # pooler_config wins
    assert pooling_type(embed_model) == "LAST"  # no sentence-transformers files
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="sentence-transformers pooling must be one of"):
        pooling_type(folder)
    with pytest.raises(ValueError, match="pooler_config.pooling_type must be one of"):
        pooling_type(folder, {"pooling_type": "MAX"})


def test_yes_no_reranker_score_equals_hf(tiny_model_factory):
    """vLLM's Qwen3-Reranker form: hf_overrides naming the "no"/"yes" tokens; the score is the
    softmax over their two logits at the last position, as HF's causal LM gives them; without
    is_original_qwen3_reranker, classify returns the two raw logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchgen.pooling.llm import PoolingLLM

    src = tiny_model_factory("qwen3")
    tok = AutoTokenizer.from_pretrained(src)
    no, yes = "a", "b"  # one token each in the tiny tokenizer ("yes"/"no" are two there)
    ids = [tok.encode(t, add_special_tokens=False)[0] for t in (no, yes)]
    over = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": [no, yes], "is_original_qwen3_reranker": True}
    llm = PoolingLLM(src, hf_overrides=over, seed=0, block_size=1, max_num_batched_tokens=6)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype="float32").eval()
    docs = PROMPTS[:3]
    got = llm.score("Query: is it true? Document: ", docs)
    raw = llm.score("Query: is it true? Document: ", docs, PoolingParams(use_activation=False))
    with torch.no_grad():
        for s, r, d in zip(got, raw, docs):
            enc = tok("Query: is it true? Document: " + d, return_tensors="pt")
            logits = hf(**enc).logits[0, -1, ids]
            assert abs(s.outputs.score - float(torch.softmax(logits, -1)[1])) < 1e-5
            assert abs(r.outputs.score - float(logits[1] - logits[0])) < 1e-5
        cut = llm.score("Query: ", docs[1:2], PoolingParams(truncate_prompt_tokens=4))[0]
        assert len(cut.prompt_token_ids) == 4  # the pair's last 4 tokens, as HF scores them
        logits = hf(input_ids=torch.tensor([cut.prompt_token_ids])).logits[0, -1, ids]
        assert abs(cut.outputs.score - float(torch.softmax(logits, -1)[1])) < 1e-5
        full = tok("Query: " + docs[1])["input_ids"]
        assert cut.prompt_token_ids == full[-4:]
    two = PoolingLLM(src, hf_overrides={"classifier_from_token": [no, yes]}, seed=0)
    with torch.no_grad():
        ref = hf(**tok(docs[0], return_tensors="pt")).logits[0, -1, ids]
    assert torch.allclose(torch.tensor(two.classify(docs[:1])[0].outputs.probs), ref,
                          atol=1e-5)


def test_embedding_errors(embed_model, tiny_model_factory):
    from batchgen.pooling.llm import PoolingLLM

    llm = PoolingLLM(embed_model, seed=0)
    with pytest.raises(ValueError, match="dimensions must be at most"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=10_000))
    with pytest.raises(ValueError, match="reward needs a classification"):
        llm.reward(PROMPTS[:1])
    with pytest.raises(ValueError, match="pooling_task must be one of"):
        llm.encode(PROMPTS[:1], pooling_task="score")
    src = tiny_model_factory("qwen3")
    for over, name in [({"classifier_from_token": ["yes", "no"]}, "classifier_from_token"),
                       ({"classifier_from_token": ["a"], "rope": 1}, "hf_overrides"),
                       ({"architectures": ["Qwen3ForCausalLM"],
                         "classifier_from_token": ["a", "b"]}, "architectures")]:
        with pytest.raises(ValueError, match=name):
            PoolingLLM(src, hf_overrides=over)
    with pytest.raises(ValueError, match="sequence-classification"):  # a generator, "auto"
        PoolingLLM(src, runner="auto")
    with pytest.raises(ValueError, match="pooler_config must be None"):
        PoolingLLM(src, hf_overrides={"classifier_from_token": ["a"]},
                   pooler_config={"pooling_type": "MEAN"})


def test_cli_embed_and_run_batch_embeddings(embed_model, hf_states, tmp_path, capsys):
    from batchgen.cli import main

    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps({"text": t, "k": i}) + "\n" for i, t in enumerate(PROMPTS)))
    out = tmp_path / "e.jsonl"
    assert main(["embed", "--model", str(embed_model), "--input", str(src), "--output",
                 str(out), "--text-column", "none"]) == 2  # before the model loads
    assert "no text column 'none'" in capsys.readouterr().err
    assert main(["embed", "--model", str(embed_model), "--input", str(src), "--output",
                 str(out), "--dimensions", "8", "--block-size", "1"]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["k"] for g in got] == list(range(len(PROMPTS)))
    for g, p in zip(got, PROMPTS):
        assert torch.allclose(torch.tensor(g["embedding"]), _want(hf_states[p], "LAST", 8, True),
                              atol=1e-5)
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "m", "input": PROMPTS[:2], "dimensions": 16}},
             {"custom_id": "b", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": PROMPTS[3]}},
             {"custom_id": "c", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": "x", "encoding_format": "base64"}},
             {"custom_id": "d", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "x"}}]
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    answers = tmp_path / "a.jsonl"
    assert main(["run-batch", "-i", str(batch), "-o", str(answers), "--model",
                 str(embed_model), "--quiet"]) == 0
    got = {g["custom_id"]: g for g in map(json.loads, answers.read_text().splitlines())}
    data = got["a"]["response"]["body"]["data"]
    assert [d["index"] for d in data] == [0, 1] and got["a"]["response"]["body"]["object"] == "list"
    for d, p in zip(data, PROMPTS[:2]):
        assert torch.allclose(torch.tensor(d["embedding"]), _want(hf_states[p], "LAST", 16, True),
                              atol=1e-5)
    (one,) = got["b"]["response"]["body"]["data"]
    assert torch.allclose(torch.tensor(one["embedding"]),
                          _want(hf_states[PROMPTS[3]], "LAST", None, True), atol=1e-5)
    assert got["c"]["error"]["code"] == "invalid_request" and "encoding_format" in \
        got["c"]["error"]["message"]
    assert got["d"]["error"]["code"] == "invalid_url"  # an embedding model does not generate
    capsys.readouterr()
    assert main(["run-batch", "-i", str(batch), "-o", str(answers), "--model",
                 str(embed_model), "--quiet", "--resume"]) == 0
    assert "0 answered, 2 reused" in capsys.readouterr().out  # unchanged lines: not embedded


def test_api_docs_tables():
    """docs/api.md's PoolingLLM and PoolingParams tables list exactly their parameters."""
    from batchgen.pooling.llm import PoolingLLM
    from tests.test_api_docs import dataclass_defaults, sections, signature_defaults

    tables = sections()
    assert tables["`batchgen.pooling.llm.PoolingLLM(model, **kwargs)`"] == \
        signature_defaults(PoolingLLM.__init__)
    assert tables["`batchgen.pooling.PoolingParams(...)`"] == dataclass_defaults(PoolingParams)


def test_vllm_llm_serves_embedding_folders(embed_model, tiny_model_factory):
    """vLLM's way: `vllm.LLM(folder)` on a bare `*Model` folder (runner="auto") and
    `vllm.LLM(causal_lm_folder, runner="pooling")` (Qwen3-Embedding's case: its config names
    a causal LM) are embedding PoolingLLMs; the latter embeds with the causal LM's backbone."""
    from transformers import AutoModel, AutoTokenizer

    from batchgen.pooling.llm import PoolingLLM
    from batchgen.vllm_compat import CompatLLM

    assert CompatLLM(embed_model, seed=0).embedder is not None
    from batchgen.pooling.outputs import EmbeddingRequestOutput
    from batchgen.vllm_compat.compat_llm import CompatLLM as Cls
    from batchgen.vllm_compat.modules import build_modules

    mods = build_modules(Cls)  # vLLM's names of the pooling classes
    assert mods["vllm"].PoolingParams is PoolingParams
    assert mods["vllm.pooling_params"].PoolingParams is PoolingParams
    assert mods["vllm.outputs"].EmbeddingRequestOutput is EmbeddingRequestOutput
    src = tiny_model_factory("qwen3")
    llm = CompatLLM(src, runner="pooling", seed=0)
    assert isinstance(llm, PoolingLLM)
    got = torch.tensor(llm.embed(PROMPTS[:1])[0].outputs.embedding)
    with torch.no_grad():
        hf = AutoModel.from_pretrained(src, dtype="float32").eval()
        states = hf(**AutoTokenizer.from_pretrained(src)(PROMPTS[0], return_tensors="pt"))
    assert torch.allclose(got, NORM(states.last_hidden_state[0, -1], dim=-1), atol=1e-5)

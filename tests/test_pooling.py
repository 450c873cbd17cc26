"""Pooling (issue 42, first part): a sequence-classification reward model served by the paged
engine equals HF's own `*ForSequenceClassification` forward on the same tiny random weights,
in batches of mixed lengths, with chunked prefill, block size 1 and prefix hits; n candidates
of one prompt compute the prompt once; PoolingParams and runner errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import head_folder

from batchgen.pooling import PoolingParams, pool, resolve_runner

PROMPTS = ["Q: 2+2? A: 4", "Hello there, how are you doing today my friend?", "x",
           "The capital of France is Paris, and of Italy Rome."]


def _reward_folder(src: Path, dst: Path, family: str, labels: int) -> Path:
    return head_folder(src, dst, labels=labels, seed=7, templates=True)


@pytest.fixture(scope="module", params=[("llama", 1), ("qwen3", 3)], ids=["llama-rm", "qwen3-cls"])
def reward_model(request, tiny_model_factory, tmp_path_factory):
    family, labels = request.param
    src = tiny_model_factory(family)
    return _reward_folder(src, tmp_path_factory.mktemp(f"rm-{family}"), family, labels)


def _hf_rewards(folder: Path, prompts: list[str]) -> list[list[float]]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype="float32").eval()
    with torch.no_grad():  # one prompt at a time: no padding question in the oracle
        return [hf(**tok(p, return_tensors="pt")).logits[0].tolist() for p in prompts]


@pytest.mark.parametrize("engine", [dict(), dict(block_size=1, max_num_batched_tokens=5),
                                    dict(block_size=4, num_kv_blocks=12)],
                         ids=["default", "bs1-chunked", "small-pool"])
def test_reward_equals_hf_head(reward_model, engine):
    from batchgen.pooling.scorer import RewardModel

    rm = RewardModel(reward_model, seed=0, **engine)
    outs = rm.reward(PROMPTS)
    want = _hf_rewards(reward_model, PROMPTS)
    assert [len(o.outputs.probs) for o in outs] == [len(w) for w in want]
    for out, ref in zip(outs, want):
        assert torch.allclose(torch.tensor(out.outputs.probs), torch.tensor(ref), atol=1e-5)
    pairs = rm.score("Query: ", PROMPTS[:2], PoolingParams(use_activation=False))  # raw
    ref = _hf_rewards(reward_model, ["Query: " + t for t in PROMPTS[:2]])
    assert torch.allclose(torch.tensor([p.outputs.score for p in pairs]),
                          torch.tensor([r[0] for r in ref]), atol=1e-5)
    act = rm.classify(PROMPTS[:1], PoolingParams(use_activation=True))[0].outputs.probs
    ref = torch.tensor(want[0])
    ref = torch.sigmoid(ref) if len(want[0]) == 1 else torch.softmax(ref, -1)
    assert torch.allclose(torch.tensor(act), ref, atol=1e-5)


def test_candidates_share_prompt(reward_model):
    from batchgen.pooling.scorer import RewardModel

    rm = RewardModel(reward_model, seed=0, block_size=4)
    prompt = "User: tell me a fact about the moon please. Assistant:"
    cands = [prompt + c for c in [" It orbits Earth.", " It is grey.", " No.", " Tides!"]]
    one_by_one = [rm.reward([c])[0].outputs.probs for c in cands]
    rm.llm.reset_prefix_cache()
    rm.reward([prompt])  # the prompt's blocks cached, as a generator's would be
    together = [o.outputs.probs for o in rm.reward(cands)]
    stats = rm.llm.kv_stats()
    assert torch.allclose(torch.tensor(together), torch.tensor(one_by_one), atol=1e-5)
    assert torch.allclose(torch.tensor(_hf_rewards(reward_model, cands)),
                          torch.tensor(together), atol=1e-5)
    prompt_len = len(rm.llm.get_tokenizer()(prompt)["input_ids"])
    assert stats.prefix_hit_tokens >= len(cands) * (prompt_len // 4) * 4 > 0


def test_pooling_errors(tiny_model_factory):
    from batchgen.pooling.scorer import RewardModel

    with pytest.raises(ValueError, match="runner must be one of"):
        resolve_runner("scoring", ["LlamaForSequenceClassification"])
    assert resolve_runner("auto", ["Qwen3ForSequenceClassification"]) == "pooling"
    assert resolve_runner("auto", ["LlamaForCausalLM"]) == "generate"
    with pytest.raises(ValueError, match="sequence-classification"):  # a generator as scorer
        RewardModel(tiny_model_factory("llama"))
    from transformers import AutoModel

    from batchgen.pooling.heads import as_causal_lm
    with pytest.raises(ValueError, match="with a `score` head"):  # a scorer without a head
        as_causal_lm(AutoModel.from_pretrained(tiny_model_factory("llama")))
    for kw, name in [(dict(dimensions=0), "dimensions"), (dict(normalize="yes"), "normalize"),
                     (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                     (dict(returned_token_ids=[]), "returned_token_ids")]:
        with pytest.raises(ValueError, match=name):
            PoolingParams(**kw)


def test_poolers_against_hf_states(tiny_model_factory):
    from transformers import AutoModel

    torch.manual_seed(0)
    hf = AutoModel.from_pretrained(tiny_model_factory("llama"), dtype="float32").eval()
    ids = torch.tensor([[5, 9, 3, 7, 9, 2]])
    with torch.no_grad():
        states = hf(input_ids=ids).last_hidden_state[0]
    emb = pool("embed", states, PoolingParams(dimensions=8), method="mean")
    ref = torch.nn.functional.normalize(states.mean(0)[:8], dim=-1)
    assert torch.allclose(emb, ref, atol=1e-6) and emb.shape == (8,)
    steps = pool("token_classify", states, PoolingParams(step_tag_id=9), ids[0].tolist())
    assert torch.equal(steps, states[[1, 4]])


def test_best_of_n_with_reward_model_and_verifier(reward_model, tiny_model_factory):
    from batchgen import LLM, SamplingParams
    from batchgen.pooling.scorer import RewardModel
    from batchgen.pooling.select import parse_select, score_outputs

    gen = LLM(tiny_model_factory("llama"), seed=0)
    outs = gen.generate(["Tell me", "Q:"], SamplingParams(n=4, temperature=1.0, max_tokens=6,
                                                          seed=3))
    rm = RewardModel(reward_model, seed=0)
    scores = score_outputs(outs, rm)
    texts = [o.prompt + c.text for o in outs for c in o.outputs]
    want = [r[0] for r in _hf_rewards(reward_model, texts)]
    assert torch.allclose(torch.tensor(scores).flatten(), torch.tensor(want), atol=1e-5)
    best = parse_select("best")(scores[0])["chosen"]
    assert best == [max(range(4), key=lambda i: (scores[0][i], -i))]
    assert parse_select("top:2")(scores[0])["chosen"][0] == best[0]
    pairs = parse_select("pairs")(scores[0])
    assert scores[0][pairs["chosen"][0]] == max(scores[0])
    assert scores[0][pairs["rejected"][0]] == min(scores[0])
    verifier = score_outputs(outs, lambda p, t: float(len(t) % 2))  # a callable verifier
    kept = parse_select("threshold:0.5")(verifier[1])["chosen"]
    assert kept == [i for i, c in enumerate(outs[1].outputs) if len(c.text) % 2]
    for bad in ["worst", "threshold:abc", "threshold:nan", "top:0", 3]:
        with pytest.raises(ValueError, match="select must be one of"):
            parse_select(bad)
    with pytest.raises(ValueError, match="score must be"):
        score_outputs(outs, 5)


def test_cli_score(reward_model, tmp_path, capsys):
    import json

    from batchgen.cli import main

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"prompt": "Q:", "response": r}) + "\n"
                           for r in [" yes", " no no no", " maybe"]))
    out = tmp_path / "s.jsonl"
    assert main(["score", "--model", str(reward_model), "--input", str(src), "--output",
                 str(out), "--text-column", "none"]) == 2  # a missing column, before loading
    assert "no text column 'none'" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": \n')
    assert main(["score", "--model", str(reward_model), "--input", str(broken), "--output",
                 str(out)]) == 2  # a line that is not JSON, named, before loading
    assert "line 2 is not JSON" in capsys.readouterr().err and not out.exists()
    assert main(["score", "--model", str(reward_model), "--input", str(src), "--output",
                 str(out), "--prompt-column", "prompt", "--response-column", "response",
                 "--block-size", "1"]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    want = _hf_rewards(reward_model, ["Q: yes", "Q: no no no", "Q: maybe"])
    assert [g["response"] for g in got] == [" yes", " no no no", " maybe"]
    assert torch.allclose(torch.tensor([g["scores"] for g in got]), torch.tensor(want),
                          atol=1e-5)
    assert main(["score", "--model", str(reward_model), "--input", str(src), "--output",
                 str(out)]) == 2  # an existing output without --overwrite


def test_prm_step_scores_equal_hf(tiny_model_factory, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    from batchgen.pooling.scorer import RewardModel

    src = tiny_model_factory("qwen3")
    dst = tmp_path_factory.mktemp("prm")
    config = AutoConfig.from_pretrained(src)
    config.num_labels = 2
    torch.manual_seed(5)
    model = AutoModelForTokenClassification.from_config(config).float().eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if "token" in f.name:
            shutil.copy(f, dst / f.name)
    tok = AutoTokenizer.from_pretrained(dst)
    texts = ["step one. step two. done.", "a. b."]
    tag = tok(".")["input_ids"][-1]
    rm = RewardModel(dst, seed=0, block_size=1, max_num_batched_tokens=4)
    rm.token_classify(texts)  # cached: the second call's prompts could hit their blocks
    full = rm.token_classify(texts)
    steps = rm.token_classify(texts, PoolingParams(step_tag_id=tag))
    with torch.no_grad():
        for text, f, s in zip(texts, full, steps):
            enc = tok(text, return_tensors="pt")
            ref = model(**enc).logits[0]
            assert torch.allclose(f.outputs.data, ref, atol=1e-5)
            mask = enc["input_ids"][0] == tag
            assert mask.any() and torch.allclose(s.outputs.data, ref[mask], atol=1e-5)


def test_vllm_pooling_runner_is_an_llm(reward_model):
    """vLLM's way: `vllm.LLM(model, runner="pooling")` (or "auto" on a reward model's folder)
    is a PoolingLLM, an LLM whose reward/classify/score/encode equal HF's head; a causal LM
    under "auto" stays a generator; embed is refused, naming what is served."""
    from batchgen import LLM
    from batchgen.pooling.llm import PoolingLLM, wants_pooling
    from batchgen.vllm_compat import CompatLLM

    llm = CompatLLM(reward_model, seed=0)  # runner="auto": the config's architecture decides
    assert isinstance(llm, PoolingLLM) and isinstance(llm, LLM)
    want = _hf_rewards(reward_model, PROMPTS[:2])
    for got in (llm.reward(PROMPTS[:2]), llm.encode(PROMPTS[:2], pooling_task="classify")):
        assert torch.allclose(torch.tensor([o.outputs.probs for o in got]), torch.tensor(want),
                              atol=1e-5)
    assert llm.kv_stats().prompt_tokens_computed > 0  # an LLM's own accounting
    with pytest.raises(ValueError, match="pooling_task must be one of"):
        llm.encode(PROMPTS[:1], pooling_task="reward")
    with pytest.raises(ValueError, match="embed needs an embedding model"):
        llm.embed(PROMPTS[:1])
    assert wants_pooling(reward_model) and wants_pooling("anything", "pooling")
    with pytest.raises(ValueError, match="runner='generate' cannot serve"):
        wants_pooling(reward_model, "generate")

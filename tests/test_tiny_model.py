"""Tests for the tiny offline model builder and the shared test helpers."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import EOS_ID, hf_greedy, make_prompt_token_ids, strip_after_eos
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.tools.make_tiny_model import (
    FAMILIES,
    RECOMMENDED_EOS_BOOST,
    build_tokenizer,
    main,
    make_config,
    make_tiny_model,
)

TEXTS = [
    "Hello world, how are you today?",
    "  leading spaces, tabs\tand\nnewlines  ",
    "héllo ✓ naïve café 日本語 🎉",
    "def f(x):\n    return x * 2  # 42",
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loads_offline_and_generates(tiny_model_factory, family):
    path = tiny_model_factory(family)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    assert model.generation_config.eos_token_id == 2
    assert cfg.vocab_size == len(tok) == 512
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = torch.tensor([tok.encode(TEXTS[0])])
    assert ids[0, 0] == 1
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False
    )
    assert out.shape[1] > ids.shape[1]
    assert int(out.max()) < cfg.vocab_size


def test_family_config_details():
    mistral = make_config("mistral")
    assert mistral.sliding_window == 24
    gemma2 = make_config("gemma2")
    assert gemma2.layer_types == ["sliding_attention", "full_attention"]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert make_config("qwen2").use_sliding_window is False
    assert make_config("llama").num_key_value_heads == 2
    gpt2 = make_config("gpt2", hidden_size=32, intermediate_size=48, num_hidden_layers=3)
    assert (gpt2.n_embd, gpt2.n_inner, gpt2.n_layer) == (32, 48, 3)
    assert make_config("llama", 300, hidden_size=128).head_dim == 32
    with pytest.raises(ValueError):
        make_config("opt", num_key_value_heads=2)
    with pytest.raises(ValueError):
        make_config("nonexistent")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tokenizer_round_trip(tiny_model_factory, family):
    tokenizers = [build_tokenizer(512), AutoTokenizer.from_pretrained(tiny_model_factory(family))]
    for tok in tokenizers:
        for text in TEXTS:
            ids = tok.encode(text)
            assert ids[0] == 1 and 2 not in ids
            assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tokenizers[1].apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<s>") and chat.endswith("<|assistant|>\n")


def test_tokenizer_is_deterministic_and_sized():
    train = build_tokenizer.__wrapped__
    assert train(512).backend_tokenizer.to_str() == train(512).backend_tokenizer.to_str()
    for size in (259, 1024):
        tok = build_tokenizer(size)
        assert len(tok) == size
        assert tok.decode(list(range(size)))  # every id decodes
    with pytest.raises(ValueError):
        build_tokenizer(100)


def test_same_seed_same_bytes(tmp_path):
    kw = {"family": "gpt2", "num_hidden_layers": 1, "with_tokenizer": False, "eos_boost": 0.06}
    a = make_tiny_model(tmp_path / "a", seed=3, **kw)
    b = make_tiny_model(tmp_path / "b", seed=3, **kw)
    c = make_tiny_model(tmp_path / "c", seed=4, **kw)
    blob = (a / "model.safetensors").read_bytes()
    assert blob == (b / "model.safetensors").read_bytes()
    assert blob != (c / "model.safetensors").read_bytes()
    assert not (a / "tokenizer.json").exists()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eos_boost_makes_eos_reachable(tiny_model_factory, family):
    prompts = make_prompt_token_ids(16, 4, 48, 512, seed=0, include_lengths=(16, 32, 48))
    boosted = hf_greedy(tiny_model_factory(family, eos_boost=RECOMMENDED_EOS_BOOST), prompts, 40)
    ended = [out for out in boosted if out[-1] == EOS_ID]
    assert 1 <= len(ended) < len(prompts)
    for out in boosted:
        assert 1 <= len(out) <= 40 and EOS_ID not in out[:-1]
        assert out[-1] == EOS_ID or len(out) == 40


def test_eos_boost_rejects_out_of_range(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path, family="llama", eos_boost=2.0, num_hidden_layers=1)


def test_make_prompt_token_ids():
    a = make_prompt_token_ids(10, 3, 20, 512, seed=1, include_lengths=(16, 32))
    assert a == make_prompt_token_ids(10, 3, 20, 512, seed=1, include_lengths=(16, 32))
    assert a != make_prompt_token_ids(10, 3, 20, 512, seed=2, include_lengths=(16, 32))
    lengths = [len(p) for p in a]
    assert len(a) == 10 and 16 in lengths and 32 in lengths
    assert all(3 <= n <= 20 for n in lengths if n not in (16, 32))
    assert all(p[0] == 1 and all(3 <= t < 512 for t in p[1:]) for p in a)


def test_strip_after_eos():
    assert strip_after_eos([5, 2, 7, 2]) == [5, 2]
    assert strip_after_eos([5, 6]) == [5, 6]


def test_cli_writes_folder(tmp_path, capsys):
    out = tmp_path / "cli"
    main([str(out), "--family", "opt", "--num-layers", "1", "--hidden-size", "32"])
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("opt", 1, 32)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (out / "tokenizer.json").exists()

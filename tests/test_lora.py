"""LoRA adapters per prompt (batchgen/lora) against PEFT's own unmerged models.

A batch mixing the base model and three tiny PEFT adapters (different ranks, targets, alpha/r
and rsLoRA scaling) gives the greedy tokens PEFT's model generates for each adapter's prompts
alone; also with chunked prefill, a prefix hit, a preempting pool, n samples and beams; the
same prompt under two adapters differs and shares no blocks; bad adapters are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    EOS_ID,
    PAD_ID,
    fresh_hf_model,
    make_prompt_token_ids,
    model_greedy,
    save_lora_adapter,
    strip_after_eos,
)

peft = pytest.importorskip("peft")

from batchgen import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from batchgen.lora import LoRARequest  # noqa: E402

ADAPTERS = {  # name: (r, alpha, targets, rslora)
    "a": (4, 8, ["q_proj", "v_proj"], False),
    "b": (8, 16, ["o_proj", "gate_proj", "down_proj"], True),
    "c": (2, 4, ["k_proj", "up_proj", "q_proj"], False),
    "a2": (4, 8, ["q_proj", "v_proj"], False),  # a's shape, other values: load_weights
}
NEW = 8


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory("llama", num_hidden_layers=2)
    root = tmp_path_factory.mktemp("loras")
    reqs, oracles = {}, {}
    for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items(), 1):
        save_lora_adapter(model_dir, root / name, r, targets, i, alpha, rs)
        reqs[name] = LoRARequest(name, i, str(root / name))
        oracles[name] = peft.PeftModel.from_pretrained(fresh_hf_model(model_dir), root / name).eval()
    oracles[None] = fresh_hf_model(model_dir)
    return model_dir, reqs, oracles


def _peft_greedy(model, prompt: list[int]) -> list[int]:
    return model_greedy(model, [prompt], NEW)[0]


def _llm(model_dir: Path, **kw) -> LLM:
    return LLM(str(model_dir), enable_lora=True, max_lora_rank=8, **{"max_loras": 4} | kw)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16},
                                {"num_kv_blocks": 12, "max_num_seqs": 8},
                                {"max_loras": 2, "max_cpu_loras": 2}],
                         ids=["plain", "chunked", "preempting", "lru"])
def test_mixed_batch_equals_peft_per_adapter(setup, kw):
    model_dir, reqs, oracles = setup
    prompts = make_prompt_token_ids(8, 18, 30, 512, seed=3)
    prompts.append(prompts[0])  # the same prompt under another adapter
    names = [None, "a", "b", "c", "a", "b", "c", None, "b"]
    llm = _llm(model_dir, block_size=4, **kw)
    layers, per_step = llm.engine.runner.lora, []
    begin = layers.begin_step

    def spy(rows, batch):  # the adapters present in each step
        begin(rows, batch)
        per_step.append(len(layers.segments))

    layers.begin_step = spy
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=False)
    # twice: the second call hits the prefix cache of the first
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=[reqs.get(n) for n in names], use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        want = [_peft_greedy(oracles[n], p) for n, p in zip(names, prompts)]
        assert got == want
    assert got[0] != got[-1]  # the same prompt, base vs adapter b
    stats = llm.kv_stats()
    assert 0 < max(per_step) <= kw.get("max_loras", 4)
    if "max_loras" in kw:  # 3 adapters through 2 slots: each call loads more than 2
        assert stats.lora_loads > 2 and stats.prefix_hit_tokens > 0
    elif "num_kv_blocks" in kw:
        assert stats.preemptions > 0
    else:
        assert stats.lora_loads == 0  # the first call loaded them into 4 slots
        assert stats.prefix_hit_tokens > 0


def test_same_prompt_under_two_adapters_shares_no_blocks(setup):
    model_dir, reqs, _ = setup
    prompt = {"prompt_token_ids": make_prompt_token_ids(1, 33, 33, 512, seed=5)[0]}
    llm = _llm(model_dir, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt], params, lora_request=reqs["a"], use_tqdm=False)
    llm.generate([prompt], params, lora_request=reqs["b"], use_tqdm=False)
    assert llm.kv_stats().prefix_hit_tokens == 0
    llm.generate([prompt], params, lora_request=reqs["b"], use_tqdm=False)
    assert llm.kv_stats().prefix_hit_tokens > 0


def test_samples_and_beams_keep_their_adapter(setup):
    model_dir, reqs, oracles = setup
    prompts = make_prompt_token_ids(2, 12, 20, 512, seed=7)
    llm = _llm(model_dir, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=3, temperature=0, max_tokens=NEW),
                        lora_request=[reqs["a"], reqs["c"]], use_tqdm=False)
    for o, p, n in zip(outs, prompts, "ac"):
        want = _peft_greedy(oracles[n], p)
        assert [list(s.token_ids) for s in o.outputs] == [want] * 3
    beams = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                            BeamSearchParams(beam_width=2, max_tokens=4),
                            lora_request=[reqs["b"], None], use_tqdm=False)
    for b, p, n in zip(beams, prompts, ["b", None]):
        ids = torch.tensor([p])
        hf = oracles[n].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                 num_beams=2, num_return_sequences=2, do_sample=False,
                                 eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        assert [s.tokens for s in b.sequences] == [strip_after_eos(h.tolist()) for h in hf]
    waved = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                            BeamSearchParams(beam_width=2, max_tokens=4), concurrency_limit=1,
                            lora_request=[reqs["b"], None], use_tqdm=False)  # cut per wave
    assert [[s.tokens for s in w.sequences] for w in waved] == [
        [s.tokens for s in b.sequences] for b in beams]


def _folder(tmp_path: Path, src: Path, **changes) -> LoRARequest:
    dst = tmp_path / "bad"
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text()) | changes
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors")
                                                    .read_bytes())
    return LoRARequest("bad", 9, str(dst))


@pytest.mark.parametrize("changes,words", [
    ({"use_dora": True}, "DoRA"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"r": 64}, "max_lora_rank"), ({"target_modules": ["q_proj", "w9"]}, "w9"),
    (None, "missing")], ids=["dora", "modules_to_save", "rank", "target", "path"])
def test_bad_adapters_are_refused_before_work(setup, tmp_path, changes, words):
    model_dir, reqs, _ = setup
    llm = _llm(model_dir)
    req = (LoRARequest("bad", 9, str(tmp_path / "missing")) if changes is None
           else _folder(tmp_path, Path(reqs["a"].lora_path), **changes))
    with pytest.raises(ValueError, match="'bad'") as e:
        llm.generate(["hi"], SamplingParams(max_tokens=2), lora_request=req, use_tqdm=False)
    assert words in str(e.value)
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(model_dir)).generate(["hi"], lora_request=reqs["a"], use_tqdm=False)


def test_vllm_scripts_import_lora_request_from_the_compat_layer():
    import batchgen.vllm_compat as compat

    compat.install()
    try:
        from vllm.lora.request import LoRARequest as Theirs

        assert Theirs is LoRARequest
    finally:
        compat.uninstall()


def test_streams_take_a_list_by_input_index(setup):
    model_dir, reqs, oracles = setup
    prompts = make_prompt_token_ids(3, 10, 16, 512, seed=11)
    names = ["c", None, "a"]
    llm = _llm(model_dir, max_loras=1)  # one slot: the adapters take turns
    got = dict(llm.generate_stream(iter([{"prompt_token_ids": p} for p in prompts]),
                                   SamplingParams(temperature=0, max_tokens=NEW),
                                   lora_request=[reqs.get(n) for n in names], use_tqdm=False))
    assert [list(got[i].outputs[0].token_ids) for i in range(3)] == [
        _peft_greedy(oracles[n], p) for n, p in zip(names, prompts)]


@pytest.mark.parametrize("kw,words", [
    ({"enable_lora": "yes"}, "enable_lora"), ({"max_loras": 0}, "max_loras"),
    ({"max_lora_rank": -1}, "max_lora_rank"), ({"max_cpu_loras": 0}, "max_cpu_loras")])
def test_lora_engine_arguments_are_checked_before_weights(tmp_path, kw, words):
    with pytest.raises(ValueError, match=words):
        LLM(str(tmp_path / "no-such-model"), **kw)


def test_load_weights_pushes_an_adapters_tensors_by_peft_names(setup):
    model_dir, reqs, oracles = setup
    prompt = make_prompt_token_ids(1, 20, 20, 512, seed=13)[0]
    llm = _llm(model_dir, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NEW)

    def run() -> list[int]:
        out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=reqs["a"],
                           use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    assert run() == _peft_greedy(oracles["a"], prompt)
    pushed = [(n, p.detach()) for n, p in oracles["a2"].named_parameters() if "lora_" in n]
    with pytest.raises(ValueError, match="names no LoRA A or B weight"):
        llm.load_weights([("model.layers.0.mlp.up_proj.lora_A.weight", pushed[0][1])],
                         lora_request=reqs["a"])
    assert llm.load_weights(pushed, lora_request=reqs["a"]) == {n for n, _ in pushed}
    want = _peft_greedy(oracles["a2"], prompt)
    assert want != _peft_greedy(oracles["a"], prompt) and run() == want

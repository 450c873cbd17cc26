"""Bad input raises ValueError naming the argument, before any work; nothing leaks."""

import json

import pytest
from transformers import AutoConfig

from batchgen import LLM, SamplingParams
from batchgen.model.loader import check_supported


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama"), block_size=4, num_kv_blocks=64, max_model_len=128)


def ids(n, start=3):
    return {"prompt_token_ids": [1] + [start + i % 100 for i in range(n - 1)]}


BAD_REQUESTS = [
    ("max_model_len", lambda: [ids(128)], None),
    ("max_model_len", lambda: [ids(200)], None),
    ("empty", lambda: [{"prompt_token_ids": []}], None),
    ("vocabulary", lambda: [{"prompt_token_ids": [1, 99999]}], None),
    ("vocabulary", lambda: [{"prompt_token_ids": [1, -4]}], None),
    ("prompts\\[0\\]", lambda: [123], None),
    ("prompts\\[1\\]", lambda: ["fine", {"tokens": [1]}], None),
    ("prompt_token_ids", lambda: [{"prompt_token_ids": "abc"}], None),
    ("sampling_params", lambda: [ids(5), ids(6)], [SamplingParams()]),
    (r"sampling_params\[1\] must be a SamplingParams, got str", lambda: [ids(5), ids(6)],
     [SamplingParams(), "greedy"]),
    ("can never fit", lambda: [ids(100)], SamplingParams(n=8, max_tokens=27)),
    ("logprobs", lambda: [ids(5)], SamplingParams(logprobs=100000)),
]


@pytest.mark.parametrize("match,prompts,params", BAD_REQUESTS)
def test_bad_requests_raise_before_any_work(llm, match, prompts, params):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts(), params, use_tqdm=False)
    assert llm.engine.kv.block_manager.num_free_blocks() == llm.engine.kv.block_manager.num_blocks
    assert not llm.engine.scheduler.has_unfinished()


def test_a_bad_request_loses_nothing_and_the_engine_still_works(llm):
    good = [ids(9), ids(20)]
    before = llm.generate(good, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate([*good, ids(500)], SamplingParams(temperature=0, max_tokens=5),
                     use_tqdm=False)
    after = llm.generate(good, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in before] == [o.outputs[0].token_ids for o in after]


BAD_ENGINE_ARGS = [
    ("block_size", {"block_size": 0}),
    ("block_size", {"block_size": 2.0}),
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": 1.5}),
    ("gpu_memory_utilization", {"gpu_memory_utilization": True}),
    ("enable_prefix_caching", {"enable_prefix_caching": 1}),
    ("KV pool holds 1 token", {"block_size": 1, "num_kv_blocks": 1}),
    (r"max_model_len must be None or an integer >= 2 \(room for a prompt token and a "
     r"generated one\), got 1", {"max_model_len": 1}),
    ("max_model_len must be None or an integer >= 2", {"max_model_len": True}),
    ("max_num_seqs", {"max_num_seqs": -1}),
    ("max_num_batched_tokens", {"max_num_batched_tokens": 0}),
    ("num_kv_blocks", {"num_kv_blocks": 0}),
    ("kv_cache_memory", {"kv_cache_memory": 10}),
    ("gpu_memory_utilization", {"gpu_memory_utilization": 1.5}),
    ("kv_cache_dtype", {"kv_cache_dtype": "fp4"}),
    ("attention_backend", {"attention_backend": "magic"}),
    ("dtype", {"dtype": "int3"}),
    ("device", {"device": "tpu"}),
    ("max_model_len", {"max_model_len": 5000}),
    ("max_model_len", {"max_model_len": 600, "num_kv_blocks": 10, "block_size": 4}),
]


@pytest.mark.parametrize("match,kwargs", BAD_ENGINE_ARGS)
def test_bad_engine_arguments_fail_before_the_weights_load(tiny_model_factory, monkeypatch,
                                                           match, kwargs):
    from batchgen.model import loader

    loads = []
    monkeypatch.setattr(loader, "load_model", lambda *a: loads.append(a))
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_factory("llama"), **kwargs)
    assert loads == []  # nothing loaded, nothing allocated


@pytest.mark.parametrize("model", [None, 3, b"path"])
def test_model_must_be_a_path(model):
    with pytest.raises(ValueError, match="model must be the path"):
        LLM(model)


def test_corrupt_weights_name_the_file_before_loading(tiny_model_factory, tmp_path):
    import shutil

    shutil.copytree(tiny_model_factory("llama"), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(b"\xff" * 64)  # a header length no file could have
    with pytest.raises(ValueError, match="model.safetensors.* cannot be read"):
        LLM(tmp_path / "m", num_kv_blocks=8)


def test_a_one_block_pool_serves_what_fits_it(tiny_model_factory):
    """max_model_len follows the pool (4 tokens): small requests run, bigger ones are refused
    up front with the numbers."""
    llm = LLM(tiny_model_factory("llama"), block_size=4, num_kv_blocks=1)
    assert llm.max_model_len == 4
    out = llm.generate(ids(2), SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="needs 2 KV blocks"):
        llm.generate(ids(2), SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    assert llm.engine.kv.block_manager.num_free_blocks() == 1


def test_the_smallest_pool_serves_the_smallest_request(tiny_model_factory):
    """Two tokens (one prompt token, one generated) is the least a pool, or max_model_len,
    may hold (less is refused above): a 1-token prompt with max_tokens=1 needs one block."""
    llm = LLM(tiny_model_factory("llama"), block_size=2, num_kv_blocks=1)
    assert llm.max_model_len == 2
    out = llm.generate(ids(1), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
    assert llm.engine.kv.block_manager.num_free_blocks() == 1


def test_unknown_folder(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(tmp_path / "nope")
    with pytest.raises(ValueError, match="model"):
        LLM(tmp_path)


@pytest.mark.parametrize("family", ["falcon", "bloom", "mpt", "gpt_neo", "xglm"])
def test_families_that_bypass_the_attention_interface_are_refused(family):
    with pytest.raises(ValueError, match="not supported"):
        check_supported(AutoConfig.for_model(family))


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_batch_dependent_rope_scalings_are_refused(tiny_model_factory, tmp_path, rope_type):
    src = tiny_model_factory("llama")
    cfg = json.loads((src / "config.json").read_text())
    rope = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        rope.update(short_factor=[1.0] * 8, long_factor=[1.0] * 8,
                    original_max_position_embeddings=512)
    cfg["rope_parameters"] = rope
    cfg["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rope_type):
        LLM(tmp_path)


def test_text_prompts_need_a_tokenizer(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama", with_tokenizer=False), num_kv_blocks=32)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(ids(4), SamplingParams(stop="x"), use_tqdm=False)
    out = llm.generate(ids(4), SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == ""


def test_a_failed_call_leaves_a_clean_engine(llm):
    """An error (or Ctrl-C) mid-run frees every block; the next call works normally."""
    good = [ids(9), ids(20)]
    want = llm.generate(good, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    calls = []

    def failing(module, args, kwargs):
        calls.append(1)
        if len(calls) == 3:  # the model itself raises in the third step
            raise KeyboardInterrupt

    hook = llm.model.register_forward_pre_hook(failing, with_kwargs=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(good, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    finally:
        hook.remove()
    assert not llm.engine.scheduler.has_unfinished()
    assert llm.engine.kv.block_manager.num_free_blocks() == llm.engine.kv.block_manager.num_blocks
    again = llm.generate(good, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]


def test_host_allocator_tuning_is_applied_once_and_can_be_switched_off(monkeypatch):
    import platform

    from batchgen import cpu_allocator

    monkeypatch.setenv(cpu_allocator.ENV_SWITCH, "0")
    assert cpu_allocator.tune_host_allocator() is False
    monkeypatch.delenv(cpu_allocator.ENV_SWITCH)
    if platform.libc_ver()[0] == "glibc":  # glibc accepts all three thresholds
        assert cpu_allocator.tune_host_allocator() is True
        assert cpu_allocator.tune_host_allocator() is True  # idempotent


def test_a_cpu_llm_tunes_the_host_allocator(tiny_model_factory, monkeypatch):
    from batchgen import cpu_allocator

    calls = []
    monkeypatch.setattr(cpu_allocator, "tune_host_allocator", lambda: calls.append(1) or True)
    LLM(tiny_model_factory("llama"), num_kv_blocks=16, device="cpu")
    assert calls == [1]

"""What vLLM's own offline tests rely on, checked on batchgen (written here): max_logprobs'
bound, priority scheduling (order only, never outputs), beam search's concurrency_limit,
request metrics and aggregate stats, and the vllm_compat names scripts import."""

from __future__ import annotations

import importlib.util

import pytest

import batchgen.vllm_compat as compat
from batchgen import LLM, BeamSearchParams, SamplingParams

PROMPTS = [{"prompt_token_ids": [5 + i, 17, 40 + 3 * i, 9]} for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("llama", vocab_size=300, seed=44)


def make(folder, **kw) -> LLM:
    return LLM(folder, num_kv_blocks=32, max_model_len=64, **kw)


def test_max_logprobs_bounds_requests_with_vllms_message(folder) -> None:
    llm = make(folder, max_logprobs=2)
    for name in ("logprobs", "prompt_logprobs"):
        what = "sample" if name == "logprobs" else "prompt"
        with pytest.raises(ValueError, match=f"^Requested {what} logprobs of 3, which is "
                                             "greater than max allowed: 2") as e:
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **{name: 3}), use_tqdm=False)
        assert e.value.parameter == name
        with pytest.raises(ValueError, match="logprobs of 300, which is greater"):  # -1: vocab
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **{name: -1}), use_tqdm=False)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)
    assert all(len(d) >= 2 for d in out[0].outputs[0].logprobs)
    whole = make(folder, max_logprobs=-1).generate(
        PROMPTS[0], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    assert len(whole[0].outputs[0].logprobs[0]) == 300


def test_priority_orders_admission_and_changes_no_output(folder) -> None:
    fcfs = make(folder, max_num_seqs=1).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = make(folder, max_num_seqs=1, scheduling_policy="priority", disable_log_stats=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[2, 0, 1])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fcfs]
    assert [o.outputs[0].cumulative_logprob for o in outs] == [
        o.outputs[0].cumulative_logprob for o in fcfs]
    started = [o.metrics.scheduled_ts for o in outs]  # one row at a time: strictly ordered
    assert started[1] < started[2] < started[0]
    ties = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[1, 0, 1])
    assert ties[1].metrics.scheduled_ts < ties[0].metrics.scheduled_ts < \
        ties[2].metrics.scheduled_ts  # equal priorities keep input order
    with pytest.raises(ValueError, match=r"lengths of prompts \(3\) and priority \(2\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0, 1])


def test_metrics_when_asked_and_none_otherwise(folder) -> None:
    off = make(folder)
    assert off.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].metrics is None
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        off.get_metrics()
    llm = make(folder, disable_log_stats=False)
    outs = llm.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=4,
                                                ignore_eos=True), use_tqdm=False)
    for o in outs:
        m = o.metrics
        assert m.arrival_time > 1e9 and m.num_prompt_tokens == 4
        assert 0 < m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
        assert m.num_generation_tokens == 8 and m.first_token_latency > 0 and m.e2e_latency > 0
    got = {(x.name, x.labels.get("finished_reason")): x for x in llm.get_metrics()}
    assert got["vllm:prompt_tokens", None].value == 12
    assert got["vllm:generation_tokens", None].value == 24
    assert got["vllm:request_success", "length"].value == 3
    assert got["vllm:time_to_first_token_seconds", None].count == 3
    assert got["vllm:e2e_request_latency_seconds", None].buckets["+Inf"] == 3
    assert 0 <= got["vllm:kv_cache_usage_perc", None].value <= 1


def test_beam_concurrency_limit_runs_waves_with_the_same_beams(folder) -> None:
    llm = make(folder)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    whole = llm.beam_search(PROMPTS, params, use_tqdm=False)
    waves = llm.beam_search(PROMPTS, params, use_tqdm=True, concurrency_limit=2)
    assert [[s.token_ids for s in o.sequences] for o in waves] == [
        [s.token_ids for s in o.sequences] for o in whole]


def test_vllm_import_paths_and_cumulative_logprob(folder) -> None:
    assert importlib.util.find_spec("vllm") is None, "a real vLLM is installed here"
    compat.install()
    try:
        from vllm import SamplingParams as VSamplingParams
        from vllm.entrypoints.llm import LLM as VLLM
        from vllm.exceptions import VLLMValidationError

        llm = VLLM(str(folder), num_kv_blocks=32, max_model_len=64, max_logprobs=1)
        plain, scored = llm.generate([PROMPTS[0]] * 2, [
            VSamplingParams(temperature=0, max_tokens=3),
            VSamplingParams(temperature=0, max_tokens=3, logprobs=0)], use_tqdm=False)
        assert plain.outputs[0].cumulative_logprob is None  # vLLM's: no logprobs asked
        assert scored.outputs[0].cumulative_logprob < 0
        with pytest.raises(VLLMValidationError, match="max allowed: 1"):
            llm.generate(PROMPTS[0], VSamplingParams(logprobs=2), use_tqdm=False)
        cfg = llm.llm_engine.vllm_config  # what vLLM's tests read of the engine's config
        assert (cfg.cache_config.enable_prefix_caching, cfg.cache_config.num_gpu_blocks,
                cfg.scheduler_config.max_num_seqs) == (True, 32, 256)
        off = VLLM(str(folder), num_kv_blocks=32, max_model_len=64, enable_prefix_caching=False)
        assert not off.llm_engine.vllm_config.cache_config.enable_prefix_caching
        for seed in (-1, 2**32):  # vLLM's engine seed is in [0, 2**32); checked first
            with pytest.raises(VLLMValidationError, match=r"seed must be an integer in \[0, "):
                VLLM(str(folder), seed=seed, load_format="dummy")
    finally:
        compat.uninstall()
    # batchgen's own LLM keeps reporting it (dataset jobs write it)
    assert make(folder).generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[
        0].cumulative_logprob < 0


def test_llm_level_chat_template_and_generation_config(folder) -> None:
    llm = make(folder, chat_template="{{ messages[0]['content'] }}!", generation_config="vllm")
    out = llm.chat([{"role": "user", "content": "abc"}], GREEDY, use_tqdm=False)
    assert out[0].prompt == "abc!"
    assert llm.get_default_sampling_params() == SamplingParams()


def test_priority_preempts_the_lowest_and_outputs_stay(folder) -> None:
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    two = PROMPTS[:2]
    kw = dict(block_size=4, num_kv_blocks=9, max_model_len=32, disable_log_stats=False)
    ref = LLM(folder, **kw).generate(two, long, use_tqdm=False)
    llm = LLM(folder, scheduling_policy="priority", **kw)
    outs = llm.generate(two, long, use_tqdm=False, priority=[1, 0])
    assert llm.kv_stats().preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert outs[0].metrics.num_preemptions > 0 and outs[1].metrics.num_preemptions == 0


def test_skip_tokenizer_init_takes_token_ids_and_returns_no_text(folder) -> None:
    """vLLM's skip_tokenizer_init=True: no tokenizer is loaded; token-id prompts run as with
    one (the same tokens and logprobs), outputs carry no text, and what needs text is
    refused before any work."""
    scored = SamplingParams(temperature=0, max_tokens=5, logprobs=2)
    want = make(folder).generate(PROMPTS, scored, use_tqdm=False)
    llm = make(folder, skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    outs = llm.generate(PROMPTS, scored, use_tqdm=False)
    for o, w in zip(outs, want):
        got, ref = o.outputs[0], w.outputs[0]
        assert got.token_ids == ref.token_ids and got.text == "" and ref.text
        assert [{t: lp.logprob for t, lp in d.items()} for d in got.logprobs] == [
            {t: lp.logprob for t, lp in d.items()} for d in ref.logprobs]
        assert all(lp.decoded_token is None for d in got.logprobs for lp in d.values())
    for call in (lambda: llm.generate("hello", GREEDY, use_tqdm=False),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False),
                 lambda: llm.generate(PROMPTS[0], SamplingParams(stop=["x"]), use_tqdm=False)):
        with pytest.raises(ValueError, match=r"skip_tokenizer_init=True"):
            call()
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [999999]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init must be True or False"):
        make(folder, skip_tokenizer_init="yes")

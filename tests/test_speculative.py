"""Trace replay (vLLM's enable_trace_replay / trace_decode_token_ids) and ngram speculative
decoding (batchgen/speculative): outputs with speculation equal those without it and HF's
greedy ones, seeded sampling too; drafts are accepted; vLLM's refusals are ValueErrors."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams
from tests.helpers import hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# the tiny llama's greedy text loops after these prompts (71s, 202s), and not after the last
PROMPTS = [[27, 28, 29] * 4, [36, 37, 38] * 4, [5, 9, 11, 4]]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llms(model):
    """A plain LLM and one with ngram speculation (a small pool: preemption happens too)."""
    kw = dict(num_kv_blocks=64, block_size=4, disable_log_stats=False)
    return LLM(model, **kw), LLM(model, speculative_config=NGRAM, **kw)


def _run(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _metric(llm, name):
    return sum(m.value for m in llm.get_metrics() if m.name == f"vllm:spec_decode_num_{name}")


def test_greedy_with_speculation_equals_plain_and_hf(model, llms) -> None:
    plain, spec = llms
    lengths = [24, 13, 24]  # a row finishing mid-step moves the batch's slots
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    got = _run(spec, params)
    assert [ids for ids, _ in got] == [ids for ids, _ in _run(plain, params)]
    assert [ids for ids, _ in got] == [ref[:n] for ref, n in
                                       zip(hf_greedy(model, PROMPTS, 24), lengths)]
    stats = spec.kv_stats()
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert stats.spec_drafts > 0 and _metric(spec, "accepted_tokens") > 0
    assert plain.kv_stats().spec_drafts == 0


def test_seeded_sampling_with_speculation_equals_plain(llms) -> None:
    plain, spec = llms
    before = _metric(spec, "accepted_tokens")
    for rp in (1.0, 1.1):  # the draws are keyed by (sequence, position): the same tokens
        params = SamplingParams(temperature=0.3, seed=7, max_tokens=24, logprobs=2,
                                repetition_penalty=rp)
        for (ids, lps), (ref_ids, ref_lps) in zip(_run(spec, params), _run(plain, params)):
            assert ids == ref_ids  # logprobs: a multi-token forward's float sums, not bits
            assert [lp[t].logprob for t, lp in zip(ids, lps)] == pytest.approx(
                [lp[t].logprob for t, lp in zip(ids, ref_lps)], abs=1e-5)
    assert _metric(spec, "accepted_tokens") > before


def test_trace_replay_emits_the_trace_with_its_logprobs(model) -> None:
    llm = LLM(model, num_kv_blocks=64, block_size=4, enable_trace_replay=True)
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=1,
                                                 ignore_eos=True), use_tqdm=False)[0].outputs[0]
    replay = llm.generate(prompt, SamplingParams(trace_decode_token_ids=greedy.token_ids,
                                                 max_tokens=20, logprobs=1),
                          use_tqdm=False)[0].outputs[0]
    assert replay.token_ids == greedy.token_ids and replay.logprobs == greedy.logprobs
    trace = [7, 2, 7, 2, 9]  # EOS (2) does not stop a trace; min_tokens is 0; max_tokens cuts
    out = llm.generate(prompt, SamplingParams(trace_decode_token_ids=trace, max_tokens=4,
                                              temperature=1.0, seed=3), use_tqdm=False)
    assert out[0].outputs[0].token_ids == trace[:4]


def test_trace_replay_with_speculation_accepts_drafts(model) -> None:
    llm = LLM(model, num_kv_blocks=64, block_size=4, enable_trace_replay=True,
              speculative_config=NGRAM, disable_log_stats=False)
    # periodic traces are drafted and accepted; the first ends mid-step (slots move)
    traces = [[40, 41, 42] * 3 + [40], [50, 51, 52] * 6, [60, 61, 62] * 6]
    outs = llm.generate([{"prompt_token_ids": t[:4]} for t in traces],
                        [SamplingParams(trace_decode_token_ids=t, max_tokens=len(t), logprobs=1)
                         for t in traces], use_tqdm=False)
    for trace, out in zip(traces, outs):
        assert out.outputs[0].token_ids == trace and len(out.outputs[0].logprobs) == len(trace)
    assert _metric(llm, "accepted_tokens") > 10


@pytest.mark.parametrize(("kw", "message"), [
    (dict(trace_decode_token_ids=[]), "non-empty"),
    (dict(trace_decode_token_ids=[1], n=2), "requires n=1"),
    (dict(trace_decode_token_ids=[-1]), "non-negative"),
    (dict(trace_decode_token_ids=[1], prompt_logprobs=1), "prompt_logprobs"),
    (dict(trace_decode_token_ids=[1], prompt_logprob_token_ids=[[1]]), "prompt_logprob_token"),
    (dict(trace_decode_token_ids=[1], bad_words=["a"]), "bad_words"),
])
def test_trace_refusals_at_construction(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_trace_refusals_at_generate(model, llms) -> None:
    plain, _ = llms
    prompt = {"prompt_token_ids": [5, 6]}
    with pytest.raises(ValueError, match="--enable-trace-replay"):
        plain.generate(prompt, SamplingParams(trace_decode_token_ids=[1]), use_tqdm=False)
    llm = LLM(model, num_kv_blocks=16, block_size=4, enable_trace_replay=True)
    with pytest.raises(ValueError, match="out-of-vocab token ids"):
        llm.generate(prompt, SamplingParams(trace_decode_token_ids=[1, 10**6]), use_tqdm=False)


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "'ngram'"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ("ngram", "a dict"),
])
def test_spec_config_refusals(tmp_path, config, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tmp_path / "no-model", speculative_config=config)


def test_spec_config_refuses_tensor_parallel(tmp_path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tmp_path / "no-model", speculative_config=NGRAM, tensor_parallel_size=2)


def _lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """vLLM's ngram rule written plainly: the longest n in [lo, hi] whose suffix occurs
    earlier, its rightmost occurrence, the k tokens after it."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposals_follow_vllms_rule() -> None:
    import numpy as np

    from batchgen.speculative.config import SpecConfig
    from batchgen.speculative.ngram import propose

    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, int(rng.integers(1, 24))).tolist()
        k, lo = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        got = propose(np.array(tokens, np.int64), SpecConfig(k, lo, hi), 9).tolist()
        assert got == _lookup(tokens, k, lo, hi)


def test_spec_config_refuses_a_hybrid_model(tmp_path) -> None:
    """A state mixer's state cannot rewind rejected drafts: refused from the config (the
    engine's plan), naming the family."""
    from tests.families import save_family_model

    folder = save_family_model("lfm2", tmp_path / "lfm2")
    with pytest.raises(ValueError, match="'lfm2' has state mixers"):
        LLM(folder, speculative_config=NGRAM, num_kv_blocks=16)


def test_token_arrays_grow_by_the_new_tokens_and_drop_rows_that_left() -> None:
    from batchgen.speculative.ngram import TokenArrays

    class Seq:  # keyed by identity, as engine Sequences are
        def __init__(self, token_ids: list[int]) -> None:
            self.token_ids = token_ids

    arrays, a, b = TokenArrays(), Seq([1, 2]), Seq([])
    for step in range(100):  # past the buffer's spare room
        got = arrays.of([a, b])
        assert [g.tolist() for g in got] == [a.token_ids, b.token_ids]
        a.token_ids += [step, step + 1]
        b.token_ids.append(step)
    arrays.of([b])
    assert a not in arrays._arrays

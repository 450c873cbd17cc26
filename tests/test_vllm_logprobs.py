"""vLLM 0.34's logprob options on batchgen: `logprob_token_ids` (each token's logprobs of the
ids a request names), `flat_logprobs` (the FlatLogprobs container) and `SamplingParams.verify`;
checked against the whole-vocabulary logprobs of the same runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchgen import LLM, SamplingParams
from batchgen.checks import ValidationError
from batchgen.outputs import FlatLogprobs

PROMPTS = [{"prompt_token_ids": [5, 17, 40, 9]}, {"prompt_token_ids": [6, 3, 43, 9, 11]}]
NAMED = [7, 0, 299]


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama", vocab_size=300, seed=44), num_kv_blocks=32,
               max_model_len=64, max_logprobs=-1)


def _as_pairs(position):
    return {t: (lp.logprob, lp.rank) for t, lp in position.items()}


def test_logprob_token_ids_report_the_named_ids_beside_the_chosen_token(llm):
    """Each token carries its own logprob and rank, then the named ids' (their true ranks),
    the values of the whole distribution; a neighbour asking top-k in the same step keeps
    its own; tokens and cumulative logprobs are those of a run without them."""
    sp = dict(temperature=1.0, seed=3, max_tokens=6)
    full = llm.generate(PROMPTS, SamplingParams(logprobs=-1, **sp), use_tqdm=False)
    named, topk = llm.generate(PROMPTS, [SamplingParams(logprob_token_ids=NAMED, **sp),
                                         SamplingParams(logprobs=2, **sp)], use_tqdm=False)
    got, ref = named.outputs[0], full[0].outputs[0]
    assert got.token_ids == ref.token_ids and got.cumulative_logprob == ref.cumulative_logprob
    assert any(lp[t].rank > 1 for t, lp in zip(got.token_ids, got.logprobs))  # sampled
    for t, pos, whole in zip(got.token_ids, got.logprobs, ref.logprobs):
        assert list(pos) == list(dict.fromkeys([t, *NAMED]))
        assert _as_pairs(pos) == {k: (whole[k].logprob, whole[k].rank) for k in pos}
    for t, pos, whole in zip(topk.outputs[0].token_ids, topk.outputs[0].logprobs,
                             full[1].outputs[0].logprobs):
        assert len(pos) in (2, 3) and {lp.rank for k, lp in pos.items() if k != t} <= {1, 2}
        assert _as_pairs(pos) == {k: (whole[k].logprob, whole[k].rank) for k in pos}


def test_logprob_token_ids_are_checked_before_any_work(llm):
    for bad, match in ((["7"], "a list of token ids"), ([-1], "out-of-vocab"),
                       (list(range(129)), "at most 128")):
        with pytest.raises(ValidationError, match=match):
            SamplingParams(logprob_token_ids=bad)
    with pytest.raises(ValidationError, match="logprobs must equal len"):
        SamplingParams(logprob_token_ids=[1, 2], logprobs=1)
    with pytest.raises(ValidationError, match=r"token_id\(s\) \[300\] in logprob_token_ids"):
        llm.generate(PROMPTS, SamplingParams(logprob_token_ids=[1, 300]), use_tqdm=False)
    model = SimpleNamespace(max_logprobs=2, get_vocab_size=lambda: 10)
    SamplingParams(logprob_token_ids=[0, 9]).verify(model)  # vLLM's check against a config
    for bad in (dict(logprob_token_ids=[10]), dict(logprobs=3)):
        with pytest.raises(ValidationError):
            SamplingParams(**bad).verify(model)
    assert SamplingParams(logprob_token_ids=[]).num_logprobs is None  # names none: no logprobs
    out = llm.generate(PROMPTS[0], SamplingParams(logprob_token_ids=[], max_tokens=2),
                       use_tqdm=False)
    assert out[0].outputs[0].logprobs is None


def test_flat_logprobs_hold_the_same_positions(llm):
    """flat_logprobs=True: sample and prompt logprobs come as one FlatLogprobs each, whose
    positions (indexed, sliced, iterated) are the dicts the lists hold."""
    kw = dict(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    plain = llm.generate(PROMPTS, SamplingParams(**kw), use_tqdm=False)
    flat = llm.generate(PROMPTS, SamplingParams(flat_logprobs=True, **kw), use_tqdm=False)
    for p, f in zip(plain, flat):
        lps, prompt = f.outputs[0].logprobs, f.prompt_logprobs
        assert isinstance(lps, FlatLogprobs) and isinstance(prompt, FlatLogprobs)
        assert list(lps) == p.outputs[0].logprobs and len(lps) == 4
        assert prompt[0] == {} and list(prompt[1:]) == p.prompt_logprobs[1:]
        assert list(lps[1:3]) == p.outputs[0].logprobs[1:3] and list(lps[::-2]) == (
            p.outputs[0].logprobs[::-2])
        with pytest.raises(TypeError):
            lps[0] = {}

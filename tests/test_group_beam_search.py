"""Diverse (group) beam search against transformers 4.55.4's `generate(num_beam_groups=G,
diversity_penalty=d)`, recorded in tests/fixtures/group_beam_search.json by
tests/make_group_beam_fixtures.py (transformers 5 has no group beam search)."""

import json
import math
from pathlib import Path

import pytest
import torch

from batchgen import LLM, BeamSearchParams
from batchgen.engine.group_beam import GroupBeamSearchState
from tests.helpers import load_hf_model, make_prompt_token_ids

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "group_beam_search.json").read_text())
T = FIXTURE["max_tokens"]
# (block_size, num_kv_blocks, max_num_batched_tokens); "preempt": one request's bound
LAYOUTS = {"block16": (16, 1024, None), "block1": (1, 4096, None), "preempt": (4, None, 24)}


@pytest.fixture(scope="module", params=FIXTURE["families"])
def family(request, tiny_model_factory):
    """(family, model folder) built as the fixture script built it."""
    return request.param, tiny_model_factory(request.param, eos_boost=FIXTURE["eos_boost"])


def test_the_fixtures_saw_these_weights_and_prompts(family):
    fam, path = family
    assert make_prompt_token_ids(**FIXTURE["prompt_args"]) == FIXTURE["prompts"]
    model = load_hf_model(path)
    for prompt, (ids, lps) in zip(FIXTURE["prompts"], FIXTURE["results"][fam]["first_step_top"]):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        v, i = torch.log_softmax(logits, -1).topk(5)
        assert i.tolist() == ids
        assert v.tolist() == pytest.approx(lps, abs=1e-4)


def _check(llm, fam, case, prompts=None):
    params = BeamSearchParams(max_tokens=T, **FIXTURE["cases"][case])
    prompts = FIXTURE["prompts"] if prompts is None else prompts
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = FIXTURE["results"][fam]["cases"][case]
    lp = params.length_penalty
    for o, w in zip(outs, want):
        assert [s.token_ids for s in o.sequences] == w["token_ids"], case
        for s, score in zip(o.sequences, w["scores"]):
            assert math.isclose(s.score, score, rel_tol=1e-5, abs_tol=1e-4)
            assert math.isclose(s.score, s.cumulative_logprob / len(s.token_ids) ** lp,
                                rel_tol=1e-5)
            assert s.finish_reason == ("stop" if s.token_ids[-1] == 2 else "length")
    assert llm.engine.kv.block_manager.num_free_blocks() == llm.engine.kv.block_manager.num_blocks
    return outs


@pytest.mark.parametrize("case", sorted(FIXTURE["cases"]))
def test_group_beams_equal_transformers_4_55(family, case):
    fam, path = family
    _check(_llm(path, "block16"), fam, case)


@pytest.mark.parametrize("layout", ["block1", "preempt"])
def test_group_beams_at_block_size_1_and_under_preemption(family, layout):
    fam, path = family
    llm = _llm(path, layout)
    _check(llm, fam, "w4g2")
    if layout == "preempt":
        assert llm.kv_stats().preemptions > 0


def test_groups_differ_from_plain_beams(family):
    """The diversity penalty changes the result (the test above could not pass by accident)."""
    fam, path = family
    llm = _llm(path, "block16")
    plain = llm.beam_search([{"prompt_token_ids": p} for p in FIXTURE["prompts"]],
                            BeamSearchParams(beam_width=4, max_tokens=T), use_tqdm=False)
    groups = FIXTURE["results"][fam]["cases"]["w4g2"]
    assert [[s.token_ids for s in o.sequences] for o in plain] != [g["token_ids"] for g in groups]


def test_state_refuses_wrong_rows():
    state = GroupBeamSearchState(4, 2, 1.0, max_tokens=3, stop_ids=[2])
    with pytest.raises(ValueError, match="live beams"):
        state.step(torch.zeros(4, 8))
    step = state.step(torch.log_softmax(torch.randn(1, 8), -1))
    assert len(step.parents) == 4 and set(step.parents) == {0} and state.num_live_beams == 4


def _llm(path, layout):
    bs, blocks, budget = LAYOUTS[layout]
    if blocks is None:
        longest = max(map(len, FIXTURE["prompts"]))
        blocks = math.ceil(longest / bs) + 4 * (math.ceil(T / bs) + 1)
    return LLM(path, block_size=bs, num_kv_blocks=blocks, max_num_batched_tokens=budget,
               max_num_seqs=64)



def test_groups_refuse_top_logprobs():
    """Top-k alternatives are recorded by plain beam search only: asked of diverse beams, a
    ValueError names the argument before any work."""
    with pytest.raises(ValueError, match="logprobs"):
        BeamSearchParams(beam_width=4, max_tokens=4, num_beam_groups=2, diversity_penalty=1.0,
                         logprobs=2)


def test_group_trace_follows_the_groups(tiny_model_factory):
    """The trace of diverse beams: W live beams per step while no group has finished, their
    scores the groups' running scores, and the finished slots the returned hypotheses'."""
    llm = LLM(tiny_model_factory("llama"), block_size=4, num_kv_blocks=128)
    p = BeamSearchParams(beam_width=4, max_tokens=6, num_beam_groups=2, diversity_penalty=1.0,
                         ignore_eos=True, return_trace=True)
    ids = make_prompt_token_ids(1, 7, 7, vocab_size=256, seed=3)[0]
    out = llm.beam_search([{"prompt_token_ids": ids}], p, use_tqdm=False)[0]
    plain = llm.beam_search([{"prompt_token_ids": ids}],
                            BeamSearchParams(beam_width=4, max_tokens=6, num_beam_groups=2,
                                             diversity_penalty=1.0, ignore_eos=True),
                            use_tqdm=False)[0]
    assert [s.token_ids for s in out.sequences] == [s.token_ids for s in plain.sequences]
    live = out.trace.live
    assert {r["step"] for r in live} == set(range(5))
    assert all(sum(r["step"] == s for r in live) == 4 for s in range(5))
    assert all(len(r["blocks"]) >= 1 for r in live)
    fin = out.trace.finished
    assert sorted(r["score"] for r in fin if r["step"] == 5) == sorted(
        s.score for s in out.sequences)

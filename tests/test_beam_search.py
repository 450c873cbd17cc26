"""LLM.beam_search against HF generate(num_beams=W): sequences, scores, stops, blocks."""

import functools
import math

import pytest
import torch

from batchgen import LLM, BeamSearchParams
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests.helpers import load_hf_model, make_prompt_token_ids

FAMILIES = ["llama", "gpt2", "qwen3"]
T = 10
# (block_size, num_kv_blocks, max_num_batched_tokens, max_num_seqs)
LAYOUTS = {"block16": (16, 1024, None, 256), "block1": (1, 8192, None, 256),
           "preempt": (4, None, 32, 64)}  # pool: the validation bound of the longest prompt


@pytest.fixture(scope="module")
def prompts():
    return make_prompt_token_ids(5, 2, 30, vocab_size=512, seed=11, include_lengths=(16,))


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param, eos_boost=0.2)


@functools.cache
def hf_beams(model_dir, prompt: tuple, width: int, lp: float, es, stop_ids: tuple = ()):
    """HF generate's W hypotheses (generated ids, EOS kept) and sequences_scores."""
    model = load_hf_model(model_dir)
    ids = torch.tensor([prompt])
    eos = [2, *stop_ids]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                         num_return_sequences=width, max_new_tokens=T, length_penalty=lp,
                         early_stopping=es, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, eos_token_id=eos, pad_token_id=0)
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        seqs.append(row if cut is None else row[:cut + 1])
    scores = out.sequences_scores.tolist() if width > 1 else [None]
    return seqs, scores


def _check(llm, model_dir, prompts, width, lp, es, stop_ids=()):
    params = BeamSearchParams(beam_width=width, max_tokens=T, length_penalty=lp,
                              early_stopping=es, stop_token_ids=list(stop_ids) or None)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        seqs, scores = hf_beams(str(model_dir), tuple(p), width, lp, es, tuple(stop_ids))
        assert [s.token_ids for s in o.sequences] == seqs, (width, lp, es, len(p))
        for s, want in zip(o.sequences, scores):
            if want is not None:  # HF's num_beams=1 is greedy: no sequences_scores
                assert math.isclose(s.score, want, rel_tol=1e-6, abs_tol=1e-4)
            gen_len = len(s.token_ids)
            assert math.isclose(s.score, s.cumulative_logprob / gen_len ** lp, rel_tol=1e-5)
            assert s.finish_reason == ("stop" if s.token_ids[-1] in (2, *stop_ids) else "length")
    assert llm.engine.kv.block_manager.num_free_blocks() == llm.engine.kv.block_manager.num_blocks
    return outs


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("lp", [0.0, 1.0, 2.0, -1.0])
def test_beams_equal_hf(family_dir, prompts, width, lp):
    llm = _llm(family_dir, "block16")
    _check(llm, family_dir, prompts, width, lp, False)


@pytest.mark.parametrize("es", [True, False, "never"])
@pytest.mark.parametrize("lp", [1.0, 2.0])
def test_early_stopping_modes_equal_hf(family_dir, prompts, es, lp):
    _check(_llm(family_dir, "block16"), family_dir, prompts, 4, lp, es)


@pytest.mark.parametrize("width", [4, 8])
def test_beams_equal_hf_on_the_pytorch_path(family_dir, prompts, width):
    """attention_backend="torch": beams sharing blocks decode as a two-level cascade."""
    _check(_llm(family_dir, "block16", backend="torch"), family_dir, prompts, width, 1.0, False)


@pytest.mark.parametrize("layout", ["block1", "preempt"])
@pytest.mark.parametrize("width", [4, 8])
def test_beams_equal_hf_at_block_size_1_and_under_preemption(family_dir, prompts, layout, width,
                                                             engine_mode):
    llm = _llm(family_dir, layout, width, max(map(len, prompts)))
    _check(llm, family_dir, prompts, width, 1.0, False)
    if layout == "preempt":
        assert llm.kv_stats().preemptions > 0


def test_eos_is_reachable_and_stops_hypotheses(family_dir, prompts):
    outs = _check(_llm(family_dir, "block16"), family_dir, prompts, 4, 1.0, False)
    reasons = {s.finish_reason for o in outs for s in o.sequences}
    assert reasons == {"stop", "length"}


def test_stop_token_ids_end_hypotheses_like_eos(tiny_model_factory, prompts):
    path = tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST)
    llm = _llm(path, "block16")
    free = llm.beam_search([{"prompt_token_ids": prompts[0]}],
                           BeamSearchParams(beam_width=4, max_tokens=T), use_tqdm=False)
    stop_id = free[0].sequences[0].token_ids[2]
    _check(llm, path, prompts, 4, 1.0, False, stop_ids=(stop_id,))


def test_stop_strings_end_hypotheses(tiny_model_factory):
    path = tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST)
    llm = _llm(path, "block16")
    prompt = "Once upon a time"
    free = llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=T,
                                                    ignore_eos=True), use_tqdm=False)
    best = free[0].sequences[0]
    stop = best.text[3:5]
    assert len(stop) == 2
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=T, ignore_eos=True,
                                                   stop=[stop]), use_tqdm=False)[0]
    assert any(s.finish_reason == "stop" for s in out.sequences)
    for s in out.sequences:
        if s.finish_reason == "stop":
            full = llm.get_tokenizer().decode(s.token_ids, skip_special_tokens=True)
            assert stop in full and s.text == full[:full.index(stop)]
            shorter = llm.get_tokenizer().decode(s.token_ids[:-1], skip_special_tokens=True)
            assert stop not in shorter  # it ended on the token that completed the stop string
        else:
            assert stop not in s.text


def test_beams_wider_than_max_num_seqs_equal_hf_and_a_roomy_engine(tiny_model_factory, prompts):
    """max_num_seqs=1, as vLLM's own beam tests run: each group's beams decode in a step of
    their own; the hypotheses, logprobs and scores are a roomy engine's, bit for bit, and
    HF's."""
    path = tiny_model_factory("llama", eos_boost=0.2)
    narrow = _check(LLM(path, block_size=16, num_kv_blocks=1024, max_num_seqs=1), path, prompts,
                    4, 1.0, False)
    roomy = _check(_llm(path, "block16"), path, prompts, 4, 1.0, False)
    assert narrow == roomy


def test_wide_beams_complete_within_the_block_bound(tiny_model_factory, prompts):
    path = tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST)
    llm = LLM(path, block_size=16, num_kv_blocks=4096)
    for width in (16, 64):
        p = prompts[1]
        out = llm.beam_search([{"prompt_token_ids": p}], BeamSearchParams(
            beam_width=width, max_tokens=T, ignore_eos=True), use_tqdm=False)
        assert len(out[0].sequences) == width
        scores = [s.score for s in out[0].sequences]
        assert scores == sorted(scores, reverse=True)
        bound = math.ceil(len(p) / 16) + 2 * width * (math.ceil(T / 16) + 1)
        assert llm.kv_stats().peak_blocks_in_use <= bound
        assert llm.kv_stats().cow_copies > 0
    assert llm.engine.kv.block_manager.num_free_blocks() == 4096


def test_num_return_sequences_and_bad_params(tiny_model_factory, prompts):
    llm = _llm(tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST), "block16")
    out = llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(
        beam_width=4, max_tokens=5, num_return_sequences=2), use_tqdm=False)
    assert len(out[0].sequences) == 2
    with pytest.raises(ValueError, match="beam_width must be <= max_num_batched_tokens"):
        LLM(tiny_model_factory("llama"), max_num_batched_tokens=4, num_kv_blocks=64).beam_search(
            "hi", BeamSearchParams(beam_width=8, max_tokens=4))
    with pytest.raises(ValueError, match="params"):
        llm.beam_search(["a", "b"], [BeamSearchParams(beam_width=2, max_tokens=3)])


def _llm(path, layout, width=1, longest=0, backend=None):
    bs, blocks, budget, seqs = LAYOUTS[layout]
    if blocks is None:
        blocks = math.ceil(longest / bs) + width * (math.ceil(T / bs) + 1)
    return LLM(path, block_size=bs, num_kv_blocks=blocks, max_num_batched_tokens=budget,
               max_num_seqs=seqs, attention_backend=backend)

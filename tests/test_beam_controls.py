"""Beam logits controls against HF generate(num_beams=W, <the same controls>) on the same weights:
min_tokens (HF min_new_tokens), no_repeat_ngram_size, repetition_penalty, bad words (strings
and token-id lists), temperature (HF's TemperatureLogitsWarper, last in its processor order)."""

import functools
import math

import pytest
import torch

from batchgen import LLM, BeamSearchParams
from batchgen.engine.beam_controls import BeamControls
from batchgen.params import ControlSpec
from tests.helpers import load_hf_model, make_prompt_token_ids

FAMILIES = ["llama", "qwen3", "gemma2"]
T = 10
W = 4
# (block_size, num_kv_blocks, max_num_batched_tokens, max_num_seqs); "preempt": a pool of the
# bound of one request, so several requests preempt each other
LAYOUTS = {"block16": (16, 1024, None, 64), "block1": (1, 4096, None, 64),
           "preempt": (4, None, 32, 64)}
# the controls each case sets, as BeamSearchParams fields
CASES = {
    "ngram+penalty+min": dict(no_repeat_ngram_size=2, repetition_penalty=1.5, min_tokens=6),
    "ngram3+penalty<1": dict(no_repeat_ngram_size=3, repetition_penalty=0.8),
    "temperature+min": dict(temperature=0.7, min_tokens=3, length_penalty=2.0),
}


@pytest.fixture(scope="module")
def prompts():
    return make_prompt_token_ids(4, 2, 24, vocab_size=512, seed=5, include_lengths=(16,))


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param, eos_boost=0.2)


@functools.cache
def hf_beams(model_dir: str, prompt: tuple, controls: tuple, bad: tuple = ()):
    """HF generate's W hypotheses (generated ids, EOS kept) and sequences_scores."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    c = dict(controls)
    lp = c.pop("length_penalty", 1.0)
    temperature = c.pop("temperature", 1.0)
    extra = {"min_new_tokens": c.pop("min_tokens")} if "min_tokens" in c else {}
    if temperature != 1.0:  # HF applies it only when sampling; same place in its order
        extra["logits_processor"] = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if bad:
        extra["bad_words_ids"] = [list(w) for w in bad]
    model = load_hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=W,
                         num_return_sequences=W, max_new_tokens=T, length_penalty=lp,
                         do_sample=False, output_scores=True, return_dict_in_generate=True,
                         eos_token_id=2, pad_token_id=0, **c, **extra)
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        seqs.append(row[:row.index(2) + 1] if 2 in row else row)
    return seqs, out.sequences_scores.tolist()


def _check(llm, model_dir, prompts, controls, bad_ids=(), **extra):
    params = BeamSearchParams(beam_width=W, max_tokens=T, **controls, **extra)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    lp = controls.get("length_penalty", 1.0)
    key = tuple(sorted(controls.items()))
    for p, o in zip(prompts, outs):
        seqs, scores = hf_beams(str(model_dir), tuple(p), key, tuple(map(tuple, bad_ids)))
        assert [s.token_ids for s in o.sequences] == seqs, (controls, len(p))
        for s, want in zip(o.sequences, scores):
            assert math.isclose(s.score, want, rel_tol=1e-5, abs_tol=1e-4)
            assert math.isclose(s.score, s.cumulative_logprob / len(s.token_ids) ** lp,
                                rel_tol=1e-5)
            assert len(s.token_ids) >= controls.get("min_tokens", 0) + (s.token_ids[-1] == 2)
    assert llm.engine.kv.block_manager.num_free_blocks() == llm.engine.kv.block_manager.num_blocks
    return outs


@pytest.mark.parametrize("case", sorted(CASES))
def test_controls_equal_hf(family_dir, prompts, case):
    llm = _llm(family_dir, "block16")
    outs = _check(llm, family_dir, prompts, CASES[case])
    plain = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                            BeamSearchParams(beam_width=W, max_tokens=T), use_tqdm=False)
    changed = [[(s.token_ids, round(s.score, 4)) for s in o.sequences] for o in (*outs, *plain)]
    assert changed[:len(prompts)] != changed[len(prompts):]  # the controls did something


@pytest.mark.parametrize("layout", ["block1", "preempt"])
def test_controls_equal_hf_at_block_size_1_and_under_preemption(family_dir, prompts, layout):
    llm = _llm(family_dir, layout, max(map(len, prompts)))
    _check(llm, family_dir, prompts, CASES["ngram+penalty+min"])
    if layout == "preempt":
        assert llm.kv_stats().preemptions > 0


def test_bad_words_and_ids_equal_hf(family_dir, prompts):
    """Words banned as strings (vLLM's tokenization: the word and " word") and as id lists
    (single tokens, and a two-token sequence banned only after its first token), each taken
    from the unconstrained best beam so that banning them changes it."""
    llm = _llm(family_dir, "block16")
    free = llm.beam_search([{"prompt_token_ids": prompts[0]}],
                           BeamSearchParams(beam_width=W, max_tokens=T), use_tqdm=False)
    best = free[0].sequences[0].token_ids
    tok = llm.get_tokenizer()
    seen = [t for s in free[0].sequences for t in s.token_ids[2:]]
    word = next(w for w in (tok.decode([t]).strip() for t in seen)
                if w and tok.encode(w, add_special_tokens=False))
    ids = [[best[0]], [best[1], best[2]]]
    plain = tok.encode(word, add_special_tokens=False)
    spaced = tok.encode(" " + word, add_special_tokens=False)
    banned = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
    outs = _check(llm, family_dir, prompts, {}, bad_ids=[*banned, *ids], bad_words=[word],
                  bad_words_ids=ids)
    assert best not in [s.token_ids for s in outs[0].sequences]
    for s in (s for o in outs for s in o.sequences):
        assert best[0] not in s.token_ids
        assert not any(a == best[1] and b == best[2] for a, b in zip(s.token_ids, s.token_ids[1:]))


def test_controls_process_rows_like_hf_processors():
    """The processors alone, on random log-probs and sequences, against HF's classes."""
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 20, (7,), generator=g).tolist()
    rows, vocab = 3, 20
    spec = ControlSpec(1.7, 2, ((4,), (2,), (5, 6), (1, 2, 3)), 2, 0.5)
    c = BeamControls(spec, prompt, rows, 8, stop_ids=[2])
    seqs = torch.tensor([prompt] * rows)
    hf = [RepetitionPenaltyLogitsProcessor(1.7), NoRepeatNGramLogitsProcessor(2),
          NoBadWordsLogitsProcessor([[4], [2], [5, 6], [1, 2, 3]], eos_token_id=2),
          MinNewTokensLengthLogitsProcessor(len(prompt), 2, [2]), TemperatureLogitsWarper(0.5)]
    for _ in range(4):
        lp = torch.log_softmax(torch.randn(rows, vocab, generator=g), dim=-1)
        want = lp
        for proc in hf:
            want = proc(seqs, want)
        assert torch.equal(c.process(lp), want)
        parents = torch.randint(0, rows, (rows,), generator=g).tolist()
        tokens = torch.randint(0, vocab, (rows,), generator=g).tolist()
        c.advance(parents, tokens)
        seqs = torch.cat((seqs[parents], torch.tensor(tokens)[:, None]), dim=1)


@pytest.mark.parametrize("bad", [
    dict(repetition_penalty=0), dict(no_repeat_ngram_size=-1), dict(bad_words_ids=[[]]),
    dict(bad_words_ids=[[1, -2]]), dict(bad_words=[""]), dict(min_tokens=T + 1),
    dict(temperature=-1.0), dict(num_beam_groups=3), dict(num_beam_groups=2),
    dict(diversity_penalty=0.5), dict(diversity_penalty=-1.0, num_beam_groups=2),
    dict(num_beam_groups=2, diversity_penalty=1.0, stop=["x"])])
def test_bad_control_values_name_the_argument(bad):
    name = next(iter(bad)) if "stop" not in bad else "stop"
    with pytest.raises(ValueError, match=name if "diversity" not in str(bad) or "num_beam"
                       not in str(bad) else "diversity_penalty|num_beam_groups"):
        BeamSearchParams(beam_width=W, max_tokens=T, **bad)


def test_temperature_zero_is_vllms_default_no_scaling():
    """vLLM's BeamSearchParams default temperature 0.0 leaves the log-probs as they are: here
    that is temperature 1.0 (HF's), not a greedy or a division by zero."""
    assert BeamSearchParams(beam_width=W, max_tokens=T, temperature=0.0).temperature == 1.0


def test_bad_words_ids_outside_the_vocabulary_are_refused(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), num_kv_blocks=64)
    with pytest.raises(ValueError, match="bad_words_ids"):
        llm.beam_search("hi", BeamSearchParams(beam_width=2, max_tokens=4,
                                               bad_words_ids=[[10**6]]))


def _llm(path, layout, longest=0):
    bs, blocks, budget, seqs = LAYOUTS[layout]
    if blocks is None:
        blocks = math.ceil(longest / bs) + W * (math.ceil(T / bs) + 1)
    return LLM(path, block_size=bs, num_kv_blocks=blocks, max_num_batched_tokens=budget,
               max_num_seqs=seqs)


def test_a_beam_job_manifest_names_only_the_controls_it_sets(tmp_path):
    """Dataset jobs: a control at its default is left out of the manifest (older beam jobs,
    written before the controls existed, stay resumable); a set one is in it."""
    from types import SimpleNamespace

    from batchgen.data.prompts import PromptSpec
    from batchgen.data.runner import _job

    (tmp_path / "config.json").write_text("{}")  # the model's identity hashes its folder
    llm = SimpleNamespace(model_path=tmp_path)
    source = SimpleNamespace(fingerprint="f", num_rows=1)
    plain = _job(llm, BeamSearchParams(beam_width=2, max_tokens=4), 0, PromptSpec(), source)
    assert set(plain["params"]) == {"beam_width", "max_tokens", "length_penalty",
                                    "early_stopping", "num_return_sequences", "ignore_eos",
                                    "stop", "stop_token_ids", "seed"}
    ngram = _job(llm, BeamSearchParams(beam_width=2, max_tokens=4, no_repeat_ngram_size=2), 0,
                 PromptSpec(), source)
    assert ngram["params"]["no_repeat_ngram_size"] == 2


def test_width_64_runs_with_controls_and_groups(tiny_model_factory, prompts):
    """Wide beams keep working with every control on, and as 8 diverse groups of 8."""
    llm = LLM(tiny_model_factory("llama", eos_boost=0.2), block_size=16, num_kv_blocks=4096)
    for extra in (dict(), dict(num_beam_groups=8, diversity_penalty=0.5)):
        out = llm.beam_search([{"prompt_token_ids": prompts[1]}], BeamSearchParams(
            beam_width=64, max_tokens=T, no_repeat_ngram_size=2, repetition_penalty=1.3,
            min_tokens=2, bad_words_ids=[[5], [6, 7]], **extra), use_tqdm=False)[0]
        assert len(out.sequences) == 64
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in out.sequences:
            pairs = list(zip(s.token_ids, s.token_ids[1:]))
            assert len(pairs) == len(set(pairs)) and 5 not in s.token_ids
    assert llm.engine.kv.block_manager.num_free_blocks() == 4096

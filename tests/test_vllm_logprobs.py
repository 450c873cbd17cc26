"""vLLM 0.34's logprob options on batchgen: `logprob_token_ids` (each token's logprobs of the
ids a request names), `prompt_logprob_token_ids` with `prompt_logprob_start` (the named ids'
scores at each prompt position), `flat_logprobs` (the FlatLogprobs container) and
`SamplingParams.verify`; checked against the whole-vocabulary logprobs of the same runs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from batchgen import LLM, SamplingParams
from batchgen.checks import ValidationError
from batchgen.outputs import FlatLogprobs
from batchgen.token_texts import TokenTexts
from batchgen.tools.make_tiny_model import build_tokenizer

PROMPTS = [{"prompt_token_ids": [5, 17, 40, 9]}, {"prompt_token_ids": [6, 3, 43, 9, 11]}]
NAMED = [7, 0, 299]


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama", vocab_size=300, seed=44), num_kv_blocks=32,
               max_model_len=64, max_logprobs=-1, block_size=4, max_num_batched_tokens=8)


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


def test_prompt_logprob_token_ids_score_each_row_from_prompt_logprob_start(llm):
    """Row i scores its ids at prompt position prompt_logprob_start + i + 1 (ragged rows
    padded with -inf), as the whole distribution there has them, however the prompt is
    chunked; top-k prompt logprobs start there too; a prefix-cache hit (read unless
    skip_reading_prefix_cache=True) before the start changes no score."""
    ids = list(range(5, 29))
    full = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=-1),
                        use_tqdm=False)[0].prompt_logprobs
    start = 9
    table = [[t, 0, 299][:1 + i % 3] for i, t in enumerate(ids[start + 1:])]
    want = np.full((len(table), 3), -np.inf, np.float32)
    for i, row in enumerate(table):
        want[i, :len(row)] = [full[start + 1 + i][t].logprob for t in row]
    sp = dict(max_tokens=1, prompt_logprob_token_ids=table, prompt_logprob_start=start,
              prompt_logprobs=1)
    llm.reset_prefix_cache()
    cold = llm.generate({"prompt_token_ids": ids}, SamplingParams(**sp), use_tqdm=False)[0]
    np.testing.assert_array_equal(cold.prompt_token_id_logprobs, want)
    assert cold.prompt_logprobs[:start + 1] == [None] * (start + 1)
    assert all(cold.prompt_logprobs[start + 1:]) and cold.num_cached_tokens == 0
    for skip, cached in ((True, 0), (False, 8)):  # blocks of 4 before position 9 - 1
        hit = llm.generate({"prompt_token_ids": ids}, SamplingParams(
            skip_reading_prefix_cache=skip, **sp), use_tqdm=False)[0]
        assert hit.num_cached_tokens == cached
        np.testing.assert_array_equal(hit.prompt_token_id_logprobs, want)
        assert hit.prompt_logprobs == cold.prompt_logprobs


def test_prompt_logprob_token_ids_are_checked_before_any_work(llm):
    model = SimpleNamespace(max_logprobs=2, get_vocab_size=lambda: 10, max_model_len=4)
    verify = lambda **kw: SamplingParams(**kw).verify(model)  # noqa: E731
    assert SamplingParams(prompt_logprob_token_ids=[[], [3]]).prompt_logprob_token_ids.tolist(
        ) == [[-1], [3]]
    two = [SamplingParams(prompt_logprob_token_ids=[[1, 2], [3]]) for _ in range(2)]
    assert two[0] == two[1] != SamplingParams(prompt_logprob_token_ids=[[1, 2], [4]])
    for bad, match in (([1, 2], r"shape \[num_rows, num_ids\]"), ([[], []], "non-empty"),
                       ([[1.5]], "integer token ids"), ([[True]], "integer token ids"),
                       ([[-2]], "out-of-vocab")):
        with pytest.raises(ValidationError, match=match):
            SamplingParams(prompt_logprob_token_ids=bad)
    for bad, match in (([[10]], "out-of-vocab"), ([[1, 2, 3]], "at least 3"),
                       ([[1]] * 4, "at most 3 scored rows")):
        with pytest.raises(ValidationError, match=match):
            verify(prompt_logprob_token_ids=bad)
    with pytest.raises(ValidationError, match="requires prompt_logprobs or"):
        SamplingParams(prompt_logprob_start=3)
    with pytest.raises(ValidationError, match="non-negative"):
        SamplingParams(prompt_logprobs=1, prompt_logprob_start=-1)
    with pytest.raises(ValidationError, match="has 2 rows, but the prompt has 3 scored rows"):
        llm.generate(PROMPTS[0], SamplingParams(prompt_logprob_token_ids=[[1], [2]]),
                     use_tqdm=False)
    assert not llm.engine.scheduler.has_unfinished()


def test_decoded_tokens_complete_split_characters_and_keep_word_spaces():
    """vLLM's decoded_token: a token ending in an unfinished UTF-8 character is decoded after
    the tokens chosen before it (the character once complete, "" before), and a
    SentencePiece piece that starts a word keeps its space (decode drops it alone)."""
    byte_level = build_tokenizer(512)
    ids = byte_level("Emoji: 你好 ok", add_special_tokens=False).input_ids
    texts = TokenTexts(byte_level)
    pieces = [texts.text(t, ids[max(0, i - 4):i]) for i, t in enumerate(ids)]
    assert "".join(pieces) == "Emoji: 你好 ok" and "\ufffd" not in "".join(pieces)
    split = next(t for t in ids if byte_level.decode([t]) == "\ufffd")  # a split character
    assert texts.text(split, []) == ""  # without context its bytes complete nothing
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "\u2581hello": 1, "\u2581world": 2, "x": 3},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    spaced = TokenTexts(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]"))
    assert [spaced.piece(t) for t in (1, 2, 3)] == [" hello", " world", "x"]

"""Incremental detokenisation and stop conditions on a real byte-level BPE tokenizer."""

from __future__ import annotations

import random
from typing import Any

import pytest

from batchgen.params import BeamSearchParams, SamplingParams
from batchgen.sampling.stop import IncrementalDetokenizer, StopChecker, StreamDetokenizer

DETOKENIZERS = pytest.mark.parametrize("Detok", [StreamDetokenizer, IncrementalDetokenizer])

PAD, BOS, EOS = 0, 1, 2


def _local_tokenizer() -> Any:
    """A small byte-level BPE (pad 0, bos 1, eos 2) trained in-process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello there!",
              "A paged cache stores blocks of keys and values."] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


@pytest.fixture(scope="module")
def tok() -> Any:
    """The shared tiny tokenizer if available, else a local one with the same special ids."""
    try:
        from batchgen.tools.make_tiny_model import build_tokenizer

        t = build_tokenizer()
        assert (t.pad_token_id, t.bos_token_id, t.eos_token_id) == (PAD, BOS, EOS)
        return t
    except Exception:  # the shared maker is missing or changed: train a local one
        return _local_tokenizer()


def _ids(tok: Any, text: str) -> list[int]:
    """Token ids of ``text`` without BOS."""
    return tok.encode(text, add_special_tokens=False)


def _decode(tok: Any, ids: list[int], skip: bool = True) -> str:
    """The reference full decode (no space clean-up, like the detokenizer)."""
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _run(checker: StopChecker, ids: list[int]) -> tuple[int, str | None, int | str | None]:
    """Feed ids until the checker stops; return (tokens consumed, finish, stop reason)."""
    for n, t in enumerate(ids, 1):
        finish, reason = checker.append(t, n)
        if finish is not None:
            return n, finish, reason
    return len(ids), None, None


# ----------------------------------------------------------------------------- detokenizer


@DETOKENIZERS
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_full_decode_on_random_ids(tok: Any, skip: bool, Detok) -> None:
    rng = random.Random(0)
    vocab = len(tok)
    multibyte = _ids(tok, "héllo 世界 🙂 naïve ∑x")
    prompt = _ids(tok, "Hello there")
    for _ in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        cut = rng.randrange(len(ids) + 1)
        ids[cut:cut] = multibyte  # multi-byte characters split over several byte tokens
        detok = Detok(tok, [BOS, *prompt], skip_special_tokens=skip)
        pieces = [detok.step(t) for t in ids]
        pieces.append(detok.flush())
        assert "".join(pieces) == detok.text == _decode(tok, ids, skip)


@DETOKENIZERS
def test_text_is_held_back_until_a_character_is_complete(tok: Any, Detok) -> None:
    detok = Detok(tok, [BOS], True)
    world = _ids(tok, "世")
    assert len(world) == 3
    assert [detok.step(t) for t in world] == ["", "", "世"]


@DETOKENIZERS
def test_window_stays_bounded(tok: Any, Detok) -> None:
    detok = Detok(tok, [BOS, *_ids(tok, "Hello")], True)
    ids = _ids(tok, "The quick brown fox jumps over the lazy dog. " * 30)
    for t in ids:
        detok.step(t)
        detok.step(EOS)  # skipped special tokens never enter the window
        assert len(getattr(detok, "_ids", getattr(detok, "_window", []))) <= 8
    assert detok.text == _decode(tok, ids)


# ----------------------------------------------------------------------------- stop checker


def _checker(tok: Any, max_tokens: int = 100, prompt: str = "Hello", **kw: Any) -> StopChecker:
    """A StopChecker for SamplingParams(**kw) after a short prompt."""
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return StopChecker(params, EOS, tok, [BOS, *_ids(tok, prompt)], max_tokens)


def test_stop_string_spanning_tokens_cuts_the_text(tok: Any) -> None:
    ids = _ids(tok, "The quick brown fox jumps")
    checker = _checker(tok, stop=["own fo"])
    n, finish, reason = _run(checker, ids)
    assert (finish, reason) == ("stop", "own fo")
    assert "own fo" in _decode(tok, ids[:n])
    assert "own fo" not in _decode(tok, ids[:n - 1])  # the completing token is the last one kept
    assert checker.final_text(ids[:n]) == "The quick br"


def test_include_stop_str_in_output_keeps_the_stop_string_only(tok: Any) -> None:
    ids = _ids(tok, "The quick brown fox jumps")
    checker = _checker(tok, stop="own fo", include_stop_str_in_output=True)
    n = _run(checker, ids)[0]
    assert checker.final_text(ids[:n]) == "The quick brown fo"


def test_multibyte_stop_string_and_earliest_match_wins(tok: Any) -> None:
    ids = _ids(tok, "ab 世界 cd")
    checker = _checker(tok, stop=["界", "世"])
    n, finish, reason = _run(checker, ids)
    assert (finish, reason) == ("stop", "世")
    assert checker.final_text(ids[:n]) == "ab "
    assert _decode(tok, ids[:n]) == "ab 世"


def test_stop_token_id_is_kept_in_ids_not_in_text(tok: Any) -> None:
    ids = _ids(tok, "The quick brown fox")
    stop_id = ids[3]
    checker = _checker(tok, stop_token_ids=[stop_id], stop=["zzz"])
    n, finish, reason = _run(checker, ids)
    assert (n, finish, reason) == (4, "stop", stop_id)
    assert checker.final_text(ids[:4]) == _decode(tok, ids[:3])
    inc = _checker(tok, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    _run(inc, ids)
    assert inc.final_text(ids[:4]) == _decode(tok, ids[:4])


@pytest.mark.parametrize("stop", [None, ["zzz"]])
def test_eos_stops_with_no_stop_reason(tok: Any, stop: list[str] | None) -> None:
    ids = _ids(tok, "The quick") + [EOS] + _ids(tok, " brown")
    checker = _checker(tok, stop=stop, skip_special_tokens=False)
    n, finish, reason = _run(checker, ids)
    assert (finish, reason) == ("stop", None)
    assert ids[n - 1] == EOS
    assert checker.final_text(ids[:n]) == "The quick"  # EOS text dropped even with specials


def test_ignore_eos_runs_to_length(tok: Any) -> None:
    ids = (_ids(tok, "The quick") + [EOS]) * 3
    checker = _checker(tok, max_tokens=len(ids), ignore_eos=True, skip_special_tokens=False)
    n, finish, reason = _run(checker, ids)
    assert (n, finish, reason) == (len(ids), "length", None)
    assert checker.final_text(ids) == "The quick</s>" * 3


def test_max_tokens_gives_length_and_exact_text(tok: Any) -> None:
    ids = _ids(tok, "The quick brown fox jumps over")
    checker = _checker(tok, max_tokens=5)
    assert checker.detokenizer is None  # no stop strings: one decode at the end
    n, finish, reason = _run(checker, ids)
    assert (n, finish, reason) == (5, "length", None)
    assert checker.final_text(ids[:5]) == _decode(tok, ids[:5])


def test_eos_on_the_last_allowed_token_is_stop(tok: Any) -> None:
    ids = _ids(tok, "The") + [EOS]
    checker = _checker(tok, max_tokens=len(ids))
    assert _run(checker, ids)[1:] == ("stop", None)


def test_min_tokens_delays_eos_stop_ids_and_stop_strings(tok: Any) -> None:
    head = _ids(tok, "The quick")
    ids = head + [EOS] + _ids(tok, " brown fox")
    n_min = len(head) + 2  # EOS is token n_min - 1: too early
    checker = _checker(tok, min_tokens=n_min, stop=["quick", "fox"], stop_token_ids=[head[0]])
    n, finish, reason = _run(checker, ids)
    assert (n, finish, reason) == (len(ids), "stop", "fox")
    assert checker.final_text(ids) == "The quick brown "


def test_min_tokens_boundary_follows_vllm(tok: Any) -> None:
    ids = _ids(tok, "The quick")
    checker = _checker(tok, min_tokens=len(ids) + 1)
    assert _run(checker, [*ids, EOS])[1:] == ("stop", None)  # EOS as token min_tokens counts


def test_several_eos_ids(tok: Any) -> None:
    params = SamplingParams(max_tokens=10)
    for eos in (7, 9):
        checker = StopChecker(params, [EOS, 7, 9], tok, [BOS], 10)
        ids = [*_ids(tok, "The"), eos]
        assert _run(checker, ids)[1:] == ("stop", None)
        assert checker.final_text(ids) == "The"


def test_length_flushes_pending_text(tok: Any) -> None:
    ids = _ids(tok, "ab 世")[:-1]  # ends inside a character
    checker = _checker(tok, max_tokens=len(ids), stop=["zzz"])
    assert _run(checker, ids)[1] == "length"
    text = checker.final_text(ids)
    assert text == _decode(tok, ids) and text.endswith("\ufffd")


def test_without_tokenizer_only_token_conditions_apply() -> None:
    params = SamplingParams(max_tokens=3, stop=["x"], stop_token_ids=[9])
    checker = StopChecker(params, EOS, None, [BOS, 5], 3)
    assert checker.append(5, 1) == (None, None)
    assert checker.append(9, 2) == ("stop", 9)
    assert checker.final_text([5, 9]) == ""
    with pytest.raises(RuntimeError):
        checker.append(5, 3)


def test_beam_search_params_are_accepted(tok: Any) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=20, stop="fox")
    checker = StopChecker(params, EOS, tok, [BOS], 20)
    ids = _ids(tok, "The quick brown fox jumps")
    n, finish, reason = _run(checker, ids)
    assert (finish, reason) == ("stop", "fox")
    assert checker.final_text(ids[:n]) == "The quick brown "


def test_would_stop_peeks_and_forks_are_independent(tok: Any) -> None:
    """Beams ask each candidate token without changing the checker; a fork continues alone."""
    ids = _ids(tok, "The quick brown fox jumps")
    checker = _checker(tok, stop=["own fo"])
    n = _run(_checker(tok, stop=["own fo"]), ids)[0]  # the token completing the stop string
    for i, t in enumerate(ids[:n - 1], 1):
        assert not checker.would_stop(t, i)
        checker.append(t, i)
    twin = checker.fork()
    assert checker.would_stop(ids[n - 1], n) and twin.would_stop(ids[n - 1], n)
    assert twin.append(ids[n - 1], n) == ("stop", "own fo")
    assert checker.finish_reason is None and not checker.would_stop(ids[0], n)
    assert checker.append(ids[0], n) == (None, None)  # the original goes on unaffected


@pytest.mark.parametrize("seed", range(6))
def test_batch_stop_codes_and_one_decode_equal_the_checker(tok: Any, seed: int) -> None:
    """Rows without stop strings stop by `stop_codes` on a whole batch and get their text by
    one decode at the end (`output_text`): the same finish reasons, stop reasons and text as
    feeding each row's tokens through its own StopChecker."""
    import numpy as np

    from batchgen.sampling.stop import StopFactory, finish_of, stop_codes

    rng = random.Random(seed)
    eos_ids = [EOS, 7]
    stops = StopFactory(tok, eos_ids)
    rows = []
    for _ in range(24):
        max_tokens = rng.randint(1, 12)
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=min(rng.choice([0, 0, 2, 5]), max_tokens),
            ignore_eos=rng.random() < 0.3, include_stop_str_in_output=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(3, 60), rng.randint(0, 3)))
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 6))]
        rows.append((params, prompt, [], stops(params, prompt, params.max_tokens), None))
    width = max(len(p.stop_ids) for p, *_ in rows) or 1
    for step in range(1, 13):
        live = [r for r in rows if r[4] is None]
        if not live:
            break
        tokens = np.array([rng.choice([EOS, 7, 9, *p.stop_ids, *range(3, 80)])
                           for p, *_ in live], np.int64)
        stop_ids = np.full((len(live), width), -1, np.int64)
        for i, (p, *_) in enumerate(live):
            stop_ids[i, :len(p.stop_ids)] = p.stop_ids
        codes = stop_codes(tokens, np.full(len(live), step),
                           np.array([p.min_tokens for p, *_ in live]),
                           np.array([p.max_tokens for p, *_ in live]), stop_ids,
                           np.array([p.ignore_eos for p, *_ in live]), np.array(eos_ids))
        for (p, _q, out, checker, _), t, code in zip(live, tokens.tolist(), codes.tolist()):
            out.append(t)
            want = checker.append(t, step)
            got = finish_of(code, t) if code else (None, None)
            assert got == want, (p, out)
        rows = [(p, q, o, c, c.finish_reason) for p, q, o, c, _ in rows]
    for params, prompt, out, checker, _ in rows:
        stop_token = checker.finish_reason == "stop"
        assert stops.output_text(params, prompt, out, stop_token) == checker.final_text(out)

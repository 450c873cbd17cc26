"""SamplingParams / BeamSearchParams: defaults, normalisation and up-front validation."""

from __future__ import annotations

import dataclasses

import pytest

from batchgen.params import BeamSearchParams, SamplingParams

BAD_SAMPLING = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("n", {"n": True}),
    ("temperature", {"temperature": -1}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": float("inf")}),
    ("temperature", {"temperature": "hot"}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.0}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_p", {"top_p": -0.1}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.1}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -1}),
    ("max_tokens", {"max_tokens": 3.0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("seed", {"seed": 1.5}),
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": -(2**63) - 1}),
    ("seed", {"seed": True}),
    ("logprobs", {"logprobs": -2}),
    ("logprobs", {"logprobs": 2.0}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop", {"stop": 5}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": ["a"]}),
    ("stop_token_ids", {"stop_token_ids": 5}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": 1}),
    ("skip_special_tokens", {"skip_special_tokens": None}),
    ("prompt_logprobs", {"prompt_logprobs": -2}),
    ("prompt_logprobs", {"prompt_logprobs": "all"}),
    ("logit_bias", {"logit_bias": [(3, 1.0)]}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {3: "up"}}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [3, -1]}),
    ("bad_words", {"bad_words": [""]}),
    ("bad_words", {"bad_words": [3]}),
    ("logits_processors", {"logits_processors": [3]}),
    ("logits_processors", {"logits_processors": print}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": -2}),
    ("prompt_logprobs_start", {"prompt_logprobs": 0, "prompt_logprobs_start": -1}),
    ("prompt_logprobs_start", {"prompt_logprobs": 0, "prompt_logprobs_start": True}),
    ("prompt_logprobs_start", {"prompt_logprobs_start": 3}),  # without prompt_logprobs
    ("detokenize", {"detokenize": "no"}),
    ("stop", {"stop": ["x"], "detokenize": False}),
]

BAD_BEAM = [
    ("beam_width", {"beam_width": 0, "max_tokens": 4}),
    ("beam_width", {"beam_width": 2.0, "max_tokens": 4}),
    ("max_tokens", {"beam_width": 2, "max_tokens": 0}),
    ("max_tokens", {"beam_width": 2, "max_tokens": -1}),
    ("length_penalty", {"beam_width": 2, "max_tokens": 4, "length_penalty": "long"}),
    ("length_penalty", {"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}),
    ("early_stopping", {"beam_width": 2, "max_tokens": 4, "early_stopping": "sometimes"}),
    ("early_stopping", {"beam_width": 2, "max_tokens": 4, "early_stopping": 1}),
    ("num_return_sequences", {"beam_width": 2, "max_tokens": 4, "num_return_sequences": 3}),
    ("num_return_sequences", {"beam_width": 2, "max_tokens": 4, "num_return_sequences": 0}),
    ("stop", {"beam_width": 2, "max_tokens": 4, "stop": [""]}),
    ("stop_token_ids", {"beam_width": 2, "max_tokens": 4, "stop_token_ids": [-5]}),
    ("ignore_eos", {"beam_width": 2, "max_tokens": 4, "ignore_eos": "no"}),
]


@pytest.mark.parametrize("name,kwargs", BAD_SAMPLING, ids=[f"{n}-{k}" for n, k in BAD_SAMPLING])
def test_bad_sampling_params_name_the_argument(name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("name,kwargs", BAD_BEAM, ids=[f"{n}-{k}" for n, k in BAD_BEAM])
def test_bad_beam_params_name_the_argument(name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        BeamSearchParams(**kwargs)


def test_sampling_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert p.stop_strings == [] and p.stop_ids == [] and not p.greedy


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0}, {"top_k": -1}, {"top_k": 0}, {"top_p": 1}, {"min_p": 1},
    {"max_tokens": None}, {"min_tokens": 4, "max_tokens": 4}, {"seed": -3}, {"logprobs": 0},
    {"presence_penalty": -2, "frequency_penalty": 2}, {"repetition_penalty": 0.5},
    {"logprobs": -1}, {"prompt_logprobs": 0}, {"truncate_prompt_tokens": -1},
    {"prompt_logprobs": 0, "prompt_logprobs_start": 7},
    {"logit_bias": {3: -100}}, {"allowed_token_ids": [3]}, {"detokenize": False},
])
def test_edge_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_greedy_is_temperature_zero() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_stop_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(7, 9))
    assert p.stop_strings == ["###"] and p.stop_ids == [7, 9]
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=None)
    assert p.stop_strings == ["a", "bc"] and p.stop_ids == []


def test_replace_revalidates_and_recomputes_stop_lists() -> None:
    p = SamplingParams(stop="x")
    q = dataclasses.replace(p, stop=["y", "z"])
    assert q.stop_strings == ["y", "z"] and p.stop_strings == ["x"]
    with pytest.raises(ValueError, match="^top_p must be"):
        dataclasses.replace(p, top_p=0)


def test_beam_defaults() -> None:
    b = BeamSearchParams(beam_width=3, max_tokens=8)
    assert b.num_return_sequences == 3 and b.early_stopping is False and b.length_penalty == 1.0
    assert b.stop_strings == [] and b.stop_ids == [] and not b.ignore_eos
    assert BeamSearchParams(beam_width=3, max_tokens=8, early_stopping="never").early_stopping == "never"
    assert BeamSearchParams(beam_width=3, max_tokens=8, num_return_sequences=1).num_return_sequences == 1


def test_error_message_shows_the_value() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1\.5"):
        SamplingParams(top_p=1.5)


def test_seed_range_is_what_torch_generators_take():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"


@pytest.mark.parametrize("t", [1e-5, 5e-3, 0.009])
def test_small_temperatures_are_raised_to_vllms_floor(t, caplog):
    with caplog.at_level("WARNING", logger="batchgen"):
        p = SamplingParams(temperature=t)
    assert p.temperature == 0.01 and not p.greedy
    assert "temperature" in caplog.text
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.01).temperature == 0.01


@pytest.mark.parametrize("t", [1e-40, 1e-30, 1e-6, 9.99e-6])
def test_temperatures_below_1e_5_are_greedy(t, caplog):
    """Below vLLM's greedy threshold (_SAMPLING_EPS = 1e-5) a temperature means greedy: it
    becomes 0, not 0.01, so the request samples nothing."""
    with caplog.at_level("WARNING", logger="batchgen"):
        p = SamplingParams(temperature=t, top_p=0.5)
    assert p.temperature == 0 and p.greedy
    assert "greedy" in caplog.text


def test_logprobs_true_means_one_as_in_vllm() -> None:
    p = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert (p.logprobs, p.prompt_logprobs) == (1, 1)

"""Every argument of vLLM's offline API (LLM.__init__ with EngineArgs, generate, chat,
beam_search, SamplingParams, BeamSearchParams), walked from the list read out of vLLM's source
(batchgen/vllm_api.json, scripts/vllm_api_names.py): each is accepted at vLLM's default, and
any other value batchgen cannot honour is a ValueError naming it, never a TypeError."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.lora.seam import LoRASeam
from batchgen.params import RequestOutputKind
from batchgen.speculative.seam import SpecSeam
from batchgen.vllm_args import ALIASES, HONOURED, NO_EFFECT, vllm_api, vllm_engine_defaults

API = vllm_api()
MISSING = "must be a local HuggingFace folder"  # the first check after the arguments'


class Odd:
    """A value no argument takes (a TypeError from it would be a bug)."""

    def __repr__(self) -> str:
        return "Odd()"


def default(record: dict[str, Any]) -> Any:
    """vLLM's default as a value here (None stands for a config object's default)."""
    value = record.get("default")
    return RequestOutputKind.CUMULATIVE if record.get("expr", "").startswith(
        "RequestOutputKind") else value


def test_the_list_is_vllms_and_whole() -> None:
    assert API["vllm_version"] == "0.34.0" and API["sdist_sha256"]
    counts = {k: len(v) for k, v in API.items() if isinstance(v, dict)}
    assert counts["EngineArgs"] > 250 and counts["SamplingParams"] > 35
    assert {"max_logprobs", "disable_log_stats", "enable_chunked_prefill",
            "structured_outputs_config", "scheduling_policy"} <= set(vllm_engine_defaults())


ENGINE = sorted(set(vllm_engine_defaults()) - {"model"})
OWN = set(inspect.signature(LLM.__init__).parameters) | set(HONOURED)  # seams' too


def test_honoured_names_are_the_seams() -> None:
    assert set(HONOURED) == {*LoRASeam.ARGS, *SpecSeam.ARGS}
    assert set(HONOURED) <= set(vllm_engine_defaults())


@pytest.mark.parametrize("name", ENGINE)
def test_each_engine_argument_is_accepted_at_vllms_default(tmp_path, name) -> None:
    value = default(vllm_engine_defaults()[name])
    with pytest.raises(ValueError, match=MISSING):  # past every argument check
        LLM(tmp_path / "no-such-model", **{name: value})


@pytest.mark.parametrize("name", ENGINE)
def test_each_engine_argument_otherwise_is_honoured_or_refused_by_name(tmp_path, name) -> None:
    try:
        LLM(tmp_path / "no-such-model", **{name: Odd()})
    except TypeError as e:  # pragma: no cover - the failure this test exists for
        pytest.fail(f"{name}: TypeError {e}")
    except ValueError as e:
        if name in OWN or name in ALIASES:  # batchgen's own: refused, or past its check
            assert name in str(e) or MISSING in str(e)
        elif name in NO_EFFECT:
            assert MISSING in str(e)
        else:
            assert str(e).startswith(f"{name} must be "), str(e)
            assert f"does not implement vLLM's {name}" in str(e)


def test_refusals_say_what_is_accepted(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size must be 1 \(vLLM's default"):
        LLM(tmp_path / "m", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="not an argument of batchgen's LLM nor one of vLLM"):
        LLM(tmp_path / "m", no_such_argument=1)
    with pytest.raises(ValueError, match=MISSING):  # batchgen's equivalents of vLLM's values
        LLM(tmp_path / "m", runner="generate", tokenizer_mode="hf", hf_token="x",
            num_gpu_blocks_override=8, gpu_memory_utilization=None, max_num_seqs=None)


@pytest.mark.parametrize("name", sorted(API["SamplingParams"]))
def test_each_sampling_field(name) -> None:
    SamplingParams(**{name: default(API["SamplingParams"][name])})
    try:
        SamplingParams(**{name: Odd()})
    except TypeError as e:  # pragma: no cover
        pytest.fail(f"{name}: TypeError {e}")
    except ValueError as e:
        assert name in str(e)
    else:  # pragma: no cover - every field checks its value
        pytest.fail(f"{name} took Odd()")


@pytest.mark.parametrize("name", sorted(set(API["BeamSearchParams"]) - {"beam_width",
                                                                         "max_tokens"}))
def test_each_beam_field(name) -> None:
    BeamSearchParams(beam_width=2, max_tokens=4, **{name: default(API["BeamSearchParams"][name])})
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(beam_width=2, max_tokens=4, **{name: Odd()})


@pytest.mark.parametrize("method", ["generate", "chat", "beam_search"])
def test_call_signatures_take_every_vllm_argument(method) -> None:
    ours = set(inspect.signature(getattr(LLM, method)).parameters)
    assert set(API[f"LLM.{method}"]) <= ours


def test_best_of_is_built_then_refused_at_generate(tiny_model_factory) -> None:
    params = SamplingParams(n=2, best_of=3)  # vLLM V0 built it; V1 refused it at generate
    with pytest.raises(ValueError, match=r"^best_of must be None or an integer >= n"):
        SamplingParams(n=3, best_of=2)
    llm = LLM(tiny_model_factory("llama", vocab_size=300, seed=3), num_kv_blocks=16,
              max_model_len=64)
    with pytest.raises(ValueError, match="best_of is not supported"):
        llm.generate("hi", params, use_tqdm=False)
    for kwargs in ({"lora_request": Odd()}, {"tokenization_kwargs": {"truncation": True}},
                   {"mm_processor_kwargs": {"a": 1}}, {"priority": [0, 1]}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False, **kwargs)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2),
                        concurrency_limit=0)


def test_new_fields_at_their_defaults_leave_a_jobs_identity_as_before() -> None:
    """A dataset job started before vLLM's fields existed stays resumable: at their defaults
    they are left out of the job's params (the fields below are those of the code before)."""
    from batchgen.data import runner

    before = {SamplingParams: {
        "allowed_token_ids", "bad_words", "detokenize", "frequency_penalty", "ignore_eos",
        "include_stop_str_in_output", "logit_bias", "logits_processors", "logprobs",
        "max_tokens", "min_p", "min_tokens", "n", "presence_penalty", "prompt_logprobs",
        "prompt_logprobs_start", "repetition_penalty", "seed", "skip_special_tokens", "stop",
        "stop_token_ids", "structured_outputs", "temperature", "top_k", "top_p",
        "truncate_prompt_tokens"}, BeamSearchParams: {
        "bad_words", "bad_words_ids", "beam_width", "diversity_penalty", "early_stopping",
        "ignore_eos", "length_penalty", "logprobs", "max_tokens", "min_tokens",
        "no_repeat_ngram_size", "num_beam_groups", "num_return_sequences",
        "repetition_penalty", "return_trace", "stop", "stop_token_ids", "structured_outputs",
        "temperature"}}
    for params, new in ((SamplingParams(), runner.VLLM_SAMPLING_FIELDS),
                        (BeamSearchParams(beam_width=2, max_tokens=3), runner.VLLM_BEAM_FIELDS)):
        fields = {f: getattr(params, f) for f in before[type(params)] | set(new)}
        runner.drop_defaults(params, fields, new)
        assert set(fields) == before[type(params)]
    fields = {"best_of": 3}
    runner.drop_defaults(SamplingParams(n=1, best_of=3), fields, ("best_of",))
    assert fields == {"best_of": 3}  # a value asked for stays in the identity
    table = SamplingParams(prompt_logprob_token_ids=[[1, 2], [3]])
    fields = {"prompt_logprob_token_ids": table.prompt_logprob_token_ids}
    runner.drop_defaults(table, fields, ("prompt_logprob_token_ids",))  # an array: in full
    assert runner.json_safe(fields) == {"prompt_logprob_token_ids": [[1, 2], [3, -1]]}

"""`BatchgenProcessorConfig` checks its fields when it is built, before Ray starts anything:
these tests need neither Ray nor a model (tests/test_ray.py runs the processor on Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen import BeamSearchParams, SamplingParams
from batchgen.ray import BatchgenProcessorConfig


def config(**kw) -> BatchgenProcessorConfig:
    return BatchgenProcessorConfig("some/model", **kw)


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": True}, "batch_size must be an integer >= 1, got True"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"batch_size": 8.0}, "batch_size must be an integer >= 1, got 8.0"),
    ({"concurrency": (3, 1)}, r"concurrency must be an integer >= 1 or a \(min, max\) pair"),
    ({"concurrency": True}, "concurrency must be an integer >= 1 .*, got True"),
    ({"concurrency": (1, 2, 3)}, "concurrency must be"),
    ({"concurrency": ("1", 2)}, "concurrency must be"),
    ({"num_gpus": -1}, "num_gpus must be a number >= 0, got -1"),
    ({"num_gpus": "1"}, "num_gpus must be a number >= 0, got '1'"),
    ({"num_cpus": None}, "num_cpus must be a number >= 0, got None"),
    ({"num_cpus": float("nan")}, "num_cpus must be a number >= 0, got nan"),
    ({"sampling_params": "greedy"},
     "sampling_params must be a SamplingParams or a BeamSearchParams, got str"),
    ({"engine_kwargs": [("device", "cpu")]}, "engine_kwargs must be a dict of LLM arguments, "
                                             "got list"),
    ({"prompt_column": ""}, "prompt_column must be a column name"),
    ({"messages_column": 3}, "messages_column must be None or a column name"),
    ({"chat_template": 3}, "chat_template must be None or a Jinja template string"),
    ({"seed": "7"}, "seed must be None or an integer"),
    ({"max_tasks_in_flight_per_actor": 0},
     "max_tasks_in_flight_per_actor must be an integer >= 1 or None, got 0"),
    ({"runtime_env": ["pip"]}, "runtime_env must be None or a Ray runtime_env dict, got list"),
    ({"num_gpus": 1, "engine_kwargs": {"tensor_parallel_size": 2}},
     r"num_gpus must be >= engine_kwargs\['tensor_parallel_size'\] \(2\) on GPU actors, got 1"),
])
def test_bad_fields_are_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**kwargs)


def test_model_source_must_be_a_path() -> None:
    with pytest.raises(ValueError, match="model_source must be a model folder"):
        BatchgenProcessorConfig("")
    with pytest.raises(ValueError, match="model_source must be a model folder"):
        BatchgenProcessorConfig(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [
    {}, {"batch_size": 1, "concurrency": (1, 4), "num_gpus": 1, "num_cpus": 0.5},
    {"concurrency": (2, 2), "seed": -1, "max_tasks_in_flight_per_actor": 2,
     "runtime_env": {"env_vars": {}}},
    {"sampling_params": BeamSearchParams(beam_width=2, max_tokens=4),
     "messages_column": "messages", "prompt_column": "", "chat_template": "{{ x }}",
     "chat_template_kwargs": {"a": 1}},
    {"sampling_params": SamplingParams(n=2), "engine_kwargs": {"device": "cpu"}},
    {"num_gpus": 2, "engine_kwargs": {"tensor_parallel_size": 2}},  # a GPU per rank
    {"engine_kwargs": {"tensor_parallel_size": 2, "device": "cpu"}},  # CPU actors
])
def test_good_fields_are_accepted(kwargs: dict) -> None:
    config(**kwargs)
    BatchgenProcessorConfig(Path("some/model"), **kwargs)  # type: ignore[arg-type]


def verify(prompt: str, text: str) -> float:
    return float(len(text))


@pytest.mark.parametrize("kwargs, message", [
    ({"select": "best"}, "select goes with score="),
    ({"score_num_gpus": 0.5}, "score_num_gpus goes with score="),
    ({"score": verify, "select": "until:2"},
     r"select='until:2' is for local jobs \(generate_dataset\): until:k samples each row in "
     r"rounds"),
    ({"score": verify, "select": "worst"}, "select must be one of best, threshold:X"),
    ({"score": verify, "select": "threshold:high"}, "select must be one of"),
    ({"score": "no/such/folder"}, r"score must be a reward model folder .*\(no config\.json\)"),
    ({"score": 3}, "score must be a reward model folder .* got int"),
    ({"score": verify, "score_engine_kwargs": {"device": "cpu"}},
     "score_engine_kwargs go with a reward model folder"),
    ({"score": verify, "score_workers": 0}, "score_workers must be an integer >= 1"),
    ({"score": verify, "score_concurrency": (2, 1)}, "score_concurrency must be an integer"),
    ({"score": verify, "score_num_gpus": -0.5}, "score_num_gpus must be a number >= 0"),
])
def test_bad_score_fields_are_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**kwargs)


def test_a_generator_folder_is_no_scorer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="is a generator"):
        config(score=str(tmp_path), select="best")
    config(score=verify, select="pairs", score_num_gpus=0.5, score_concurrency=(1, 2))


def test_a_shared_gpu_needs_each_pool_sized(tmp_path: Path) -> None:
    """Fractional GPUs (the generator and the scorer on one device): each model's KV pool
    sized in its kwargs, else refused naming the field before Ray starts."""
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    with pytest.raises(ValueError, match=r"num_gpus=0.5 shares a GPU .* in engine_kwargs"):
        config(num_gpus=0.5)
    with pytest.raises(ValueError, match=r"score_num_gpus=0.5 shares .* in score_engine_kw"):
        config(score=str(rm), score_num_gpus=0.5)
    config(num_gpus=0.5, engine_kwargs={"kv_cache_memory": 2 << 30}, score=str(rm),
           select="best", score_num_gpus=0.5, score_engine_kwargs={"num_kv_blocks": 512})
    config(score=verify, score_num_gpus=0.5)  # a callable holds no pool

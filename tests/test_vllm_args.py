"""vLLM's engine arguments that RL trainers pass: accepted with vLLM's meaning, or refused with
a ValueError naming the argument and the allowed values before anything loads (never a
TypeError)."""

from __future__ import annotations

import pytest

from batchgen import LLM
from batchgen.config import EngineConfig


@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("logprobs_mode", "processed", "'raw_logprobs', 'processed_logprobs', 'raw_logits'"),
    ("enable_sleep_mode", "yes", "True or False"),
    ("model_impl", "vllm", "('auto', 'transformers')"),
    ("distributed_executor_backend", "ray", "(None, 'mp', 'uni', 'external_launcher')"),
    ("quantization", "hqq", "(None, 'fp8', 'compressed-tensors', 'awq', 'gptq', 'bitsandbytes'"),
])
def test_bad_values_are_refused_before_loading(tmp_path, name, value, allowed) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be ") as e:
        LLM(tmp_path / "no-such-model", **{name: value})  # the folder is never looked at
    assert allowed in str(e.value) and repr(value) in str(e.value)


def test_vllm_defaults_and_trl_values_are_accepted() -> None:
    cfg = EngineConfig(logprobs_mode="processed_logprobs", enable_sleep_mode=True,
                       model_impl="transformers", distributed_executor_backend="external_launcher",
                       quantization="bitsandbytes")
    assert cfg.logprobs_mode == "processed_logprobs" and cfg.enable_sleep_mode
    assert EngineConfig().logprobs_mode == "raw_logprobs"
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        EngineConfig(distributed_executor_backend="uni", tensor_parallel_size=2)

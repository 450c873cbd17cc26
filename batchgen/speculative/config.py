"""vLLM's `speculative_config` for the one method batchgen serves, ngram (prompt lookup):
parsed and checked before any weights load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.checks import ValidationError, check, is_int

_DEFAULT_LOOKUP = 5  # vLLM's default for an unset prompt_lookup_min / prompt_lookup_max
# vLLM keys that change nothing for ngram drafts at these values
_NEUTRAL = {"model": (None, "ngram", "[ngram]"), "draft_tensor_parallel_size": (None, 1),
            "disable_by_batch_size": (None,), "quantization": (None,), "max_model_len": (None,)}


@dataclass(frozen=True)
class SpecConfig:
    """ngram drafting: up to `num_speculative_tokens` tokens after the latest earlier match of
    the sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int


def parse_spec_config(value: Any, tensor_parallel_size: int = 1) -> SpecConfig | None:
    """vLLM's `speculative_config` dict (None: off) as a SpecConfig; a ValueError naming
    the key for any method but ngram, unknown keys, bad values, or TP > 1."""
    if value is None or (isinstance(value, dict) and not value):
        return None
    check(isinstance(value, dict), "speculative_config", "None or a dict (vLLM's form: "
          "{'method': 'ngram', 'num_speculative_tokens': k, ...})", value)
    method = value.get("method", "ngram" if value.get("model") in ("ngram", "[ngram]") else None)
    check(method in ("ngram", "[ngram]"), "speculative_config['method']", "'ngram' (batchgen "
          "drafts by prompt lookup only: no draft model, EAGLE, MTP or suffix decoding)", method)
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
    for key, v in value.items():
        if key not in known and not (key in _NEUTRAL and v in _NEUTRAL[key]):
            raise ValidationError(f"speculative_config[{key!r}] is not served with method "
                                  f"'ngram' here (got {v!r}); it takes num_speculative_tokens,"
                                  " prompt_lookup_min and prompt_lookup_max",
                                  parameter="speculative_config", value=key)
    k = value.get("num_speculative_tokens")
    check(is_int(k) and k >= 1, "speculative_config['num_speculative_tokens']",
          "an integer >= 1", k)
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    lo, hi = (lo if lo is not None else hi or _DEFAULT_LOOKUP,
              hi if hi is not None else lo or _DEFAULT_LOOKUP)
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        check(is_int(v) and v >= 1, f"speculative_config[{name!r}]", "an integer >= 1", v)
    check(lo <= hi, "speculative_config['prompt_lookup_min']",
          f"<= prompt_lookup_max ({hi})", lo)
    check(tensor_parallel_size == 1, "speculative_config", "None when tensor_parallel_size > 1"
          " (speculative decoding runs on one device here)", value)
    return SpecConfig(k, lo, hi)

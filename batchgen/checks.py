"""Argument checks shared by every public entry point: a bad value raises a ValueError that
names the argument, the allowed values and what was given, before any work starts."""

from __future__ import annotations

import math
from collections.abc import Collection

# torch.Generator.manual_seed takes [-2**63, 2**64); -1 means "no seed", as in vLLM.
SEED_RANGE = (-(2**63), 2**64)
# why an LLM has no tokenizer, in the messages of what needs one
NO_TOKENIZER = "this LLM has no tokenizer (skip_tokenizer_init=True, or a model folder without one)"


class ValidationError(ValueError):
    """A bad argument: a ValueError that also carries the argument's name and the value given
    (vLLM's `VLLMValidationError` fields, which `vllm_compat` maps to this class)."""

    def __init__(self, message: str, *, parameter: str | None = None, value: object = None
                 ) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


def check(cond: bool, name: str, allowed: str, value: object) -> None:
    """Raise `ValidationError("<name> must be <allowed>, got <value>")` unless `cond`."""
    if not cond:
        raise ValidationError(f"{name} must be {allowed}, got {value!r}", parameter=name,
                              value=value)


def is_int(x: object) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """A finite int or float (not bool, NaN or infinity)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_int(value: object, name: str, minimum: int = 1, allow_none: bool = False) -> None:
    """An integer >= `minimum` (or None when allowed)."""
    if value is None and allow_none:
        return
    check(is_int(value) and value >= minimum, name,
          f"an integer >= {minimum}{' or None' if allow_none else ''}", value)


def check_number(value: object, name: str, minimum: float = 0) -> None:
    """A finite number >= `minimum` (not a bool)."""
    check(is_number(value) and value >= minimum, name, f"a number >= {minimum:g}", value)


def check_type(value: object, name: str, types: type | tuple[type, ...],
               allowed: str | None = None) -> None:
    """An instance of `types`; the message names the allowed types ("a SamplingParams or a
    BeamSearchParams", unless `allowed` words it) and the type that was given (an object's
    repr can be long, or say nothing)."""
    if not isinstance(value, types):
        kinds = types if isinstance(types, tuple) else (types,)
        allowed = allowed or " or ".join(f"a {t.__name__}" for t in kinds)
        raise ValueError(f"{name} must be {allowed}, got {type(value).__name__}")


def check_flag(value: object, name: str) -> None:
    """A real bool (a stray string or 1 would be truthy)."""
    check(isinstance(value, bool), name, "True or False", value)


def check_choice(value: object, name: str, choices: Collection[object]) -> None:
    """One of `choices`."""
    check(value in choices, name, f"one of {tuple(choices)}", value)


def check_seed(value: object, name: str = "seed") -> int | None:
    """A seed: None or an integer in [-2**63, 2**64) (what torch generators take); returns it,
    with -1 as None (vLLM's "no seed")."""
    lo, hi = SEED_RANGE
    check(value is None or (is_int(value) and lo <= value < hi), name,
          "None or an integer in [-2**63, 2**64)", value)
    return None if value == -1 else value  # type: ignore[return-value]

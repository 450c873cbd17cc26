"""How a call's vLLM arguments shape its runs: one priority per request (the order the
priority policy starts them in) and beam search's `concurrency_limit` waves."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from batchgen.checks import ValidationError, check, is_int
from batchgen.engine.sequence import SequenceGroup, priority_key
from batchgen.params import BeamSearchParams
from batchgen.requests import as_prompt_list


def priorities(priority: int | Seq[int] | None, n: int) -> list[int]:
    """One priority per request from vLLM's argument: None (0 for all), one integer for all,
    or a sequence of n integers (a ValidationError naming `priority` otherwise)."""
    if priority is None:
        return [0] * n
    if is_int(priority):
        return [int(priority)] * n
    check(isinstance(priority, Seq) and not isinstance(priority, (str, bytes))
          and all(is_int(p) for p in priority), "priority",
          "None, an integer or a sequence of integers, one per prompt", priority)
    if len(priority) != n:
        raise ValidationError(f"The lengths of prompts ({n}) and priority ({len(priority)}) "
                              "must be the same.", parameter="priority", value=len(priority))
    return [int(p) for p in priority]


def queue_order(groups: list[SequenceGroup], priority: Any, by_priority: bool
                ) -> list[SequenceGroup]:
    """The groups with their priorities set, in the order they are queued: input order, or
    under the priority policy lower priority first, ties in input order (vLLM's engine holds
    every request of a call at once and starts them so)."""
    for g, p in zip(groups, priorities(priority, len(groups))):
        g.priority = p
    return sorted(groups, key=priority_key) if by_priority else groups


def waves(prompts: Any, params: Any, priority: Any, limit: int | None, lora: Any = None
          ) -> Iterator[tuple[Any, Any, Any, Any]]:
    """vLLM's beam search `concurrency_limit`: (prompts, params, priority, lora_request) of
    each wave of at most `limit` prompts, in input order (None: one wave of all of them); a
    per-prompt list is cut with its prompts."""
    check(limit is None or (is_int(limit) and limit >= 1), "concurrency_limit",
          "None or an integer >= 1", limit)
    if limit is None:
        yield prompts, params, priority, lora
        return
    prompts = as_prompt_list(prompts)
    one = isinstance(params, BeamSearchParams)
    params = params if one else list(params)
    shared = priority is None or is_int(priority)
    priority = priority if shared else list(priority)
    one_lora = not isinstance(lora, (list, tuple))
    for lo in range(0, len(prompts), limit):
        cut = slice(lo, lo + limit)
        yield (prompts[cut], params if one else params[cut],
               priority if shared else priority[cut], lora if one_lora else lora[cut])


def length(prompts: object) -> int | None:
    """How many prompts, when the iterable knows (for the progress bar's total)."""
    if isinstance(prompts, (str, dict)):
        return 1
    try:
        return len(prompts)  # type: ignore[arg-type]
    except TypeError:
        return None


def model_name(model: object) -> str:
    """The model's name for metric labels: its path or hub id, or a module's name_or_path."""
    return str(getattr(model, "name_or_path", model))

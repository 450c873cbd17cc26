"""PoolingParams (vLLM's fields); the runner a model gets from its architecture is
batchgen.runners' (re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.checks import check, check_int, check_type, is_int
from batchgen.runners import RUNNERS, resolve_runner

__all__ = ["POOLING_TASKS", "RUNNERS", "PoolingParams", "resolve_runner"]

POOLING_TASKS = ("embed", "classify", "reward", "token_classify", "score", "encode")


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams: `truncate_prompt_tokens` (keep the last k prompt tokens; -1 the
    model's limit), `dimensions` (Matryoshka: the first d of an embedding), `normalize`
    (L2-normalize an embedding; default True for embed), `use_activation` (sigmoid/softmax on
    classifier outputs; default False for rewards: the raw reward), `step_tag_id` (PRM: score
    only positions holding this token) and `returned_token_ids` (keep these label columns)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        check(t is None or (is_int(t) and (t == -1 or t >= 1)), "truncate_prompt_tokens",
              "None, -1 or an int >= 1", t)
        check_int(self.dimensions, "dimensions", minimum=1, allow_none=True)
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            check(value is None or isinstance(value, bool), name, "None or a bool", value)
        check_int(self.step_tag_id, "step_tag_id", minimum=0, allow_none=True)
        ids = self.returned_token_ids
        if ids is not None:
            check_type(ids, "returned_token_ids", (list, tuple))
            check(len(ids) > 0 and all(is_int(i) and i >= 0 for i in ids),
                  "returned_token_ids", "a non-empty list of ints >= 0", ids)

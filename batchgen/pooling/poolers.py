"""Poolers: one request's hidden states (or head outputs) [T, H] to what a task returns."""

from __future__ import annotations

import torch

from batchgen.checks import check_choice
from batchgen.pooling.params import PoolingParams


def pool(task: str, states: torch.Tensor, params: PoolingParams,
         token_ids: list[int] | None = None, method: str = "last") -> torch.Tensor:
    """`states` is one request's [T, D] rows in prompt order (hidden states for "embed",
    the head's per-token outputs for the others). "embed": last-token or mean pooling, then
    `dimensions`, then L2 normalization (default on); "classify"/"reward"/"score": the last
    token's row, a sigmoid (one label) or softmax only under `use_activation=True` (rewards
    stay raw by default); "token_classify": every row, or under `step_tag_id` the rows whose
    token is the step tag (PRM step scores), then `returned_token_ids` columns."""
    check_choice(task, "pooling_task", ("embed", "classify", "reward", "score",
                                        "token_classify", "encode"))
    check_choice(method, "pooling method", ("last", "mean"))
    if task in ("embed", "encode"):
        out = states[-1] if method == "last" else states.mean(dim=0)
        if params.dimensions is not None:
            out = out[:params.dimensions]
        if params.normalize is not False and task == "embed":
            out = torch.nn.functional.normalize(out, dim=-1)
        return out
    if task == "token_classify":
        out = states
        if params.step_tag_id is not None:
            keep = torch.tensor([t == params.step_tag_id for t in token_ids or []],
                                dtype=torch.bool, device=states.device)
            out = states[keep]
    else:
        out = states[-1]
    if params.returned_token_ids is not None:
        out = out[..., list(params.returned_token_ids)]
    if params.use_activation:
        out = torch.sigmoid(out) if out.shape[-1] == 1 else torch.softmax(out, dim=-1)
    return out

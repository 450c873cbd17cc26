"""vLLM's `logprob_token_ids`: the logprobs of the token ids a request names (beside the
chosen token's own), at every token it generates, with their ranks. Only the rows that name
ids pay for them: one gather and one sort of those rows' logprobs per step."""

from __future__ import annotations

import numpy as np
import torch

from batchgen.transfer import to_device

NAMED_LOGPROBS = -3  # the batch's logprobs column of a row naming its ids (not a top-k)


def named_matrix(ids: list[tuple[int, ...]], rows: np.ndarray, num_rows: int) -> np.ndarray:
    """[num_rows, W] int64: row `rows[j]` holds `ids[j]`, every other entry -1 (a pad)."""
    width = max(map(len, ids), default=0)
    out = np.full((num_rows, width), -1, np.int64)
    for row, row_ids in zip(rows.tolist(), ids):
        out[row, :len(row_ids)] = row_ids
    return out


def gather_ids(scores: torch.Tensor, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """`scores` [N, V] at rows `rows` [M] and ids `ids` [M, W] (-1 pads), on the host as
    float32 [M, W], -inf at a pad."""
    dev = scores.device
    index = to_device(np.maximum(ids, 0).astype(np.int64), dev)
    picked = scores[to_device(rows, dev)].gather(1, index)
    return picked.masked_fill(to_device(ids < 0, dev), float("-inf")).float().cpu().numpy()


def named_scores(lp: torch.Tensor, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' logprobs `lp` [A, V] at `ids` [A, W] (-1 pads): their values [A, W] (-inf at a
    pad) and ranks [A, W] (1 = the most likely; tokens of equal logprob share the better
    rank, as the chosen token's does; 0 at a pad)."""
    pad = to_device(ids < 0, lp.device)
    values = lp.gather(1, to_device(np.maximum(ids, 0), lp.device))
    ascending = lp.sort(dim=-1).values
    not_above = torch.searchsorted(ascending, values.contiguous(), right=True)
    ranks = lp.shape[1] - not_above + 1
    return values.masked_fill(pad, float("-inf")), ranks.masked_fill(pad, 0)

"""ngram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens (the longest n first), as vLLM's ngram proposer picks them."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from batchgen.speculative.config import SpecConfig


def propose(tokens: np.ndarray, cfg: SpecConfig, limit: int) -> np.ndarray:
    """Up to min(num_speculative_tokens, limit) draft ids for a sequence of `tokens`: after
    the rightmost earlier match of its longest suffix of n tokens, n from prompt_lookup_max
    down to prompt_lookup_min (vector ops over the sequence; empty when nothing matches)."""
    k = min(cfg.num_speculative_tokens, limit)
    size = len(tokens)
    for n in range(min(cfg.prompt_lookup_max, size - 1), cfg.prompt_lookup_min - 1, -1):
        windows = sliding_window_view(tokens[:size - 1], n)  # every start but the suffix's
        hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
        if len(hits) and k > 0:
            at = int(hits[-1]) + n  # the token after the match
            return tokens[at:at + k]
    return tokens[:0]

"""ngram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens (the longest n first), as vLLM's ngram proposer picks them."""

from __future__ import annotations

import numpy as np

from batchgen.speculative.config import SpecConfig


def propose(tokens: np.ndarray, cfg: SpecConfig, limit: int) -> np.ndarray:
    """Up to min(num_speculative_tokens, limit) draft ids for a sequence of `tokens`: after
    the rightmost earlier match of its longest suffix of n tokens, n from prompt_lookup_max
    down to prompt_lookup_min; empty when nothing matches. Vector ops: the earlier positions
    holding its last token, narrowed one token further back at a time."""
    k, size = min(cfg.num_speculative_tokens, limit), len(tokens)
    if k <= 0 or size < 2:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1])  # where an earlier match ends
    best = -1
    for n in range(1, min(cfg.prompt_lookup_max, size - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[size - n]]
        if not len(ends):
            break
        if n >= cfg.prompt_lookup_min:
            best = int(ends[-1])
    return tokens[best + 1:best + 1 + k] if best >= 0 else tokens[:0]

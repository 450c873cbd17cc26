"""ngram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens (the longest n first), as vLLM's ngram proposer picks them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


class TokenArrays:
    """The drafting rows' tokens as int64 arrays kept across steps, each grown by only the
    tokens appended since it was last read (O(new tokens) a row a step, not O(its length));
    rows that left the step are dropped."""

    def __init__(self) -> None:
        self._arrays: dict[Any, tuple[np.ndarray, int]] = {}  # Sequence -> (buffer, used)

    def of(self, seqs: Sequence[Any]) -> list[np.ndarray]:
        """Each sequence's tokens (views of the kept buffers, valid until the next call)."""
        kept, out = {}, []
        for seq in seqs:
            buf, used = self._arrays.get(seq, (np.empty(0, np.int64), 0))
            size = len(seq.token_ids)
            if size > len(buf):  # room for this step's tokens and the next steps' few
                buf = np.concatenate((buf[:used], np.empty(size - used + 64, np.int64)))
            buf[used:size] = seq.token_ids[used:size]
            kept[seq] = (buf, size)
            out.append(buf[:size])
        self._arrays = kept
        return out

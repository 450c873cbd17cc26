"""How many tokens of a prefill run in one step: the budget's share, cut where its bits
cannot depend on the cut (the scheduler's rule, kept apart so it is testable alone)."""

from __future__ import annotations

from collections.abc import Callable


def chunk_size(start: int, left: int, budget: int, max_num_batched_tokens: int,
               grid: int = 0, cut: Callable[[int, int], int] | None = None) -> int:
    """`grid_chunk`'s size, shortened by `cut(start, n)` where the request says a chunk
    must not end (inside an image whose attention is bidirectional)."""
    n = grid_chunk(start, left, budget, max_num_batched_tokens, grid)
    return cut(start, n) if cut is not None and n else n


def grid_chunk(start: int, left: int, budget: int, max_num_batched_tokens: int,
               grid: int = 0) -> int:
    """Tokens of a prefill chunk from `start` with `left` tokens to go: as many as the budget
    allows, but never a lone token out of a longer run (a one-query chunk runs as a decode row,
    whose bits differ from the same position inside a prefill tile; budgets under 3 tokens
    cannot always avoid it, so they don't try). With state mixers (`grid` > 0) a chunk that
    stops early ends on the grid, where every prefill of the prompt is cut (state/snapshots.py),
    unless not even a piece fits an empty step; 0: none fits this step."""
    n = min(left, budget)
    if n >= left:
        return left
    if grid:
        g = (start + n) // grid * grid - start
        g = g - grid if left - g == 1 else g
        if g > 0 or budget < max_num_batched_tokens:
            return max(g, 0)
        # a whole step too small for a grid piece (budget under two blocks): off the grid
    if max_num_batched_tokens >= 3:
        if left - n == 1:
            n -= 1
        if n == 1:
            n = 0
    return n

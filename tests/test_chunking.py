"""The scheduler's chunk rule (engine/chunking.py) and the state mixers' prefill grid
(state/snapshots.py): chunks end on the grid, never leave a lone token, and the grid cuts
are the grid points strictly inside each row's chunk."""

from __future__ import annotations

import numpy as np

from batchgen.engine.chunking import chunk_size
from batchgen.state.snapshots import grid_cuts, merge_cuts, prefill_grid


def test_chunks_without_a_grid_never_leave_a_lone_token():
    assert chunk_size(0, 20, 100, 100) == 20
    assert chunk_size(0, 9, 8, 100) == 7  # not 8: the 9th would run alone as a decode row
    assert chunk_size(0, 20, 1, 100) == 0  # a lone token out of a longer run waits
    assert chunk_size(0, 20, 1, 2) == 1  # budgets under 3 tokens cannot avoid it


def test_grid_chunks_end_on_the_grid_or_take_the_rest():
    assert chunk_size(0, 20, 100, 100, grid=8) == 20
    assert chunk_size(0, 20, 12, 100, grid=8) == 8
    assert chunk_size(8, 12, 7, 100, grid=8) == 0  # no grid point within reach: wait
    assert chunk_size(3, 30, 20, 100, grid=8) == 13  # an off-grid start reaches the grid
    assert chunk_size(0, 17, 16, 100, grid=8) == 8  # 16 would leave a lone 17th token
    # an empty step too small for a piece still makes progress, off the grid
    assert chunk_size(0, 9, 8, 8, grid=8) == 7


def test_the_grid_is_a_block_multiple_near_256_within_half_the_budget():
    assert prefill_grid(16, 8192) == 256
    assert prefill_grid(4, 16) == 8
    assert prefill_grid(512, 8192) == 512
    assert prefill_grid(16, 16) == 16


def test_grid_cuts_are_the_points_strictly_inside_each_chunk():
    cuts = grid_cuts(np.array([0, 5, 8, 3]), np.array([20, 1, 8, 14]), 8)
    assert cuts.tolist() == [[0, 0, 3, 3], [8, 16, 5, 13], [-1, -1, -1, -1]]
    snaps = np.array([[0], [8], [42]])  # a snapshot where a cut is: the cut goes
    assert merge_cuts(snaps, cuts).tolist() == [[0, 0, 3, 3], [8, 16, 5, 13], [42, -1, -1, -1]]


def test_a_prompts_resume_point_is_cut_too_unless_on_the_grid_or_outside():
    own = np.array([13, 16, 30, 0])
    cuts = grid_cuts(np.array([0, 0, 0, 0]), np.array([20, 20, 20, 20]), 8, own)
    assert sorted(zip(*cuts[:2].tolist())) == [(0, 8), (0, 13), (0, 16), (1, 8), (1, 16),
                                               (2, 8), (2, 16), (3, 8), (3, 16)]

"""Datasets at scale: n samples (or beams) for every row, streamed, sharded, resumable."""

from batchgen.data.rows import row_params, row_seed
from batchgen.data.stages import generate_dataset  # the runner's, with score/select stages

__all__ = ["generate_dataset", "row_params", "row_seed"]

"""The sampler's masked elementwise stages and its draw as C loops on the CPU
(csrc/sampling_ops.c, built once like the decode kernel): the penalties and the -inf
masks of top-k, top-p and min-p (the same float32 operations as the PyTorch path, so the same
bits; tested), one pass each instead of PyTorch's several masked ones; and the inverse-CDF
draw, summing the probabilities in token order (PyTorch's cumsum rounds differently, so a u
that falls on an interval's edge may pick the neighbour: the distribution is the same).
Without a compiler, or with BATCHGEN_CPU_KERNEL=0, the sampler uses PyTorch."""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from batchgen.cpu_build import ENV_SWITCH, KernelUnavailable, load_library

logger = logging.getLogger("batchgen")

SOURCE = Path(__file__).parent / "csrc" / "sampling_ops.c"


class SamplingOps:
    """Typed wrappers; inputs must be contiguous float32 (bool for masks) CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pen = lib.batchgen_penalize
        self._pen.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2
        self._pen.restype = None
        self._mask = lib.batchgen_mask_below
        self._mask.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        self._mask.restype = None
        self._add = lib.batchgen_penalty_add
        self._add.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 2
        self._add.restype = None
        self._cut = lib.batchgen_top_p_cut
        self._cut.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2
        self._cut.restype = None
        self._uni = lib.batchgen_uniforms
        self._uni.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
        self._uni.restype = None
        self._icdf = lib.batchgen_inverse_cdf
        self._icdf.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
        self._icdf.restype = None

    def penalize(self, scores: torch.Tensor, seen: torch.Tensor | None,
                 penalty: torch.Tensor | None, offsets: torch.Tensor | None) -> torch.Tensor:
        """HF's repetition penalty on [R, V] scores where `seen` [R, V] (penalty [R]; None:
        none), then minus `offsets` [R, V] (None: none), in one pass."""
        scores = _ready(scores)
        if seen is not None:
            seen, penalty = _ready(seen, torch.bool), _ready(penalty)
            _check_rows(scores, seen, penalty)
        if offsets is not None:
            offsets = _ready(offsets)
            _check_rows(scores, offsets, scores[:, 0])
        out = torch.empty_like(scores)
        self._pen(scores.data_ptr(), 0 if seen is None else seen.data_ptr(),
                  0 if seen is None else penalty.data_ptr(),
                  0 if offsets is None else offsets.data_ptr(), out.data_ptr(),
                  scores.shape[0], scores.shape[1])
        return out

    def mask_below(self, scores: torch.Tensor, ref: torch.Tensor, limit: torch.Tensor,
                   inclusive: bool = False) -> torch.Tensor:
        """`scores` with -inf where ref < limit[row] (<= when `inclusive`)."""
        scores, ref, limit = _ready(scores), _ready(ref), _ready(limit.reshape(-1))
        _check_rows(scores, ref, limit)
        out = torch.empty_like(scores)
        self._mask(scores.data_ptr(), ref.data_ptr(), limit.data_ptr(), out.data_ptr(),
                   scores.shape[0], scores.shape[1], int(inclusive))
        return out


    def top_p_cut(self, probs: torch.Tensor, sorted_vals: torch.Tensor, cut: torch.Tensor,
                  scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF top-p's removal from its sorted pass (`probs`: the softmax of the ascending
        `sorted_vals`, summed here as PyTorch's cumsum does, only up to the cut; cut = 1 - top_p
        per row): `scores` with the removed tokens -inf, and the rows where the cut splits
        tied tokens (to redo with an index sort)."""
        probs, sorted_vals = _ready(probs), _ready(sorted_vals)
        scores, cut = _ready(scores), _ready(cut.reshape(-1))
        _check_rows(scores, probs, cut)
        _check_rows(scores, sorted_vals, cut)
        out = torch.empty_like(scores)
        partial = torch.empty(scores.shape[0], dtype=torch.bool)
        self._cut(probs.data_ptr(), sorted_vals.data_ptr(), cut.data_ptr(), scores.data_ptr(),
                  out.data_ptr(), partial.data_ptr(), scores.shape[0], scores.shape[1])
        return out, partial

    def uniforms(self, keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
        """sampler.uniforms in one C loop (the same integers, so the same doubles)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        counters = np.ascontiguousarray(counters, np.int64)
        if keys.shape != counters.shape or keys.ndim != 1:
            raise ValueError("uniforms: keys and counters must be 1-D and alike")
        out = np.empty(len(keys), np.float64)
        self._uni(keys.ctypes.data, counters.ctypes.data, out.ctypes.data, len(keys))
        return out

    def inverse_cdf(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Per row the token whose interval of the cumulative distribution (summed in token
        order) holds u * total; u [R] float64 in [0, 1)."""
        probs, u = _ready(probs), _ready(u, torch.float64)
        _check_rows(probs, probs, u)
        out = torch.empty(probs.shape[0], dtype=torch.int64)
        self._icdf(probs.data_ptr(), u.data_ptr(), out.data_ptr(), probs.shape[0],
                   probs.shape[1])
        return out


    def penalty_add(self, counts: torch.Tensor, seen: torch.Tensor, offsets: torch.Tensor,
                    slots: np.ndarray, tokens: np.ndarray, frequency: np.ndarray,
                    presence: np.ndarray) -> None:
        """The penalty tables ([slots, V]: int32 counts, bool seen, float32 offsets) after
        slots[i] generated tokens[i]; in place."""
        for t, dtype in ((counts, torch.int32), (seen, torch.bool), (offsets, torch.float32)):
            if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"penalty tables must be contiguous {dtype} CPU tensors")
        slots, tokens = np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(tokens, np.int64)
        frequency = np.ascontiguousarray(frequency, np.float32)
        presence = np.ascontiguousarray(presence, np.float32)
        rows, vocab = counts.shape
        if not (len(slots) == len(tokens) == len(frequency) == len(presence)) or (
                len(slots) and (slots.min() < 0 or slots.max() >= rows or tokens.min() < 0
                                or tokens.max() >= vocab)):
            raise ValueError("penalty_add: slots and tokens must index the tables")
        self._add(counts.data_ptr(), seen.data_ptr(), offsets.data_ptr(), slots.ctypes.data,
                  tokens.ctypes.data, frequency.ctypes.data, presence.ctypes.data, len(slots),
                  vocab)


def _ready(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"expected a {dtype} CPU tensor, got {t.dtype} on {t.device}")
    return t.contiguous()


def _check_rows(scores: torch.Tensor, other: torch.Tensor, per_row: torch.Tensor) -> None:
    if (scores.dim() != 2 or other.shape != scores.shape
            or per_row.numel() != scores.shape[0]):
        raise ValueError(f"shapes {tuple(scores.shape)}, {tuple(other.shape)} and "
                         f"{tuple(per_row.shape)} do not match ([R, V], [R, V], [R])")


def load() -> SamplingOps | None:
    """The ops, built once per process; None where they cannot be (or are switched off)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    return _load_once()


@lru_cache(maxsize=1)
def _load_once() -> SamplingOps | None:
    try:
        return SamplingOps(load_library(SOURCE))
    except KernelUnavailable as e:
        logger.info("CPU sampling ops unavailable (%s); using PyTorch", e)
        return None

"""vLLM's `prompt_logprob_token_ids`: a table of token ids per scored prompt row, normalized to
one int32 array (-1 pads a shorter row) and checked: its form when the params are built, its
bounds against the model (vocabulary, max_logprobs, context) at generate and in `verify`."""

from __future__ import annotations

import numbers

import numpy as np

from batchgen.checks import ValidationError

_NAME = "prompt_logprob_token_ids"


def as_id_table(value: object) -> np.ndarray | None:
    """None, or the table as a C-contiguous int32 [rows, ids] array: nested lists of ints
    (ragged rows padded with -1) or an integer numpy array, non-empty in both dimensions,
    every entry a token id or -1. A ValidationError in vLLM's words otherwise."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        shape = value.shape if value.dtype.kind in "iu" else ()
    elif isinstance(value, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in value):
        shape = (len(value), max(map(len, value), default=0))
    else:
        shape = ()
    if len(shape) != 2 or 0 in shape:
        raise ValidationError(f"{_NAME} must be a non-empty integer array of shape "
                              "[num_rows, num_ids]", parameter=_NAME,
                              value=getattr(value, "shape", type(value).__name__))
    table = _padded(value, shape) if not isinstance(value, np.ndarray) else value
    if int(table.min()) < -1 or int(table.max()) > np.iinfo(np.int32).max:
        raise _out_of_vocab(None)  # no vocabulary reaches 2**31 ids
    return np.ascontiguousarray(table, dtype=np.int32)


def _padded(rows: list | tuple, shape: tuple[int, int]) -> np.ndarray:
    """Nested lists as an int64 array, each row padded with -1 to the widest."""
    out = np.full(shape, -1, np.int64)
    for i, row in enumerate(rows):
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                   and -2**63 <= t < 2**63 for t in row):
            raise ValidationError(f"{_NAME} must contain integer token ids", parameter=_NAME)
        out[i, :len(row)] = row
    return out


def check_id_table(table: np.ndarray | None, vocab: int, max_logprobs: int,
                   max_model_len: int | None = None) -> None:
    """The table against the model: at most max_model_len - 1 rows (the rows a prompt can
    have), at most max_logprobs ids a row (-1 there: the vocabulary), every id inside the
    vocabulary; vLLM's messages."""
    if table is None:
        return
    rows, width = table.shape
    if max_model_len is not None and rows > max_model_len - 1:
        raise ValidationError(f"{_NAME} has {rows} rows, but a prompt has at most "
                              f"{max_model_len - 1} scored rows (max_model_len - 1).",
                              parameter=_NAME, value=rows)
    most = vocab if max_logprobs == -1 else max_logprobs
    if width > most:
        raise ValidationError(f"Requested {width} token ids per row in {_NAME}, which is "
                              f"greater than max allowed: {most}. Set max_logprobs "
                              f"(--max-logprobs) to at least {width}.", parameter=_NAME,
                              value=width)
    if int(table.max()) >= vocab:
        raise _out_of_vocab(vocab)


def check_table_rows(table: np.ndarray | None, prompt_len: int, first_scored: int) -> None:
    """A table has a row per scored prompt row: prompt_len - 1 - start of them, `start`
    (vLLM's prompt_logprob_start) being `first_scored - 1` (one less than batchgen's
    prompt_logprobs_start, the first position scored); vLLM's message."""
    if table is None:
        return
    start = max(first_scored, 1) - 1
    if start and start >= prompt_len - 1:
        raise ValidationError(f"prompt_logprob_start must be less than prompt_len - 1 "
                              f"({prompt_len - 1}) so at least one prompt row is scored.",
                              parameter="prompt_logprob_start", value=start)
    rows = max(prompt_len - 1 - start, 0)
    if len(table) != rows:
        raise ValidationError(f"{_NAME} has {len(table)} rows, but the prompt has {rows} "
                              "scored rows (prompt_len - 1 - prompt_logprob_start).",
                              parameter=_NAME, value=len(table))


def _out_of_vocab(vocab: int | None) -> ValidationError:
    size = f" Vocabulary size: {vocab}" if vocab is not None else ""
    return ValidationError(f"{_NAME} contain out-of-vocab token ids (-1 pads a row).{size}",
                           parameter=_NAME)

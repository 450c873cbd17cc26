"""vLLM's `logprobs_mode`: which values a sample's (and a prompt's) logprobs report.

raw_* read the model's logits as they come out of the forward; processed_* read the logits the
token was actually drawn from: after the structured-output mask, logit controls, penalties and
the min_tokens ban, and for sampled rows temperature, top-k, top-p and min-p (greedy rows stop
before temperature, as in vLLM). *_logprobs are log-softmaxes of those values (masked tokens
-inf), *_logits the values themselves. RL trainers (TRL) compare processed logprobs with their
own temperature-scaled recomputation.

Beam search ranks hypotheses by summed log-probabilities (HF's: log_softmax, then the beam's
processors), and reports those values for the chosen tokens: they are the processed_logprobs of
a beam (and equal the raw ones when the beam has no repetition penalty, temperature or
diversity penalty). The logits modes have no meaning for beams and are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgen.checks import check, check_choice

RAW_LOGPROBS, PROCESSED_LOGPROBS = "raw_logprobs", "processed_logprobs"
RAW_LOGITS, PROCESSED_LOGITS = "raw_logits", "processed_logits"
LOGPROBS_MODES = (RAW_LOGPROBS, PROCESSED_LOGPROBS, RAW_LOGITS, PROCESSED_LOGITS)
BEAM_MODES = (RAW_LOGPROBS, PROCESSED_LOGPROBS)

if TYPE_CHECKING:  # torch stays out of the CLI's start-up (`batchgen --help` reads the modes)
    import torch


def check_logprobs_mode(mode: object) -> str:
    """The mode, or a ValueError naming the allowed ones."""
    check_choice(mode, "logprobs_mode", LOGPROBS_MODES)
    return mode  # type: ignore[return-value]


def check_beam_mode(mode: str, name: str = "logprobs_mode") -> None:
    """ValueError for a logits mode with beam search (beams sum log-probabilities)."""
    check(mode in BEAM_MODES, name, f"one of {BEAM_MODES} for beam search (beams are ranked "
          "by summed log-probabilities, not logits)", mode)


def is_processed(mode: str) -> bool:
    """Whether the mode reads the processed logits (the sampler must keep them)."""
    return mode in (PROCESSED_LOGPROBS, PROCESSED_LOGITS)


def reported(mode: str, raw: torch.Tensor, processed: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [R, V], normaliser [R]): a row's reported value for token t is
    `values[t] - normaliser` (the log-sum-exp for logprobs, 0 for logits)."""
    values = processed if is_processed(mode) else raw
    assert values is not None, "processed logits were not kept"
    if mode in (RAW_LOGITS, PROCESSED_LOGITS):
        return values, values.new_zeros(values.shape[0])
    return values, values.logsumexp(dim=-1)

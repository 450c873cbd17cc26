"""HF's logits processors for a set of beams, on their log-probabilities, in HF's order.

HF beam search takes ``log_softmax`` of the logits first and runs its processors on those
log-probabilities (``GenerationMixin._beam_search``: ``log_probs = logits_processor(
running_sequences, log_softmax(logits))``), in the order of ``_get_logits_processor``:
``RepetitionPenaltyLogitsProcessor`` -> ``NoRepeatNGramLogitsProcessor`` ->
``NoBadWordsLogitsProcessor`` -> ``MinNewTokensLengthLogitsProcessor`` -> (sampling only)
``TemperatureLogitsWarper``. Each reads the beam's whole sequence, prompt included. A beam's
score then accumulates the processed values, so ``cumulative_logprob`` and ``score`` are HF's
``sequences_scores`` arithmetic on them.

:class:`BeamControls` holds the beams' token ids as one ``[rows, prompt + max_tokens]`` tensor
(HF's ``running_sequences``), reordered by one gather per step; every processor is a few tensor
ops over the group's rows (no Python loop over the vocabulary or over beams).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.params import ControlSpec

__all__ = ["BeamControls"]


class BeamControls:
    """The processors of ``spec`` for ``rows`` beams sharing ``prompt``; :meth:`process` a step's
    ``[rows, V]`` log-probs, then :meth:`advance` with the beams the step selected."""

    def __init__(self, spec: ControlSpec, prompt: Sequence[int], rows: int, max_tokens: int,
                 stop_ids: Sequence[int]) -> None:
        self.spec = spec
        self.rows = rows
        self.length = len(prompt)  # tokens per row so far (HF input_ids.shape[-1])
        self.prompt_len = len(prompt)
        self._prompt = list(prompt)
        self._capacity = len(prompt) + max_tokens
        # HF NoBadWordsLogitsProcessor drops single-token bad words that are an EOS id
        eos = {int(t) for t in stop_ids}
        words = [w for w in spec.bad_words_ids if not (len(w) == 1 and w[0] in eos)]
        self._single = sorted({w[0] for w in words if len(w) == 1})
        by_len: dict[int, list[tuple[int, ...]]] = {}
        for w in dict.fromkeys(w for w in words if len(w) > 1):
            by_len.setdefault(len(w) - 1, []).append(w)
        self._multi = list(by_len.values())
        self._stop_ids = sorted(eos)
        self._seqs: torch.Tensor | None = None
        self._device: torch.device | None = None

    def _init(self, device: torch.device) -> None:
        """The device tensors, made on the first step's device."""
        self._device = device
        if self.spec.needs_sequences:
            seqs = torch.zeros((self.rows, self._capacity), dtype=torch.long, device=device)
            seqs[:, :self.prompt_len] = torch.tensor(self._prompt, dtype=torch.long, device=device)
            self._seqs = seqs
        self._single_t = torch.tensor(self._single, dtype=torch.long, device=device)
        self._stop_t = torch.tensor(self._stop_ids, dtype=torch.long, device=device)
        self._multi_t = [(torch.tensor([w[:-1] for w in ws], dtype=torch.long, device=device),
                          torch.tensor([w[-1] for w in ws], dtype=torch.long, device=device))
                         for ws in self._multi]

    def process(self, logprobs: torch.Tensor) -> torch.Tensor:
        """The step's ``[rows, V]`` log-probs after HF's processors (a new tensor)."""
        if self._device is None:
            self._init(logprobs.device)
        s = self.spec
        seqs = None if self._seqs is None else self._seqs[:, :self.length]
        out = logprobs
        if s.repetition_penalty != 1.0:
            out = _repetition(out, seqs, s.repetition_penalty)
        if s.no_repeat_ngram_size > 0:
            out = _no_repeat_ngram(out, seqs, s.no_repeat_ngram_size)
        if self._single or self._multi:
            out = self._bad_words(out, seqs)
        if self.length - self.prompt_len < s.min_tokens and len(self._stop_ids):
            out = out.index_fill(1, self._stop_t, -float("inf"))
        if s.temperature != 1.0:
            out = out / s.temperature
        return out

    def _bad_words(self, scores: torch.Tensor, seqs: torch.Tensor | None) -> torch.Tensor:
        """HF NoBadWordsLogitsProcessor: a word's last token is banned where the beam ends with
        the word's other tokens (single-token words always)."""
        vocab = scores.shape[1]
        banned = torch.zeros((scores.shape[0], vocab + 1), dtype=torch.bool, device=scores.device)
        if self._single:
            banned[:, self._single_t] = True
        for prefixes, last in self._multi_t:
            n = prefixes.shape[1]
            if n > self.length:
                continue
            match = (seqs[:, None, -n:] == prefixes[None]).all(dim=-1)  # [rows, words]
            banned.scatter_(1, torch.where(match, last[None], vocab), True)
        return scores.masked_fill(banned[:, :vocab], -float("inf"))

    def advance(self, parents: Sequence[int], tokens: Sequence[int]) -> None:
        """Row ``j`` is now row ``parents[j]`` extended by ``tokens[j]`` (HF's reorder)."""
        if self._seqs is not None:
            dev = self._seqs.device
            idx = torch.tensor(list(parents), dtype=torch.long, device=dev)
            self._seqs = self._seqs.index_select(0, idx)
            self._seqs[:, self.length] = torch.tensor(list(tokens), dtype=torch.long, device=dev)
        self.length += 1


def _repetition(scores: torch.Tensor, seqs: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF RepetitionPenaltyLogitsProcessor: every token in the beam (prompt included) has its
    score multiplied by the penalty where negative, divided where positive."""
    score = torch.gather(scores, 1, seqs)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return scores.scatter(1, seqs, score)


def _no_repeat_ngram(scores: torch.Tensor, seqs: torch.Tensor, n: int) -> torch.Tensor:
    """HF NoRepeatNGramLogitsProcessor: a token that would repeat an n-gram already in the beam
    (prompt included) is banned."""
    cur_len = seqs.shape[1]
    if cur_len < n:
        return scores
    prefix = seqs[:, cur_len + 1 - n:]
    windows = seqs.unfold(dimension=1, size=n, step=1)
    matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1)
    vocab = scores.shape[-1]
    banned = scores.new_zeros((scores.shape[0], vocab + 1), dtype=torch.bool)
    # (HF clamps ids past the output vocabulary; prompts are checked to lie inside it)
    banned.scatter_(1, torch.where(matches, windows[..., -1], vocab), True)
    return scores.masked_fill(banned[:, :vocab], -float("inf"))

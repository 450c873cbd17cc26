"""From finished groups to the user's results: RequestOutput / BeamSearchOutput with their text
(the stop rules, one implementation for samples and beams) and vLLM's Logprob objects."""

from __future__ import annotations

from typing import Any

from batchgen.engine.beam import IMPOSSIBLE, BeamHypothesis
from batchgen.engine.policy import BeamPolicy
from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.outputs import (
    BeamSearchOutput,
    BeamSequence,
    CompletionOutput,
    FlatLogprobs,
    Logprob,
    RequestOutput,
    TokenLogprobs,
)
from batchgen.sampling.sampler import RankedLogprobs
from batchgen.sampling.stop import StopFactory


class ResultBuilder:
    """Turns a finished group into its output. Token texts of logprobs are decoded here, once
    per distinct id of a request."""

    def __init__(self, tokenizer: Any | None, stops: StopFactory) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        # batchgen reports a sample's cumulative logprob always; vLLM (vllm_compat) only
        # when the request asked for logprobs (None otherwise)
        self.cumulative_without_logprobs = True

    def request_output(self, group: SequenceGroup) -> RequestOutput:
        """The finished group's samples: text decoded once (or a stop-string checker's), the
        Logprob objects built now from the steps' top-logprob records."""
        decode = self._decoder(group.params.detokenize)
        flat = group.params.flat_logprobs
        outs = [CompletionOutput(
            index=s.index, text=self._text(s), token_ids=s.output_token_ids,
            cumulative_logprob=(s.cumulative_logprob if s.logprobs is not None
                                or self.cumulative_without_logprobs else None),
            logprobs=None if s.logprobs is None else _positions(
                [top.entry(j) for top, j in s.logprobs], decode, flat),
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in group.seqs]
        prompt_lps = None
        if group.prompt_logprobs is not None:
            prompt_lps = _positions(group.prompt_logprobs, decode, flat)
        return RequestOutput(request_id=str(group.index), prompt=group.prompt,
                             prompt_token_ids=group.prompt_token_ids, outputs=outs,
                             num_cached_tokens=group.num_cached_tokens or 0,
                             prompt_logprobs=prompt_lps, metrics=group.metrics,
                             prompt_token_id_logprobs=group.prompt_token_id_logprobs)

    def _text(self, seq: Sequence) -> str:
        """A sample's output text: its checker's (stop strings cut it), else one decode."""
        if seq.stop is not None:
            return seq.stop.final_text(seq.output_token_ids)
        g = seq.group
        return self.stops.output_text(g.params, g.prompt_token_ids, seq.output_token_ids,
                                      seq.stop_token)

    def beam_output(self, group: SequenceGroup) -> BeamSearchOutput:
        policy = group.policy
        assert isinstance(policy, BeamPolicy)
        decode = self._decoder(True)
        seqs = [BeamSequence(
            token_ids=h.token_ids,
            text=self._beam_text(group, h.token_ids, h.finish_reason),
            cumulative_logprob=h.sum_logprobs, score=h.score, finish_reason=h.finish_reason,
            logprobs=[_logprobs(lp.entry(t), decode) for t, lp in zip(h.token_ids,
                                                                      h.token_logprobs)],
            prompt_token_ids=group.prompt_token_ids)
            for h in policy.state.finalize() if _grammar_accepts(group, h)]
        return BeamSearchOutput(prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                                sequences=seqs,
                                trace=None if policy.trace is None else policy.trace.trace,
                                num_logprobs=group.params.logprobs)

    def _beam_text(self, group: SequenceGroup, token_ids: list[int], reason: str) -> str:
        """A hypothesis's text: replayed through a checker with stop strings, else decoded
        once (a final EOS / stop id dropped)."""
        p, prompt = group.params, group.prompt_token_ids
        if p.stop_strings:
            return self.stops.text(p, prompt, token_ids)
        return self.stops.output_text(p, prompt, token_ids, reason == "stop")

    def _decoder(self, detokenize: bool):
        """token id -> its text (memoised for one output), or None without text."""
        if self.tokenizer is None or not detokenize:
            return lambda token: None
        memo: dict[int, str] = {}

        def decode(token: int) -> str:
            if token not in memo:
                memo[token] = self.tokenizer.decode([token])
            return memo[token]
        return decode


def _grammar_accepts(group: SequenceGroup, h: BeamHypothesis) -> bool:
    """Whether a hypothesis keeps to the group's constraint (always, without one). When
    fewer valid hypotheses exist than beams, HF's buffer returns some with an impossible score
    (its -1e9 penalty in the sum); under a grammar those are dropped, with any whose tokens
    the grammar rejects, so every returned beam is a real one that satisfies it."""
    if group.constraint is None:
        return True
    c = group.constraint.fork()
    return h.sum_logprobs > IMPOSSIBLE / 2 and all(c.accept(t) for t in h.token_ids)


def _logprobs(entry: RankedLogprobs, decode) -> TokenLogprobs:
    return {t: Logprob(lp, rank, decode(t)) for t, (lp, rank) in entry.items()}


def _positions(entries: list[RankedLogprobs | None], decode, flat: bool
               ) -> list[TokenLogprobs | None] | FlatLogprobs:
    """Positions' logprobs as vLLM returns them: a list of {token: Logprob} (None where a
    position has none), or with `flat` one FlatLogprobs of them all."""
    if not flat:
        return [None if e is None else _logprobs(e, decode) for e in entries]
    out = FlatLogprobs()
    for e in entries:
        out.add((t, lp, rank, decode(t)) for t, (lp, rank) in (e or {}).items())
    return out

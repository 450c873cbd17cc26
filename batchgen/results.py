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
from batchgen.token_texts import MAX_CONTEXT, TokenTexts


class ResultBuilder:
    """Turns a finished group into its output. Token texts of logprobs are decoded here, once
    per distinct id of a request."""

    def __init__(self, tokenizer: Any | None, stops: StopFactory) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.texts = TokenTexts(tokenizer) if tokenizer is not None else None
        # batchgen reports a sample's cumulative logprob always; vLLM (vllm_compat) only
        # when the request asked for logprobs (None otherwise)
        self.cumulative_without_logprobs = True

    def request_output(self, group: SequenceGroup) -> RequestOutput:
        """The finished group's samples: text decoded once (or a stop-string checker's), the
        Logprob objects built now from the steps' top-logprob records."""
        side = group.text_side  # its adapter's own tokenizer, else None: the LLM's
        stops = self.stops if side is None else side.stops
        texts = (self.texts if side is None else side.texts) if group.params.detokenize else None
        flat = group.params.flat_logprobs
        outs = [CompletionOutput(
            index=s.index, text=self._text(s, stops), token_ids=s.output_token_ids,
            cumulative_logprob=(s.cumulative_logprob if s.logprobs is not None
                                or self.cumulative_without_logprobs else None),
            logprobs=None if s.logprobs is None else _positions(
                [top.entry(j) for top, j in s.logprobs], s.output_token_ids, texts, flat),
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in group.seqs]
        prompt_lps = None
        if group.prompt_logprobs is not None:
            prompt_lps = _positions(group.prompt_logprobs, group.prompt_token_ids, texts, flat)
        return RequestOutput(request_id=str(group.index), prompt=group.prompt,
                             prompt_token_ids=group.prompt_token_ids, outputs=outs,
                             num_cached_tokens=group.num_cached_tokens or 0,
                             prompt_logprobs=prompt_lps, metrics=group.metrics,
                             prompt_token_id_logprobs=group.prompt_token_id_logprobs)

    def _text(self, seq: Sequence, stops: StopFactory) -> str:
        """A sample's output text: its checker's (stop strings cut it), else one decode."""
        if seq.stop is not None:
            return seq.stop.final_text(seq.output_token_ids)
        g = seq.group
        return stops.output_text(g.params, g.prompt_token_ids, seq.output_token_ids,
                                 seq.stop_token)

    def beam_output(self, group: SequenceGroup) -> BeamSearchOutput:
        policy = group.policy
        assert isinstance(policy, BeamPolicy)
        side = group.text_side  # its adapter's own tokenizer, else None: the LLM's
        texts = self.texts if side is None else side.texts
        seqs = [BeamSequence(
            token_ids=h.token_ids,
            text=self._beam_text(group, h.token_ids, h.finish_reason),
            cumulative_logprob=h.sum_logprobs, score=h.score, finish_reason=h.finish_reason,
            logprobs=_positions([lp.entry(t) for t, lp in zip(h.token_ids, h.token_logprobs)],
                                h.token_ids, texts, False),
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
        stops = self.stops if group.text_side is None else group.text_side.stops
        if p.stop_strings:
            return stops.text(p, prompt, token_ids)
        return stops.output_text(p, prompt, token_ids, reason == "stop")


def _grammar_accepts(group: SequenceGroup, h: BeamHypothesis) -> bool:
    """Whether a hypothesis keeps to the group's constraint (always, without one). When
    fewer valid hypotheses exist than beams, HF's buffer returns some with an impossible score
    (its -1e9 penalty in the sum); under a grammar those are dropped, with any whose tokens
    the grammar rejects, so every returned beam is a real one that satisfies it."""
    if group.constraint is None:
        return True
    c = group.constraint.fork()
    return h.sum_logprobs > IMPOSSIBLE / 2 and all(c.accept(t) for t in h.token_ids)


def _positions(entries: list[RankedLogprobs | None], chosen: list[int],
               texts: TokenTexts | None, flat: bool) -> list[TokenLogprobs | None] | FlatLogprobs:
    """Positions' logprobs as vLLM returns them: a list of {token: Logprob} (None where a
    position has none), or with `flat` one FlatLogprobs of them all. `chosen[i]`: the token
    at position i, whose predecessors (from the first scored position) give a token its text
    (texts None: no text)."""
    first = next((i for i, e in enumerate(entries) if e is not None), 0)
    out: list[TokenLogprobs | None] | FlatLogprobs = FlatLogprobs() if flat else []
    for i, e in enumerate(entries):
        context = chosen[max(first, i - MAX_CONTEXT):i]
        rows = [(t, lp, rank, None if texts is None else texts.text(t, context))
                for t, (lp, rank) in (e or {}).items()]
        if flat:
            out.add(rows)
        else:
            out.append(None if e is None else {t: Logprob(lp, r, s) for t, lp, r, s in rows})
    return out

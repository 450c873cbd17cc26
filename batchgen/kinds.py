"""Request kinds: what differs between n samples (SamplingParams) and beam search
(BeamSearchParams) inside the engine, in one object each, so the rest of batchgen asks the kind
instead of testing which params it holds: the groups and sequences a request becomes, its batch
columns and its output. How dataset and Ray jobs seed, run and write each kind is
`batchgen.data.jobs`."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np

from batchgen.checks import ValidationError
from batchgen.engine.beam import BeamSearchState
from batchgen.engine.beam_controls import BeamControls
from batchgen.engine.beam_trace import TraceRecorder
from batchgen.engine.group_beam import GroupBeamSearchState
from batchgen.engine.policy import BeamPolicy, SamplePolicy
from batchgen.engine.sequence import RowSpec, Sequence, SequenceGroup
from batchgen.outputs import BeamSearchOutput, RequestOutput
from batchgen.params import BeamSearchParams, ControlSpec, SamplingParams, StructuredOutputsParams
from batchgen.sampling.grammar import Constraint
from batchgen.sampling.named_logprobs import NAMED_LOGPROBS
from batchgen.sampling.sampler import NO_LOGPROBS, NUM_PARAMS, PARAM_NAMES
from batchgen.sampling.stop import StopFactory


class Builder(Protocol):
    """What a kind needs of the request builder (requests.RequestBuilder) to make a group."""

    stops: StopFactory
    eos_token_ids: list[int]
    pad_token_id: int

    @property
    def vocab_size(self) -> int: ...

    def seed_of(self, seed: int | None, index: int) -> int: ...

    def bad_word_ids(self, words: list[str]) -> list[list[int]]: ...

    def constraint(self, so: StructuredOutputsParams) -> Constraint: ...


class Results(Protocol):
    """What a kind needs of the result builder (results.ResultBuilder)."""

    def request_output(self, group: SequenceGroup) -> RequestOutput: ...

    def beam_output(self, group: SequenceGroup) -> BeamSearchOutput: ...


class Samples:
    """n independent samples of each prompt (`LLM.generate`)."""

    name = "samples"
    params_type = SamplingParams
    params_arg = "sampling_params"  # the argument's name in messages
    width_arg = "n"

    def check(self, params: SamplingParams, step_tokens: int) -> None:
        """Limits beyond the params' own checks: best_of (vLLM V0's) asking for more samples
        than n is refused, as vLLM V1 refuses it (samples decode independently: no limit)."""
        b = params.best_of
        if b is not None and b != params.n:
            raise ValidationError(
                f"best_of must be None or n ({params.n}), got {b!r}: best_of is not supported "
                "(vLLM V1 does not support it either); ask for n=best_of samples and keep the "
                "n with the highest cumulative_logprob", parameter="best_of", value=b)

    def group(self, b: Builder, index: int, text: str | None, ids: list[int],
              p: SamplingParams, max_tokens: int) -> SequenceGroup:
        """The request's group: n sequences sharing the prompt, each with its own seed (and,
        with stop strings, its own checker)."""
        group = SequenceGroup(index, text, ids, p, max_tokens, SamplePolicy())
        if p.bad_words:
            group.bad_word_ids = b.bad_word_ids(p.bad_words)
        group.spec = sample_spec(p, max_tokens, bool(group.bad_word_ids))
        group.seqs = [
            Sequence(group, k, list(ids), b.stops(p, ids, max_tokens) if p.stop_strings else None,
                     b.seed_of(p.seed, k), logprobs=[] if p.num_logprobs is not None else None)
            for k in range(p.n)]
        _constrain(b, group)
        return group

    def output(self, results: Results, group: SequenceGroup) -> RequestOutput:
        return results.request_output(group)


class Beams:
    """Beam search with HF's selection (`LLM.beam_search`)."""

    name = "beams"
    params_type = BeamSearchParams
    params_arg = "params"
    width_arg = "beam_width"

    def check(self, params: BeamSearchParams, step_tokens: int) -> None:
        """All beams of a group decode in one forward: their tokens must fit a step's
        (max_num_batched_tokens sizes the forward's buffers). Wider than max_num_seqs is
        fine: such a group decodes in a step of its own (engine/scheduler.py)."""
        if params.beam_width > step_tokens:
            raise ValueError(f"beam_width must be <= max_num_batched_tokens ({step_tokens}): "
                             f"all beams decode in one forward, got {params.beam_width!r}")

    def group(self, b: Builder, index: int, text: str | None, ids: list[int],
              p: BeamSearchParams, max_tokens: int) -> SequenceGroup:
        """The request's group: one leader that the beam state forks as beams appear."""
        trace = TraceRecorder() if p.return_trace else None
        group = SequenceGroup(index, text, ids, p, max_tokens, BeamPolicy(
                                  beam_state(b, p, ids, max_tokens), trace),
                              RowSpec(max_tokens=max_tokens, beam=True,
                                      constrained=p.structured_outputs is not None))
        stop = b.stops(p, ids, max_tokens) if p.stop_strings else None
        group.seqs = [Sequence(group, 0, list(ids), stop)]
        _constrain(b, group)
        return group

    def output(self, results: Results, group: SequenceGroup) -> BeamSearchOutput:
        return results.beam_output(group)


RequestKind = Samples | Beams
SAMPLES, BEAMS = Samples(), Beams()


def kind_of(params: object, name: str = "params") -> RequestKind:
    """The kind of a params object (ValueError naming `name` for anything else)."""
    for kind in (SAMPLES, BEAMS):
        if isinstance(params, kind.params_type):
            return kind
    raise ValueError(f"{name} must be a SamplingParams or a BeamSearchParams, got "
                     f"{type(params).__name__}")


def sample_spec(p: SamplingParams, max_tokens: int, bad_words: bool) -> RowSpec:
    """A sampling request's batch columns: its parameters in sampler.PARAM_NAMES order (top-p
    as HF's threshold 1 - top_p, computed in float64), the stages it needs, its limits (and
    its trace, replayed token by token)."""
    values = {"temperature": p.temperature, "top_k": p.top_k,
              "top_p_cut": 1.0 - p.top_p if p.top_p < 1.0 else -1.0, "min_p": p.min_p,
              "repetition_penalty": p.repetition_penalty,
              "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty}
    params = np.array([values[k] for k in PARAM_NAMES], np.float32)
    assert params.shape == (NUM_PARAMS,)
    traced = bool(p.trace_decode_token_ids)  # vLLM's trace replay: no min_tokens, no EOS stop
    return RowSpec(
        params=params, greedy=p.greedy,
        penalized=p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0,
        controls=bool(p.allowed_token_ids or p.logit_bias or p.logits_processors or bad_words),
        stop_strings=bool(p.stop_strings), max_tokens=max_tokens,
        min_tokens=0 if traced else p.min_tokens, ignore_eos=traced or p.ignore_eos,
        logprobs=_logprobs_column(p), logprob_ids=tuple(p.logprob_token_ids or ()),
        stop_ids=tuple(p.stop_ids), constrained=p.structured_outputs is not None,
        trace=np.array(p.trace_decode_token_ids, np.int64) if traced else None)


def _logprobs_column(p: SamplingParams) -> int:
    """The batch's logprobs column of a request: NO_LOGPROBS, its top-k (-1: all), or
    NAMED_LOGPROBS when it names the token ids (vLLM's logprob_token_ids)."""
    if p.logprob_token_ids:
        return NAMED_LOGPROBS
    return NO_LOGPROBS if p.logprobs is None else p.logprobs


def beam_state(b: Builder, p: BeamSearchParams, ids: list[int], max_tokens: int
               ) -> BeamSearchState | GroupBeamSearchState:
    """A beam request's selection state: HF beam search, or HF 4.x group beam search with
    num_beam_groups > 1; either with HF's processors when the params set any."""
    # a grammar's end is its EOS: it ends a constrained beam even under ignore_eos
    eos = b.eos_token_ids if not p.ignore_eos or p.structured_outputs else []
    stop_ids = list(dict.fromkeys([*eos, *p.stop_ids]))
    spec = beam_controls(b, p)

    def controls(rows: int) -> BeamControls | None:
        return BeamControls(spec, ids, rows, max_tokens, stop_ids) if spec.active else None

    if p.num_beam_groups > 1:
        return GroupBeamSearchState(
            p.beam_width, p.num_beam_groups, float(p.diversity_penalty), max_tokens,
            p.length_penalty, p.early_stopping, stop_ids, p.num_return_sequences,
            b.pad_token_id, controls)
    return BeamSearchState(
        p.beam_width, max_tokens, p.length_penalty,
        True if p.beam_width == 1 else p.early_stopping,  # HF num_beams=1: greedy
        eos_token_ids=eos, num_return_sequences=p.num_return_sequences,
        vocab_size=b.vocab_size, stop_token_ids=p.stop_ids, controls=controls(p.beam_width),
        top_logprobs=p.logprobs)


def beam_controls(b: Builder, p: BeamSearchParams) -> ControlSpec:
    """The params' processors with bad_words tokenized (vLLM's rule, as for samples) and
    every banned id checked against the vocabulary."""
    words = [*(b.bad_word_ids(p.bad_words) if p.bad_words else []), *(p.bad_words_ids or [])]
    bad = [t for w in words for t in w if t >= b.vocab_size]
    if bad:
        raise ValueError(f"bad_words_ids has token id {max(bad)} outside the model's "
                         f"vocabulary [0, {b.vocab_size})")
    return replace(p.controls, bad_words_ids=tuple(tuple(w) for w in words if w))


def _constrain(b: Builder, group: SequenceGroup) -> None:
    """Under structured outputs, each sequence gets a fork of the prompt's matcher."""
    so = group.params.structured_outputs
    if so is None:
        return
    group.constraint = b.constraint(so)
    for seq in group.seqs:
        seq.constraint = group.constraint.fork()

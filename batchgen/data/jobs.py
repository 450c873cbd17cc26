"""What a dataset or Ray job does differently for n samples and for beams, one object each:
which params it refuses, how it seeds a row, how it runs the rows through an LLM, and the
plain records a row's `outputs` column holds. (The engine's side of a kind is batchgen.kinds.)"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from batchgen.checks import check
from batchgen.kinds import BEAMS, SAMPLES, kind_of
from batchgen.outputs import BeamSearchOutput, CompletionOutput, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from batchgen.llm import LLM


class SampleJobs:
    """n samples per row (`LLM.generate`)."""

    name = SAMPLES.name

    def check_job(self, params: SamplingParams) -> None:
        """What a dataset job cannot write (nothing: every sample field has a column)."""

    def keeps_logprobs(self, params: SamplingParams) -> bool:
        """Whether a dataset row's outputs carry per-token logprobs."""
        return params.logprobs is not None

    def job_seed(self, params: SamplingParams, seed: int | None) -> int:
        """A dataset job's seed: params.seed, else `seed`, else 0 (never random: a resume, or
        another machine, must redo the same draws)."""
        if params.seed is not None:
            return params.seed
        return 0 if seed is None else int(seed)

    def row_params(self, params: SamplingParams, row_seed: int) -> SamplingParams:
        """A dataset row's params: seeded from the row (its samples then do not depend on
        which rows ran beside it)."""
        return replace(params, seed=row_seed)

    def stream(self, llm: LLM, prompts: Any, params: Any, lora_request: Any = None
               ) -> Iterator[tuple[int, Any]]:
        return llm.generate_stream(prompts, params, use_tqdm=False, **_lora(lora_request))

    def run(self, llm: LLM, prompts: Any, params: Any, lora_request: Any = None) -> list[Any]:
        return llm.generate(prompts, params, use_tqdm=False, **_lora(lora_request))

    def records(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The completions as plain dicts (a dataset row's `outputs`)."""
        return [_completion(c) for c in out.outputs]


class BeamJobs:
    """Beam hypotheses per row (`LLM.beam_search`)."""

    name = BEAMS.name

    def check_job(self, params: BeamSearchParams) -> None:
        """A dataset job writes hypotheses, one list per row: the per-step trace is
        LLM.beam_search's (it has no column)."""
        check(not params.return_trace, "params.return_trace",
              "False in a dataset job (use LLM.beam_search for the trace)", True)

    def keeps_logprobs(self, params: BeamSearchParams) -> bool:
        """Beams' outputs carry logprobs in a dataset only when top-k was asked."""
        return params.logprobs > 0

    def job_seed(self, params: BeamSearchParams, seed: int | None) -> int:
        return 0 if seed is None else int(seed)

    def row_params(self, params: BeamSearchParams, row_seed: int) -> BeamSearchParams:
        return params  # beams draw nothing

    def stream(self, llm: LLM, prompts: Any, params: Any, lora_request: Any = None
               ) -> Iterator[tuple[int, Any]]:
        return llm.beam_search_stream(prompts, params, use_tqdm=False, **_lora(lora_request))

    def run(self, llm: LLM, prompts: Any, params: Any, lora_request: Any = None) -> list[Any]:
        return llm.beam_search(prompts, params, use_tqdm=False, **_lora(lora_request))

    def records(self, out: BeamSearchOutput) -> list[dict[str, Any]]:
        recs = [{"text": s.text, "token_ids": s.token_ids,
                 "cumulative_logprob": s.cumulative_logprob, "score": s.score,
                 "finish_reason": s.finish_reason} for s in out.sequences]
        if out.num_logprobs:
            for r, s in zip(recs, out.sequences):
                r["logprobs"] = _logprob_records(s.logprobs)
        return recs


JobKind = SampleJobs | BeamJobs
_JOBS: dict[str, JobKind] = {SAMPLES.name: SampleJobs(), BEAMS.name: BeamJobs()}


def job_kind(params: object, name: str = "params") -> JobKind:
    """The job side of a params object's kind (ValueError naming `name` for anything else)."""
    return _JOBS[kind_of(params, name).name]


def _lora(lora_request: Any) -> dict[str, Any]:
    """`lora_request` as a keyword argument (none without an adapter column)."""
    return {} if lora_request is None else {"lora_request": lora_request}


def _logprob_records(logprobs: list[Any]) -> list[list[dict[str, Any]]]:
    """Per-token {token_id: Logprob} dicts as plain records (a dataset row's `logprobs`)."""
    return [[{"token_id": t, "logprob": v.logprob, "rank": v.rank,
              "decoded_token": v.decoded_token} for t, v in e.items()] for e in logprobs]


def _completion(c: CompletionOutput) -> dict[str, Any]:
    d = {"index": c.index, "text": c.text, "token_ids": c.token_ids,
         "cumulative_logprob": c.cumulative_logprob, "finish_reason": c.finish_reason,
         "stop_reason": None if c.stop_reason is None else str(c.stop_reason)}
    if c.logprobs is not None:
        d["logprobs"] = _logprob_records(c.logprobs)
    return d

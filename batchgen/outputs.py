"""Results returned to the user; names and fields follow vLLM so code ports with one import."""

from __future__ import annotations

import time
from collections.abc import Iterable, MutableSequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Logprob:
    """One token's log-probability (raw: before sampling processors), its rank in the
    distribution (1 = most likely) and its text as vLLM gives it (token_texts.py: a split
    character completed by the tokens chosen before it, a word's leading space kept; None
    when detokenize=False)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]  # a position's chosen token and its top-k alternatives


@dataclass
class FlatLogprobs(MutableSequence):
    """vLLM's flat logprobs (`SamplingParams(flat_logprobs=True)`): every position's
    entries in six flat lists, so a request's logprobs are a handful of objects however
    long it runs, not a dict and Logprob objects per position. Read it as the list it
    stands for: `flat[i]` is position i's {token: Logprob} (`{}` for a position without),
    slices are FlatLogprobs, iteration yields the dicts; it is built once, not edited."""

    start_indices: list[int] = field(default_factory=list)  # position i's entries are
    end_indices: list[int] = field(default_factory=list)  # [start_indices[i], end_indices[i])
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, position: TokenLogprobs | None) -> None:
        """Add the next position's entries (None: a position without logprobs)."""
        self.add((t, lp.logprob, lp.rank, lp.decoded_token)
                 for t, lp in (position or {}).items())

    def add(self, entries: Iterable[tuple[int, float, int | None, str | None]]) -> None:
        """Add the next position from (token, logprob, rank, decoded token) entries, making
        no Logprob objects."""
        self.start_indices.append(len(self.token_ids))
        for token, logprob, rank, text in entries:
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.ranks.append(rank)
            self.decoded_tokens.append(text)
        self.end_indices.append(len(self.token_ids))

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            part = FlatLogprobs()
            for i in range(*index.indices(len(self))):
                part.append(self[i])
            return part
        at = range(self.start_indices[index], self.end_indices[index])
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i],
                                           self.decoded_tokens[i]) for i in at}

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("FlatLogprobs is built once: its positions cannot be set")

    def __delitem__(self, index: Any) -> None:
        raise TypeError("FlatLogprobs is built once: its positions cannot be deleted")

    def insert(self, index: int, value: Any) -> None:
        raise TypeError("FlatLogprobs grows by append only")


# vLLM's names of the two containers' types (a sample's per token, a prompt's per position)
SampleLogprobs = FlatLogprobs | list[TokenLogprobs]
PromptLogprobs = FlatLogprobs | list[TokenLogprobs | None]


@dataclass
class CompletionOutput:
    """One generated sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | FlatLogprobs | None  # flat with flat_logprobs=True
    finish_reason: str | None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """vLLM's per-request stats (`RequestOutput.metrics`, only with
    `LLM(disable_log_stats=False)`): `arrival_time` is wall-clock (time.time); the `*_ts`
    fields are time.monotonic() readings (queued, first admitted, first and last generated
    token), as vLLM's engine-core timestamps are; latencies are seconds."""

    arrival_time: float = field(default_factory=time.time)
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0  # arrival to first generated token
    num_generation_tokens: int = 0  # over all of the request's samples
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    _arrival_ts: float = field(default_factory=time.monotonic, repr=False)

    def queued(self) -> None:
        """It entered the waiting queue (the first time)."""
        self.queued_ts = self.queued_ts or time.monotonic()

    def scheduled(self, when: float) -> None:
        """It was admitted (the first time) in the step planned at monotonic time `when` (not
        before it was queued: the first step's plan pulls the requests it admits)."""
        self.scheduled_ts = self.scheduled_ts or max(when, self.queued_ts)

    def first_token(self, now: float) -> None:
        """Its first generated token was applied at monotonic time `now`."""
        if not self.first_token_ts:
            self.first_token_ts = now
            self.first_token_latency = now - self._arrival_ts

    @property
    def e2e_latency(self) -> float:
        """Arrival to the last token, seconds (0 until it finished)."""
        return self.last_token_ts - self._arrival_ts if self.last_token_ts else 0.0

    @property
    def queued_time(self) -> float:
        """Seconds between entering the queue and the first admission."""
        return max(self.scheduled_ts - self.queued_ts, 0.0) if self.scheduled_ts else 0.0


@dataclass
class RequestOutput:
    """All samples of one prompt, in the order the prompts were given. `prompt_logprobs[0]` is
    None (the first token has no context); `num_cached_tokens` came from the prefix cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | FlatLogprobs | None = None
    metrics: RequestMetrics | None = None  # with LLM(disable_log_stats=False) only
    # vLLM's: with prompt_logprob_token_ids, float32 [rows, ids]: row i scores the ids named
    # for prompt position prompt_logprob_start + i + 1 (-inf at a -1 pad)
    prompt_token_id_logprobs: np.ndarray | None = None


@dataclass
class BeamSequence:
    """One finished beam hypothesis. `logprobs` holds, per generated token, its own logprob
    and rank and, with `BeamSearchParams(logprobs=k)`, its parent beam's top-k alternatives
    at that step (the distribution the beam step ranked: after the beam's processors)."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def tokens(self) -> list[int]:
        """vLLM's field: the prompt's ids followed by the generated ones."""
        return self.prompt_token_ids + self.token_ids

    @property
    def cum_logprob(self) -> float:
        """vLLM's name for `cumulative_logprob`."""
        return self.cumulative_logprob


@dataclass
class BeamTrace:
    """How one request's beams evolved, as plain records (see :meth:`to_records`); recorded
    by the engine (engine/beam_trace.py) with ``BeamSearchParams(return_trace=True)``.

    ``live``: per step (0 = the first generated token) one record per running beam after the
    step: ``beam`` (its slot), ``parent`` (the slot it continued at the previous step),
    ``token``, ``cumulative_logprob`` (HF's running beam score) and ``blocks``, the physical KV
    block ids of its block table once its new token's K/V is written (read at the next step,
    after any copy-on-write: beams sharing a prefix show the same ids for the shared blocks).
    ``finished``: per step, the finished buffer's filled slots: ``slot``, ``score`` (HF's
    length-penalised ``sequences_scores``), ``cumulative_logprob``, ``num_tokens``,
    ``finish_reason``.
    """

    live: list[dict[str, Any]] = field(default_factory=list)
    finished: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        """Beam steps recorded so far."""
        return 1 + max((r["step"] for r in (*self.live, *self.finished)), default=-1)

    def to_records(self) -> list[dict[str, Any]]:
        """Live and finished records in one list (``kind`` tells them apart; the other
        kind's columns are None), ordered by step: ``pandas.DataFrame(trace.to_records())``."""
        cols = ("step", "kind", "beam", "parent", "token", "cumulative_logprob", "score",
                "num_tokens", "finish_reason", "blocks")
        rows = [{**dict.fromkeys(cols), **r, "kind": "live"} for r in self.live]
        rows += [{**dict.fromkeys(cols), **{k: v for k, v in r.items() if k != "slot"},
                  "beam": r["slot"], "kind": "finished"} for r in self.finished]
        rows.sort(key=lambda r: (r["step"], r["kind"] != "live", r["beam"]))
        return rows

    def to_pandas(self) -> Any:
        """The records as a pandas DataFrame (pandas is optional: imported only here)."""
        import pandas as pd

        return pd.DataFrame(self.to_records())


@dataclass
class BeamSearchOutput:
    """Beam hypotheses of one prompt, best first; `trace` with `return_trace=True`."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)
    trace: BeamTrace | None = None
    num_logprobs: int = 0  # the params' logprobs: top-k alternatives each token carries


@dataclass(frozen=True)
class KVStats:
    """KV figures of the last `generate` / `beam_search` call."""

    num_blocks: int
    block_size: int
    peak_blocks_in_use: int
    cow_copies: int
    preemptions: int
    prefix_hit_tokens: int
    prompt_tokens_computed: int = 0  # prompt positions the model ran (after hits, with recomputes)
    num_host_blocks: int = 0  # the swap pool (swap_space)
    swap_outs: int = 0  # preemptions that swapped a group out (the rest recomputed)
    swap_ins: int = 0  # groups swapped back in
    blocks_swapped_out: int = 0  # distinct blocks copied to the host pool
    blocks_swapped_in: int = 0  # and back
    state_bytes_per_seq: int = 0  # models with state mixers: each sequence's state (any length)
    peak_state_slots: int = 0  # most state slots held at once (sequences, prefix snapshots)
    lora_loads: int = 0  # LoRA adapters loaded into a device slot (max_loras; batchgen/lora)
    spec_drafts: int = 0  # speculative decoding (batchgen/speculative): rows that drafted
    spec_draft_tokens: int = 0  # tokens drafted
    spec_accepted_tokens: int = 0  # drafted tokens the target model's draws confirmed

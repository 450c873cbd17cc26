"""User-facing request parameters, validated up front so bad input fails before any work starts."""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from batchgen.checks import check, check_flag, check_seed, is_int, is_number
from batchgen.id_table import as_id_table
from batchgen.param_bounds import check_model_bounds

# vLLM's per-request logits processors: (output_token_ids, logits) -> logits, or
# (prompt_token_ids, output_token_ids, logits) -> logits; logits is the row's float32 [V].
LogitsProcessor = Callable[..., Any]

logger = logging.getLogger("batchgen")

# Temperatures below GREEDY_TEMPERATURE (vLLM's _SAMPLING_EPS, its greedy threshold) mean greedy:
# they become 0. Those in [GREEDY_TEMPERATURE, MIN_TEMPERATURE) are raised to MIN_TEMPERATURE
# (vLLM's _MAX_TEMP): below it logits / temperature can overflow float32 (1e-40 gives NaN
# probabilities). vLLM raises every temperature in (0, 0.01) to 0.01, so a near-zero one samples
# at 0.01 there; here one under 1e-5 is taken at its word, as greedy.
GREEDY_TEMPERATURE = 1e-5
MIN_TEMPERATURE = 0.01
# Most top-k alternatives a beam records per token (vLLM's default max_logprobs).
MAX_BEAM_LOGPROBS = 20
# Most token ids SamplingParams.logprob_token_ids may name (vLLM's MAX_LOGPROB_TOKEN_IDS).
MAX_LOGPROB_TOKEN_IDS = 128


class RequestOutputKind(enum.IntEnum):
    """vLLM's `SamplingParams.output_kind`. batchgen's offline calls return each request once,
    finished: CUMULATIVE and FINAL_ONLY both mean that; DELTA (streamed pieces) is refused."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# vLLM SamplingParams fields batchgen does not implement: the values that mean "off" (vLLM's
# default first), anything else a ValueError naming the field.
_OFF_ONLY: dict[str, tuple[object, ...]] = {
    "watermarking": (None, False),
    "spaces_between_special_tokens": (True,),
    "output_text_buffer_length": (0,),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "routed_experts_prompt_start": (0,),
}


def _check_off(obj: object, table: dict[str, tuple[object, ...]], owner: str) -> None:
    """Each vLLM-only field at a value that asks for nothing batchgen lacks."""
    for name, allowed in table.items():
        v = getattr(obj, name)
        if not any(v is a or (type(v) is type(a) and v == a) for a in allowed):
            check(False, name, " or ".join(map(repr, allowed)) + f" (batchgen's {owner} does "
                  f"not implement vLLM's {name})", v)


def _as_str_list(value: str | list[str] | None, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    check(isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value),
          name, "a non-empty string or a list of non-empty strings", value)
    return list(value)


def _same_value(a: object, b: object) -> bool:
    """Equal field values; arrays (prompt_logprob_token_ids' tables) by shape and ids."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return bool(a == b)


def _logprob_ids(ids: object, logprobs: int | None) -> list[int] | None:
    """vLLM's logprob_token_ids: None or up to MAX_LOGPROB_TOKEN_IDS token ids (each token's
    logprobs name exactly these, beside its own); with `logprobs` set too, as many as it
    says. An empty list names none (None). Ids past the vocabulary are refused at
    generate, where it is known."""
    if ids is None:
        return None
    check(isinstance(ids, (list, tuple)) and all(is_int(t) for t in ids), "logprob_token_ids",
          "None or a list of token ids", ids)
    bad = [t for t in ids if t < 0]
    check(not bad, "logprob_token_ids", "token ids >= 0 (token_id(s) "
          f"{bad} in logprob_token_ids contain out-of-vocab token ids)", ids)
    check(len(ids) <= MAX_LOGPROB_TOKEN_IDS, "logprob_token_ids",
          f"at most {MAX_LOGPROB_TOKEN_IDS} token ids (vLLM's bound)", len(ids))
    check(logprobs is None or logprobs == len(ids), "logprob_token_ids",
          f"as long as logprobs={logprobs} when both are set (logprobs must equal "
          "len(logprob_token_ids))", len(ids))
    return [int(t) for t in ids] or None


def _as_id_list(value: list[int] | None, name: str) -> list[int]:
    if value is None:
        return []
    check(isinstance(value, (list, tuple, set)) and all(is_int(t) and t >= 0 for t in value),
          name, "a list of non-negative token ids", value)
    return list(value)


class _Stops:
    """Validated stop strings and stop ids, shared by both parameter classes."""

    _stop_strs: list[str]
    _stop_ids: list[int]

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_strs

    @property
    def stop_ids(self) -> list[int]:
        return self._stop_ids


# Whitespace characters a JSON constraint allows between two JSON tokens unless told otherwise:
# enough for pretty-printed JSON a few levels deep, few enough that a small model cannot spin in
# whitespace forever (xgrammar's default, like vLLM's, is unbounded).
DEFAULT_MAX_WHITESPACE = 16
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names): a JSON schema, a regex, a choice of
    strings, an EBNF grammar or any JSON object; exactly one. Compiled with xgrammar (the
    `batchgen[structured]` extra) when the request is built."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE

    def __post_init__(self) -> None:
        given = [n for n in _CONSTRAINTS if getattr(self, n) not in (None, False)]
        check(len(given) == 1, "structured_outputs",
              f"given exactly one of {', '.join(_CONSTRAINTS)}",
              ", ".join(given) if given else "none")
        self._check_spec()
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            check_flag(getattr(self, name), f"structured_outputs.{name}")
        check(self.whitespace_pattern is None, "structured_outputs.whitespace_pattern",
              "None: xgrammar takes no whitespace regex (use disable_any_whitespace=True "
              "or max_whitespace=N)", self.whitespace_pattern)
        m = self.max_whitespace
        check(m is None or (is_int(m) and m >= 0), "structured_outputs.max_whitespace",
              "None (unbounded) or an integer >= 0", m)

    def _check_spec(self) -> None:
        """The constraint's own form (its compilation, at request time, checks the rest)."""
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema (a dict "
                                     f"or its JSON text), got text that is not JSON: {e}") from e
            check(isinstance(schema, (dict, bool)), "structured_outputs.json",
                  "a JSON schema (a dict or its JSON text)", type(schema).__name__)
            try:
                json.dumps(schema)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json must be JSON-serialisable: {e}"
                                 ) from e
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, str) and bool(v)), f"structured_outputs.{name}",
                  "a non-empty string", v)
        c = self.choice
        check(c is None or (isinstance(c, (list, tuple)) and bool(c)
                            and all(isinstance(s, str) and s for s in c)),
              "structured_outputs.choice", "a non-empty list of non-empty strings", c)
        check(self.json_object in (None, True, False), "structured_outputs.json_object",
              "True or None", self.json_object)

    @property
    def kind(self) -> str:
        """Which constraint it is: json, regex, choice, grammar or json_object."""
        return next(n for n in _CONSTRAINTS if getattr(self, n) not in (None, False))

    @property
    def key(self) -> tuple:
        """What its compiled grammar depends on (the compile cache's key)."""
        spec = getattr(self, self.kind)
        if self.kind == "json" and isinstance(spec, dict):
            spec = json.dumps(spec, sort_keys=True)
        elif self.kind == "choice":
            spec = tuple(spec)
        return (self.kind, spec, self.disable_any_whitespace, self.max_whitespace)


def _check_structured(value: object) -> None:
    check(value is None or isinstance(value, StructuredOutputsParams), "structured_outputs",
          "None or a StructuredOutputsParams", type(value).__name__)


@dataclass
class SamplingParams(_Stops):
    """How to sample one request; the names and defaults follow vLLM's `SamplingParams`."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[LogitsProcessor] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # batchgen's own: prompt logprobs from this position on (earlier entries None), so a
    # prefix-cache hit may serve the tokens before it (a shared multiple-choice context)
    prompt_logprobs_start: int = 0
    # vLLM's remaining fields: best_of (vLLM V0's; refused when it asks for more than n, at
    # generate, as vLLM V1 did), the ones that change nothing offline, and _OFF_ONLY's
    best_of: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int | None = None
    skip_clone: bool = False
    extra_args: dict[str, Any] | None = None
    watermarking: bool | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    spaces_between_special_tokens: bool = True
    output_text_buffer_length: int = 0
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None
    _stop_strs: list[str] = field(default_factory=list, init=False, repr=False)
    _stop_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_limits()
        self._check_controls()
        self._stop_strs = _as_str_list(self.stop, "stop")
        self._stop_ids = _as_id_list(self.stop_token_ids, "stop_token_ids")
        check(self.detokenize or not self._stop_strs, "stop",
              "empty when detokenize=False (stop strings are matched on text)", self.stop)
        _check_structured(self.structured_outputs)
        self._check_vllm_fields()

    def _check_vllm_fields(self) -> None:
        """vLLM's fields beyond batchgen's: best_of >= n (vLLM V0's rule; more than n is
        refused at generate), output_kind not DELTA, the no-effect ones' types, the rest off."""
        b = self.best_of
        check(b is None or (is_int(b) and b >= self.n), "best_of",
              f"None or an integer >= n ({self.n})", b)
        check(self.output_kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY),
              "output_kind", "RequestOutputKind.CUMULATIVE or FINAL_ONLY (each request is "
              "returned once, finished)", self.output_kind)
        si = self.stream_interval
        check(si is None or (is_int(si) and si >= 1), "stream_interval",
              "None or an integer >= 1", si)
        check_flag(self.skip_clone, "skip_clone")
        check_flag(self.flat_logprobs, "flat_logprobs")
        self.logprob_token_ids = _logprob_ids(self.logprob_token_ids, self.logprobs)
        check(self.skip_reading_prefix_cache in (None, True, False), "skip_reading_prefix_cache",
              "None, True or False", self.skip_reading_prefix_cache)
        self.prompt_logprob_token_ids = as_id_table(self.prompt_logprob_token_ids)
        self._check_prompt_start()
        check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args",
              "None or a dict", self.extra_args)
        _check_off(self, _OFF_ONLY, "SamplingParams")
        self._check_trace()

    def _check_trace(self) -> None:
        """vLLM's trace replay (`trace_decode_token_ids`): a non-empty list of ids >= 0, one
        sample, and none of the features vLLM refuses beside it (in vLLM's words)."""
        trace = self.trace_decode_token_ids
        if trace is None:
            return
        name = "trace_decode_token_ids"
        check(isinstance(trace, (list, tuple)) and len(trace) > 0, name,
              "a non-empty list (trace_decode_token_ids must be a non-empty list.)", trace)
        check(self.n == 1, name, "None when n > 1 (trace_decode_token_ids requires n=1.)",
              self.n)
        check(all(is_int(t) and t >= 0 for t in trace), name, "a list of integers >= 0 "
              "(trace_decode_token_ids must contain non-negative integers.)", trace)
        self.trace_decode_token_ids = [int(t) for t in trace]
        for other in ("prompt_logprobs", "prompt_logprob_token_ids", "structured_outputs"):
            check(getattr(self, other) is None, name, f"None when {other} is set "
                  f"(trace_decode_token_ids is not supported with {other}.)", trace)
        check(not self.bad_words, name, "None when bad_words is set "
              "(trace_decode_token_ids is not supported with bad_words.)", trace)

    def _check_prompt_start(self) -> None:
        """vLLM's prompt_logprob_start (a row: positions up to and including it are not
        scored) becomes batchgen's prompt_logprobs_start (the first position scored, one
        more), for prompt_logprobs and prompt_logprob_token_ids alike."""
        s = self.prompt_logprob_start
        if s is None:
            return
        scored = self.prompt_logprobs is not None or self.prompt_logprob_token_ids is not None
        check(scored, "prompt_logprob_start", "None unless prompt_logprobs or "
              "prompt_logprob_token_ids is set (prompt_logprob_start requires prompt_logprobs "
              "or prompt_logprob_token_ids)", s)
        check(is_int(s) and s >= 0, "prompt_logprob_start", "an integer >= 0 (non-negative)",
              s)
        check(self.prompt_logprobs_start in (0, s + 1), "prompt_logprob_start",
              f"prompt_logprobs_start - 1 ({self.prompt_logprobs_start - 1}) when both are "
              "set (the same start, numbered by the row)", s)
        self.prompt_logprobs_start = s + 1

    def _check_sampling(self) -> None:
        """n, temperature and the warpers and penalties."""
        check(is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        check(is_number(self.temperature) and self.temperature >= 0, "temperature",
              "a number >= 0 (0 means greedy)", self.temperature)
        if 0 < self.temperature < GREEDY_TEMPERATURE:
            logger.warning("temperature %s is below %s: greedy (temperature 0)",
                           self.temperature, GREEDY_TEMPERATURE)
            self.temperature = 0.0
        elif 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which overflows the logits; using %s "
                           "(as vLLM does)", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        check(is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
              "an integer >= 0 (0 or -1 disables it)", self.top_k)
        check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        check(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        check(is_number(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty", "a number > 0 (1 disables it)", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(is_number(v) and -2 <= v <= 2, name, "in [-2, 2]", v)

    def _check_limits(self) -> None:
        """Lengths, seed, logprobs, flags (logprobs=True means 1 and -1 the whole vocabulary, as
        in vLLM)."""
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "an integer >= 1 or None (up to max_model_len)", self.max_tokens)
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              "an integer >= 0", self.min_tokens)
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        self.seed = check_seed(self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is True:
                setattr(self, name, v := 1)
            check(v is None or (is_int(v) and v >= -1), name,
                  "None, True, an integer >= 0 or -1 (the whole vocabulary)", v)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "detokenize"):
            check_flag(getattr(self, name), name)
        t = self.truncate_prompt_tokens
        check(t is None or (is_int(t) and (t >= 1 or t == -1)), "truncate_prompt_tokens",
              "None, -1 (max_model_len) or an integer >= 1", t)
        start = self.prompt_logprobs_start
        check(is_int(start) and start >= 0, "prompt_logprobs_start", "an integer >= 0", start)
        check(start == 0 or self.prompt_logprobs is not None
              or self.prompt_logprob_token_ids is not None, "prompt_logprobs_start",
              "0 unless prompt_logprobs or prompt_logprob_token_ids is set", start)

    def _check_controls(self) -> None:
        """logit_bias, allowed_token_ids, bad_words, logits_processors (vLLM's forms)."""
        bias = self.logit_bias
        check(bias is None or (isinstance(bias, dict) and all(
            is_int(k) and k >= 0 and is_number(v) for k, v in bias.items())), "logit_bias",
            "a dict of token id -> finite number", bias)
        if bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in bias.items()}
        allowed = self.allowed_token_ids
        check(allowed is None or (bool(allowed) and bool(_as_id_list(allowed, "allowed_token_ids"))),
              "allowed_token_ids", "None or a non-empty list of token ids", allowed)
        if self.bad_words is not None:
            self.bad_words = _as_str_list(self.bad_words, "bad_words")
        procs = self.logits_processors
        check(procs is None or (isinstance(procs, (list, tuple)) and all(map(callable, procs))),
              "logits_processors", "a list of callables (token ids, logits) -> logits", procs)

    @classmethod
    def from_generation_config(cls, gen: Any) -> SamplingParams:
        """vLLM's defaults, with the sampling fields a transformers GenerationConfig (the
        model's generation_config.json; None: none) sets away from its defaults."""
        diff = gen.to_diff_dict() if gen else {}
        keys = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
        params = {k: diff[k] for k in keys if diff.get(k) is not None}
        if diff.get("max_new_tokens") is not None:
            params["max_tokens"] = diff["max_new_tokens"]
        return cls(**params)

    @property
    def stop_min_tokens(self) -> int:
        """Stop strings count only after min_tokens generated tokens (vLLM); a trace replays
        with min_tokens 0, as vLLM's does."""
        return 0 if self.trace_decode_token_ids else self.min_tokens

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax, as in vLLM."""
        return self.temperature == 0

    def __eq__(self, other: object) -> bool:
        """Field by field, as a dataclass compares; prompt_logprob_token_ids' tables by
        value (numpy compares elementwise)."""
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(_same_value(getattr(self, f.name), getattr(other, f.name))
                   for f in fields(self))

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass with eq is

    def verify(self, model_config: Any, speculative_config: Any = None,
               structured_outputs_config: Any = None, tokenizer: Any = None) -> None:
        """vLLM's check of these params against a model config (an object with
        `max_logprobs` and `get_vocab_size()`, as vLLM's ModelConfig): the checks batchgen
        runs at generate, a ValidationError naming the field. Speculative decoding,
        structured-output engines and the tokenizer have nothing more to check here."""
        check_model_bounds(self, model_config.get_vocab_size(), model_config.max_logprobs,
                           getattr(model_config, "max_model_len", None))

    @property
    def num_logprobs(self) -> int | None:
        """Logprobs each generated token carries beside its own (vLLM's): `logprobs`, else
        as many as `logprob_token_ids` names, else None (none asked)."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    @property
    def width(self) -> int:
        """Sequences one request runs at once."""
        return self.n


_BEAM_OFF_ONLY: dict[str, tuple[object, ...]] = {
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "watermarking": (None, False),
    "allowed_token_ids": (None,),
}


@dataclass(frozen=True)
class ControlSpec:
    """A beam request's validated logits controls, in HF's processor order
    (`BeamSearchParams.controls`; engine/beam_controls.py applies them)."""

    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    temperature: float = 1.0

    @property
    def active(self) -> bool:
        """Whether any processor changes the log-probabilities."""
        return (self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0
                or bool(self.bad_words_ids) or self.min_tokens > 0 or self.temperature != 1.0)

    @property
    def needs_sequences(self) -> bool:
        """Whether a processor reads the beams' token ids (penalty, n-grams, long bad words)."""
        return (self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0
                or any(len(w) > 1 for w in self.bad_words_ids))


@dataclass
class BeamSearchParams(_Stops):
    """Beam search with HF `generate(num_beams=...)` semantics."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # HF's beam logits controls, in its processor order, and diverse (group) beam search
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words: str | list[str] | None = None
    bad_words_ids: list[list[int]] | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    _stop_strs: list[str] = field(default_factory=list, init=False, repr=False)
    _stop_ids: list[int] = field(default_factory=list, init=False, repr=False)
    # what the search records beside its hypotheses (engine/beam_trace.py)
    logprobs: int = 0  # per token, the parent beam's top-k alternatives (0: the token's own)
    return_trace: bool = False  # BeamSearchOutput.trace: every step's beams and blocks
    # vLLM's fields with one value here: a stop string is cut from a beam's text, special
    # tokens' text skipped, no logit controls and no watermark (others: a ValueError)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    watermarking: bool | None = None
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        check(is_int(self.beam_width) and self.beam_width >= 1, "beam_width",
              "an integer >= 1", self.beam_width)
        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
              "an integer >= 1", self.max_tokens)
        check(is_number(self.length_penalty), "length_penalty", "a number", self.length_penalty)
        check(isinstance(self.early_stopping, bool) or self.early_stopping == "never",
              "early_stopping", 'True, False or "never"', self.early_stopping)
        if self.num_return_sequences is None:
            self.num_return_sequences = self.beam_width
        check(is_int(self.num_return_sequences)
              and 1 <= self.num_return_sequences <= self.beam_width,
              "num_return_sequences", f"an integer in [1, beam_width={self.beam_width}]",
              self.num_return_sequences)
        check_flag(self.ignore_eos, "ignore_eos")
        self._stop_strs = _as_str_list(self.stop, "stop")
        self._stop_ids = _as_id_list(self.stop_token_ids, "stop_token_ids")
        _check_structured(self.structured_outputs)
        self._check_controls()
        check(is_int(self.logprobs) and 0 <= self.logprobs <= MAX_BEAM_LOGPROBS, "logprobs",
              f"an integer in [0, {MAX_BEAM_LOGPROBS}] (top-k alternatives per token)",
              self.logprobs)
        check_flag(self.return_trace, "return_trace")
        self._check_groups()
        _check_off(self, _BEAM_OFF_ONLY, "beam search")

    def _check_controls(self) -> None:
        """HF's processors: repetition_penalty, no_repeat_ngram_size, bad words, min_tokens
        (HF min_new_tokens), temperature."""
        check(is_number(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty", "a number > 0 (1 disables it)", self.repetition_penalty)
        check(is_int(self.no_repeat_ngram_size) and self.no_repeat_ngram_size >= 0,
              "no_repeat_ngram_size", "an integer >= 0 (0 disables it)", self.no_repeat_ngram_size)
        if self.bad_words is not None:
            self.bad_words = _as_str_list(self.bad_words, "bad_words")
        ids = self.bad_words_ids
        check(ids is None or (isinstance(ids, (list, tuple)) and all(
            isinstance(w, (list, tuple)) and w and all(is_int(t) and t >= 0 for t in w)
            for w in ids)), "bad_words_ids", "None or a list of non-empty lists of token ids",
            ids)
        if ids is not None:
            self.bad_words_ids = [list(w) for w in ids]
        check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"an integer in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        if self.temperature == 0:  # vLLM's default: the log-probs as they are, as 1 is here
            self.temperature = 1.0
        check(is_number(self.temperature) and self.temperature > 0, "temperature",
              "a number > 0 (it divides the beams' processed log-probs; 1, or vLLM's 0, "
              "disables it)", self.temperature)

    def _check_groups(self) -> None:
        """Diverse beam search (HF 4.x group beam search): groups split the beams evenly and
        need a positive diversity_penalty; stop strings and grammars are not combined with it."""
        g = self.num_beam_groups
        check(is_int(g) and g >= 1 and self.beam_width % g == 0, "num_beam_groups",
              f"an integer >= 1 that divides beam_width={self.beam_width}", g)
        d = self.diversity_penalty
        check(is_number(d) and d >= 0, "diversity_penalty", "a number >= 0", d)
        check(g == 1 or d > 0, "diversity_penalty",
              "> 0 when num_beam_groups > 1 (HF: otherwise the groups are identical)", d)
        check(g > 1 or d == 0, "num_beam_groups",
              "> 1 when diversity_penalty is set (the penalty acts between groups)", g)
        if g > 1:
            check(not self._stop_strs, "stop", "None with num_beam_groups > 1 (stop strings "
                  "are not combined with group beam search)", self.stop)
            check(self.structured_outputs is None, "structured_outputs",
                  "None with num_beam_groups > 1", type(self.structured_outputs).__name__)
            check(not self.logprobs, "logprobs", "0 with num_beam_groups > 1 (top-k "
                  "alternatives are recorded by plain beam search only)", self.logprobs)

    @property
    def controls(self) -> ControlSpec:
        """The processors this request runs on its beams' log-probs (bad_words not yet
        tokenized: the request builder adds their ids)."""
        return ControlSpec(self.repetition_penalty, self.no_repeat_ngram_size,
                           tuple(tuple(w) for w in self.bad_words_ids or ()), self.min_tokens,
                           float(self.temperature))

    @property
    def width(self) -> int:
        """Sequences one request runs at once."""
        return self.beam_width

    # What beams always do where SamplingParams has a choice (read by the stop rules, the
    # results and the request builder, so they need not ask which params they hold).
    detokenize = property(lambda self: True, doc="Beams always have text.")
    stop_min_tokens = property(lambda self: 0, doc="Stop strings count from the first token "
                               "(HF's StopStringCriteria ignores min_new_tokens).")
    prompt_logprobs = property(lambda self: None, doc="Beams score no prompt tokens.")
    prompt_logprob_token_ids = property(lambda self: None, doc="Nor named ids of them.")
    skip_reading_prefix_cache = property(lambda self: None, doc="Beams read the prefix cache.")
    truncate_prompt_tokens = property(lambda self: None, doc="Prompts are never truncated.")
    logit_bias = property(lambda self: None, doc="Beams take no logit controls.")

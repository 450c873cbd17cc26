"""Structured outputs on xgrammar: one compiler per LLM, one matcher per sequence, one token
bitmask per step for the constrained rows.

`Grammars` (owned by the LLM, reached by the request builder) makes xgrammar's tokenizer info
once, on the first constrained request: the model's vocabulary (its lm_head rows, so ids the
tokenizer lacks are never allowed) and the engine's EOS ids as the grammar's stop tokens. It
compiles each constraint once (cached by `StructuredOutputsParams.key`). A `Constraint` is one
sequence's matcher: n samples fork the prompt's, a beam forks its parent's; the output processor
advances it with each token the sequence keeps. Each step the sampler (and the beam step) fills
the bitmask of the constrained rows in one batched call and sets every other token of those
rows to -inf before any other stage; rows without a constraint are not touched. On a GPU the
fill runs on the host while the step's forward is still queued (the sampler reaches it before
the step's one synchronisation), and the mask goes over from pinned memory without waiting.

xgrammar is imported only here, and only when a request carries a constraint.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from batchgen.checks import NO_TOKENIZER
from batchgen.transfer import to_device

if TYPE_CHECKING:
    from batchgen.params import StructuredOutputsParams

INSTALL_HINT = "pip install 'batchgen[structured]'"
_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # "[12:00:00] /project/cpp/x.cc:94: "


def load_xgrammar() -> Any:
    """The xgrammar module, or a ValueError naming the extra that installs it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"structured_outputs needs xgrammar, which is not installed: "
                         f"{INSTALL_HINT}") from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (vLLM's choice_as_grammar)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _message(e: Exception) -> str:
    """xgrammar's error text without its timestamp and source location."""
    return _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))


def _invalid(kind: str, e: Exception) -> ValueError:
    """The ValueError for a constraint xgrammar cannot compile, naming the field."""
    what = {"json": "a JSON schema xgrammar can compile", "json_object": "valid",
            "regex": "a valid regex", "choice": "a list of strings",
            "grammar": "a valid EBNF grammar (GBNF style: root ::= ...)"}[kind]
    return ValueError(f"structured_outputs.{kind} must be {what}: {_message(e)}")


def check_constraint(so: StructuredOutputsParams) -> None:
    """Parse the constraint without a tokenizer (the CLI, before the weights load): a
    ValueError naming the field for a schema, regex or grammar xgrammar cannot read."""
    xgr, kind = load_xgrammar(), so.kind
    try:
        if kind == "json":
            schema = json.dumps(so.json) if isinstance(so.json, bool) else so.json
            xgr.Grammar.from_json_schema(schema)
        elif kind == "regex":
            xgr.Grammar.from_regex(so.regex)
        elif kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(so.grammar if kind == "grammar" else choice_grammar(so.choice))
    except (RuntimeError, ValueError, TypeError) as e:
        raise _invalid(kind, e) from None


class Grammars:
    """One xgrammar compiler per LLM and its compiled grammars, cached per constraint; also
    the step's time spent filling masks (for benchmarks)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int],
                 disable_any_whitespace: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        # the engine's structured_outputs_config switch (vLLM's): on for every JSON constraint
        self.disable_any_whitespace = disable_any_whitespace
        self._compiler: Any = None
        self._batch: Any = None  # BatchGrammarMatcher
        self._cache: dict[tuple, Any] = {}
        self.not_stop: torch.Tensor | None = None  # [W] int32: every token bit but the stops
        self.mask_seconds = 0.0  # time in fill + apply, summed over steps
        self.mask_steps = 0

    def _ready(self) -> Any:
        """The compiler (made on first use: the tokenizer info takes a few hundred ms)."""
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError(f"structured_outputs compile on the vocabulary's text: "
                                 f"{NO_TOKENIZER}")
            if not self.eos_ids:
                raise ValueError("structured_outputs needs an EOS token id to end a grammar; "
                                 "the model declares none")
            xgr = load_xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
            self._batch = xgr.BatchGrammarMatcher()
            self.not_stop = _not_stop_bits(self.vocab_size, self.eos_ids)
        return self._compiler

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar of a constraint (ValueError naming the field if invalid)."""
        if self.disable_any_whitespace and not so.disable_any_whitespace:
            so = replace(so, disable_any_whitespace=True)
        key = so.key
        if key not in self._cache:
            self._cache[key] = self._compile(so)
        return self._cache[key]

    def _compile(self, so: StructuredOutputsParams) -> Any:
        comp, kind = self._ready(), so.kind
        try:
            if kind in ("json", "json_object"):
                schema = so.json if kind == "json" else '{"type": "object"}'
                if isinstance(schema, bool):
                    schema = json.dumps(schema)
                any_ws = not so.disable_any_whitespace
                return comp.compile_json_schema(
                    schema, any_whitespace=any_ws, strict_mode=True,
                    max_whitespace_cnt=so.max_whitespace if any_ws else None)
            if kind == "regex":
                return comp.compile_regex(so.regex)
            if kind == "choice":
                return comp.compile_grammar(choice_grammar(list(so.choice)))
            return comp.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise _invalid(kind, e) from None

    def constraint(self, so: StructuredOutputsParams) -> Constraint:
        """A fresh matcher for a sequence under `so`."""
        xgr = load_xgrammar()
        return Constraint(xgr.GrammarMatcher(self.compile(so)), self)

    def fill(self, constraints: list[Constraint], rows: np.ndarray, num_rows: int
             ) -> torch.Tensor:
        """A [num_rows, W] int32 host bitmask: row rows[j] allows constraints[j]'s next
        tokens (none when it has ended or failed); the other rows allow everything."""
        xgr = load_xgrammar()
        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        live = [j for j, c in enumerate(constraints) if c.live]
        if live:
            self._batch.batch_fill_next_token_bitmask(
                [constraints[j].matcher for j in live], bitmask,
                indices=[int(rows[j]) for j in live])
        if len(live) < len(constraints):
            dead = [int(rows[j]) for j, c in enumerate(constraints) if not c.live]
            bitmask[dead] = 0
        return bitmask

    def mask(self, scores: torch.Tensor, constraints: list[Constraint], rows: np.ndarray
             ) -> torch.Tensor:
        """Set every token the rows' grammars forbid to -inf, in place (those rows only);
        returns the host bitmask."""
        start = time.perf_counter()
        bitmask = self.fill(constraints, rows, scores.shape[0])
        xgr = load_xgrammar()
        xgr.apply_token_bitmask_inplace(scores, to_device(bitmask.numpy(), scores.device),
                                        indices=rows.tolist())
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        return bitmask


def _not_stop_bits(vocab_size: int, stop_ids: list[int]) -> torch.Tensor:
    """A bitmask row with a bit for every token below vocab_size except the stop tokens."""
    words = -(-vocab_size // 32)
    bits = np.full(words * 32, True)
    bits[vocab_size:] = False
    bits[[t for t in stop_ids if t < vocab_size]] = False
    packed = (bits.reshape(words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(1)
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32))


class Constraint:
    """One sequence's grammar state (an xgrammar GrammarMatcher), advanced by every token the
    sequence keeps and forked with it. `failed`: a token was rejected (a beam kept with an
    impossible score): nothing is allowed after it."""

    __slots__ = ("matcher", "grammars", "failed")

    def __init__(self, matcher: Any, grammars: Grammars, failed: bool = False) -> None:
        self.matcher = matcher
        self.grammars = grammars
        self.failed = failed

    def fork(self) -> Constraint:
        """An independent copy in the same state (a new sample or beam)."""
        return Constraint(self.matcher.fork(), self.grammars, self.failed)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and failed from then on) when the grammar rejects it."""
        if self.failed or self.matcher.is_terminated() or not self.matcher.accept_token(token):
            self.failed = True
            return False
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: the sequence ends."""
        return self.matcher.is_terminated()

    @property
    def live(self) -> bool:
        """It still has tokens to allow."""
        return not self.failed and not self.matcher.is_terminated()


@dataclass
class GrammarRows:
    """The constrained rows of one sampler call: `rows` (indices into the step's sample rows)
    and their sequences' constraints. After `apply`, `must_end` marks the rows whose grammar
    allows only a stop token (exempt from the min_tokens ban)."""

    rows: np.ndarray
    constraints: list[Constraint]
    must_end: np.ndarray | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Set each constrained row's forbidden tokens to -inf in place; returns those rows'
        values from before, for `restore` (a copy of k rows, not of the whole step)."""
        grammars = self.constraints[0].grammars
        index = to_device(self.rows, logits.device)
        with torch.inference_mode():  # the model's logits are inference tensors
            saved = logits[index]
            bitmask = grammars.mask(logits, self.constraints, self.rows)
        sub = bitmask[torch.from_numpy(self.rows)]
        self.must_end = ~(sub & grammars.not_stop).any(dim=1).numpy()
        return saved

    def restore(self, logits: torch.Tensor, saved: torch.Tensor) -> None:
        """Put the rows' unmasked values back (raw logprobs are the model's)."""
        with torch.inference_mode():
            logits[to_device(self.rows, logits.device)] = saved


def mask_beams(logprobs: torch.Tensor, constraints: list[Constraint], rows: np.ndarray
               ) -> None:
    """The beams' forbidden tokens at -inf in their log-probabilities (after log_softmax, as
    HF applies logits processors to beam scores: a beam's score stays its model logprob)."""
    constraints[0].grammars.mask(logprobs, constraints, rows)


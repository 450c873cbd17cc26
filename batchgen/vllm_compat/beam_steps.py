"""vLLM's beam search as a loop of one-token requests, for `vllm.LLM` instances whose
`_render_and_run_requests` was replaced (vLLM's own tests patch it to script each step's
results; a caller may wrap it to observe or abort the steps).

batchgen's `beam_search` runs beams inside the engine (beam groups sharing prefix blocks, HF's
semantics). vLLM's runs each live beam as a request for one token with `2 * beam_width`
logprobs through `LLM._render_and_run_requests`, then keeps the `beam_width` best candidates
by `cum_logprob / num_generated ** length_penalty`. This module is that loop, written over
batchgen's params and outputs, with vLLM's semantics:

- prompts go `concurrency_limit` at a time, each wave to its end before the next;
- a candidate ending in an EOS id (the tokenizer's and the generation config's) completes
  its beam (`finish_reason="stop"`) unless `ignore_eos`; a beam reaching `max_model_len`
  completes with `"length"`, and so do the live ones when `max_tokens` runs out;
- when any request of a prompt comes back with `finish_reason="abort"`, that prompt's live
  beams complete as they were before the step (`"abort"`), and the other prompts go on;
- each returned beam's `text` is its whole token list decoded (prompt included), as vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchgen.checks import check, is_int
from batchgen.outputs import BeamSearchOutput
from batchgen.params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """vLLM's beam: the prompt's ids then the generated ones (`tokens`), one logprobs dict
    per generated token, the running sum of the chosen tokens' logprobs."""

    orig_prompt: dict[str, Any]
    tokens: list[int]
    logprobs: list[dict[int, Any]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def get_prompt(self) -> dict[str, Any]:
        """This beam as a token prompt (the original prompt's text and cache salt kept)."""
        keep = {k: v for k, v in self.orig_prompt.items() if k in ("prompt", "cache_salt")}
        return {**keep, "type": "token", "prompt_token_ids": list(self.tokens)}

    @property
    def token_ids(self) -> list[int]:
        """batchgen's field: the generated ids only."""
        return self.tokens[len(self.orig_prompt["prompt_token_ids"]):]

    @property
    def cumulative_logprob(self) -> float:
        """batchgen's name for `cum_logprob`."""
        return self.cum_logprob


@dataclass
class _Instance:
    """One prompt's live and completed beams."""

    prompt: dict[str, Any]
    lora_request: Any
    priority: int
    beams: list[BeamSearchSequence] = field(default_factory=list)
    completed: list[BeamSearchSequence] = field(default_factory=list)


def per_prompt(value: Any, n: int, name: str) -> list[Any]:
    """`value` for each of n prompts: one shared value or a list of n."""
    if isinstance(value, (list, tuple)):
        check(len(value) == n, name, f"one value or a list of {n} (one per prompt)", value)
        return list(value)
    return [value] * n


def beam_score(length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    """vLLM's (and HF's) ranking: cum_logprob over generated tokens ** length_penalty (an
    aborted beam that generated nothing counts 1)."""
    return lambda b: b.cum_logprob / (max(len(b.logprobs), 1) ** length_penalty)


def stepwise_beam_search(llm: Any, prompts: Sequence[Any], params: BeamSearchParams,
                         lora_request: Any = None, concurrency_limit: int | None = None,
                         priority: Any = None) -> list[BeamSearchOutput]:
    """Beam search through `llm._render_and_run_requests`, one token per step."""
    check(concurrency_limit is None or (is_int(concurrency_limit) and concurrency_limit >= 1),
          "concurrency_limit", "None or an integer >= 1", concurrency_limit)
    tokenizer = llm.renderer.get_tokenizer()
    inputs = llm._preprocess_cmpl(prompts)
    loras = per_prompt(lora_request, len(inputs), "lora_request")
    prios = per_prompt(0 if priority is None else priority, len(inputs), "priority")
    instances = []
    for prompt, lora, prio in zip(inputs, loras, prios):
        inst = _Instance(prompt, lora, prio)
        inst.beams.append(BeamSearchSequence(prompt, list(prompt["prompt_token_ids"]), [], lora))
        instances.append(inst)
    search = _Search(llm, params, _eos_ids(llm, tokenizer))
    wave = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), wave):
        batch = instances[start:start + wave]
        for _ in range(params.max_tokens):
            if not search.step(batch):
                break
    return [_output(inst, params, search.key, tokenizer) for inst in instances]


def _eos_ids(llm: Any, tokenizer: Any) -> set[int]:
    """The ids that end a beam: the tokenizer's EOS and the generation config's."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    fields = getattr(llm.llm_engine.input_processor, "generation_config_fields", None) or {}
    eos = fields.get("eos_token_id")
    ids.update(eos if isinstance(eos, (list, tuple, set)) else [] if eos is None else [eos])
    return ids


class _Search:
    """One step of every live beam of a wave of prompts."""

    def __init__(self, llm: Any, params: BeamSearchParams, eos: set[int]) -> None:
        self.llm, self.params, self.eos = llm, params, eos
        self.key = beam_score(params.length_penalty)
        # the search reads logprobs only: the request's own token is its greedy one
        self.base = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1,
                                   temperature=0.0, detokenize=False)

    def step(self, batch: list[_Instance]) -> bool:
        """Run one token for every live beam; False when none was left."""
        beams = [b for inst in batch for b in inst.beams]
        if not beams:
            return False
        outs = self.llm._render_and_run_requests(
            prompts=[b.get_prompt() for b in beams], params=[self.base] * len(beams),
            output_type=None, lora_requests=[b.lora_request for b in beams],
            priorities=[inst.priority for inst in batch for _ in inst.beams], use_tqdm=False)
        start = 0
        for inst in batch:
            end = start + len(inst.beams)
            self._advance(inst, list(outs[start:end]))
            start = end
        return True

    def _advance(self, inst: _Instance, results: list[Any]) -> None:
        """inst's beams after their step's results (or completed as they were on abort)."""
        if any(r.outputs[0].finish_reason == "abort" for r in results):
            for beam in inst.beams:
                beam.finish_reason = "abort"
            inst.completed.extend(inst.beams)
            inst.beams = []
            return
        candidates = []
        for beam, result in zip(inst.beams, results):
            for token, lp in ((result.outputs[0].logprobs or [{}])[0] or {}).items():
                new = BeamSearchSequence(beam.orig_prompt, beam.tokens + [token],
                                         beam.logprobs + [result.outputs[0].logprobs[0]],
                                         beam.lora_request, beam.cum_logprob + lp.logprob)
                if token in self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    inst.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=self.key, reverse=True)
        inst.beams = []
        max_len = self.llm.model_config.max_model_len
        for beam in candidates[:self.params.beam_width]:
            if len(beam.tokens) >= max_len:
                beam.finish_reason = "length"
                inst.completed.append(beam)
            else:
                inst.beams.append(beam)


def _output(inst: _Instance, params: BeamSearchParams, key: Callable[..., float],
            tokenizer: Any) -> BeamSearchOutput:
    """The prompt's best `num_return_sequences` beams, live ones counted as finished."""
    for beam in inst.beams:
        beam.finish_reason = "length"
    best = sorted(inst.completed + inst.beams, key=key, reverse=True)
    best = best[:params.num_return_sequences or params.beam_width]
    for beam in best:
        beam.text = tokenizer.decode(beam.tokens,
                                     skip_special_tokens=params.skip_special_tokens)
    return BeamSearchOutput(prompt=inst.prompt.get("prompt"),
                            prompt_token_ids=list(inst.prompt["prompt_token_ids"]),
                            sequences=best)  # type: ignore[arg-type]

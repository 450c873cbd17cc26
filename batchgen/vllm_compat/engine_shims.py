"""The few vLLM engine objects that code written against vLLM reaches past the offline API for,
under vLLM's module names, each implemented over batchgen's own code:

- `vllm.v1.engine.logprobs.LogprobsProcessor`: a request's logprobs state, with
  `_correct_decoded_token` (a token whose text ends in an unfinished UTF-8 sequence, decoded
  after the sampled tokens before it: batchgen/token_texts.py, which batchgen's results use
  for every `Logprob.decoded_token`) and `_verify_tokens`;
- `vllm.v1.engine.input_processor.InputProcessor`: `_validate_params`, the per-request checks
  vLLM's engine runs before queueing a request (batchgen's `SamplingParams.verify`, plus the
  refusal of `prompt_logprob_token_ids` under KV-sharing fast prefill). `llm.llm_engine
  .input_processor` of vllm_compat's `vllm.LLM` is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.checks import ValidationError
from batchgen.params import SamplingParams
from batchgen.token_texts import REPLACEMENT, TokenTexts

GENERATION_TASKS = ("generate", "transcription", "realtime")  # vLLM's tasks that sample


@dataclass
class LogprobsProcessor:
    """vLLM's per-request logprobs state (its fields, in its order)."""

    tokenizer: Any
    logprobs: Any
    prompt_logprobs: Any
    cumulative_logprob: float | None
    num_logprobs: int | None
    num_prompt_logprobs: int | None
    prompt_token_id_logprobs: Any = None

    def _correct_decoded_token(self, token_id: int, context_token_ids: list[int]) -> str:
        """`token_id`'s text after the sampled tokens `context_token_ids` (oldest first): the
        text it completes after the last 1..4 of them, the text of byte-fallback ones right
        before it included; "" when no context completes it. The tokenizer's decode is
        called afresh (nothing memoised), as vLLM does."""
        if self.tokenizer is None:
            raise ValueError("tokenizer is None: decoded tokens need a tokenizer "
                             "(skip_tokenizer_init=False)")
        return TokenTexts(self.tokenizer, restore_spaces=False).completion(
            token_id, list(context_token_ids))

    def _sampled_context(self) -> list[int]:
        """The sampled token of each step so far (each entry's first id)."""
        return [next(iter(entry)) for entry in (self.logprobs or []) if entry]

    def _verify_tokens(self, decoded_tokens_list: list[str], tokens: list[int],
                       context_token_ids: list[int] | None = None) -> list[str]:
        """`decoded_tokens_list` (alternatives at one position) with each text that ends in
        U+FFFD corrected independently against the same sequential context."""
        context = self._sampled_context() if context_token_ids is None else context_token_ids
        return [self._correct_decoded_token(tok, context) if text.endswith(REPLACEMENT)
                else text for text, tok in zip(decoded_tokens_list, tokens)]


class InputProcessor:
    """vLLM's request validation over the attributes vLLM's InputProcessor has
    (`model_config`, `vllm_config`, `speculative_config`, `structured_outputs_config`,
    `tokenizer`)."""

    def __init__(self, model_config: Any, vllm_config: Any, tokenizer: Any) -> None:
        self.model_config = model_config
        self.vllm_config = vllm_config
        self.speculative_config = None
        self.structured_outputs_config = getattr(vllm_config, "structured_outputs_config",
                                                 None)
        self.tokenizer = tokenizer
        self.generation_config_fields: dict[str, Any] = {}

    def validate_logits_processors_params(self, params: Any) -> None:
        """batchgen checks its logits processors' arguments at generate."""

    def resolve_watermarking(self, params: Any) -> bool:
        """batchgen has no watermarking (SamplingParams refuses watermarking=True)."""
        return False

    def _validate_params(self, params: Any, supported_tasks: tuple[str, ...]) -> Any:
        """A ValidationError for params this engine cannot run; returns the resolved
        watermarking for SamplingParams (None for other params)."""
        if not isinstance(params, SamplingParams):
            return None
        if not any(task in GENERATION_TASKS for task in supported_tasks):
            raise ValidationError("This model does not support generation")
        params.verify(self.model_config, self.speculative_config,
                      self.structured_outputs_config, self.tokenizer)
        cache = getattr(self.vllm_config, "cache_config", None)
        if (params.prompt_logprob_token_ids is not None
                and getattr(cache, "kv_sharing_fast_prefill", False)):
            raise ValidationError(
                "prompt_logprob_token_ids cannot be scored with kv_sharing_fast_prefill "
                "(fast-prefill skips the rows it scores): disable it for scoring",
                parameter="prompt_logprob_token_ids")
        self.validate_logits_processors_params(params)
        budget = getattr(params, "thinking_token_budget", None)
        reasoning = getattr(self.vllm_config, "reasoning_config", None)
        if budget is not None and not getattr(reasoning, "enabled", False):
            raise ValidationError("thinking_token_budget is set but no reasoning config is "
                                  "enabled", parameter="thinking_token_budget", value=budget)
        return self.resolve_watermarking(params)

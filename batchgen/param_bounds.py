"""The checks of a request's parameters that need the model (its vocabulary, context length and
the LLM's max_logprobs): run at generate before any work, and by `SamplingParams.verify`
(vLLM's name) against a model config."""

from __future__ import annotations

from typing import Any

from batchgen.checks import ValidationError, check
from batchgen.id_table import check_id_table


def check_model_bounds(p: Any, vocab: int, max_logprobs: int, max_model_len: int | None = None
                       ) -> None:
    """Counts and token ids a request names must fit the model: logprobs within the vocabulary
    and max_logprobs (vLLM's bound and message), every named id inside the vocabulary, a
    prompt_logprob_token_ids table within them and max_model_len."""
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        check(k is None or k <= vocab, name, f"<= the vocabulary size {vocab}", k)
        check_max_logprobs(name, k, max_logprobs, vocab)
    for name in ("allowed_token_ids", "logit_bias", "stop_token_ids"):
        ids = list(getattr(p, name) or ())
        if any(t >= vocab for t in ids):
            raise ValidationError(f"{name} has token id {max(ids)} outside the model's "
                                  f"vocabulary [0, {vocab})", parameter=name, value=max(ids))
    check_id_table(p.prompt_logprob_token_ids, vocab, max_logprobs, max_model_len)
    for name in ("logprob_token_ids", "trace_decode_token_ids"):
        named = [t for t in getattr(p, name, None) or () if t >= vocab]
        if named:  # vLLM's message
            raise ValidationError(f"token_id(s) {named} in {name} contain out-of-vocab "
                                  f"token ids. Vocabulary size: {vocab}", parameter=name,
                                  value=named)


def check_max_logprobs(name: str, k: int | None, most: int, vocab: int) -> None:
    """vLLM's bound: a request asks at most the LLM's max_logprobs (-1 there: the vocabulary)
    sample or prompt logprobs, -1 counting as the vocabulary; in vLLM's words."""
    if not k or not isinstance(k, int):
        return
    asked, most = (vocab if k == -1 else k), (vocab if most == -1 else most)
    if asked > most:
        what = "sample" if name == "logprobs" else "prompt"
        raise ValidationError(f"Requested {what} logprobs of {asked}, which is greater than max "
                              f"allowed: {most} ({name}; raise LLM(max_logprobs=...))",
                              parameter=name, value=asked)

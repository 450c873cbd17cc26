"""A pooling model's head served as an lm_head, so the paged engine runs it unchanged.

A `*ForSequenceClassification` model's backbone and `score` head become a causal LM whose
lm_head has the tokenizer's width: rows [0, L) are the head's L labels, every other row is
a zero weight with a -1e30 bias. Prefill of a prompt then yields the head's raw outputs at
the last prompt token as the first sampled position's raw logits (`logprobs_mode=
"raw_logits"`, top-L): chunked prefill, block tables, prefix caching and preemption are the
engine's own."""

from __future__ import annotations

import torch

from batchgen.checks import ValidationError

FILL = -1e30


def head_of(model: torch.nn.Module) -> torch.nn.Linear:
    """The classification head of a `*ForSequenceClassification` model (`score`, as Llama,
    Qwen3, Mistral and Gemma name it), or a ValidationError naming what the model is."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValidationError(
            "model must be a sequence-classification model with a `score` head (a reward "
            f"model such as *ForSequenceClassification), got {type(model).__name__}",
            parameter="model", value=type(model).__name__)
    return head


def as_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """A causal LM sharing `model`'s backbone and config (no copy) whose lm_head carries the
    classification head in its first rows (see the module's note)."""
    from transformers import AutoModelForCausalLM

    head = head_of(model)
    config = model.config
    vocab = model.get_input_embeddings().num_embeddings
    labels = head.out_features
    if labels > 20:
        raise ValidationError(f"the model's head must have at most 20 labels, got {labels}",
                              parameter="model", value=labels)
    ref = head.weight
    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(config)
    lm_head = torch.nn.Linear(head.in_features, vocab, bias=True, device=ref.device,
                              dtype=ref.dtype)
    with torch.no_grad():
        lm_head.weight.zero_()
        lm_head.weight[:labels] = ref
        lm_head.bias.fill_(FILL)
        lm_head.bias[:labels] = head.bias if head.bias is not None else 0.0
    setattr(causal, causal.base_model_prefix, getattr(model, model.base_model_prefix))
    causal.lm_head = lm_head
    causal.config = config
    causal.name_or_path = getattr(model, "name_or_path", "")
    causal.eval()
    return causal

"""Yes/no-logit rerankers (Qwen3-Reranker-style) in vLLM's form: a causal LM loaded with
`hf_overrides={"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
["no", "yes"], "is_original_qwen3_reranker": True}`. The LM head's rows of the named tokens
become a classification head (`score`), served as any reward head (batchgen.pooling.heads):
with `is_original_qwen3_reranker` one label, the "yes" row minus the "no" row, whose sigmoid
(`score`'s activation) is the softmax over the two logits at "yes", as vLLM computes it;
without it one label per named token, their raw logits."""

from __future__ import annotations

import os
from typing import Any

import torch

from batchgen.checks import ValidationError, check, check_type

OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")


def _token_ids(tokenizer: Any, tokens: list[str]) -> list[int]:
    """Each named token's id (one token each), or a ValidationError naming it."""
    ids = []
    for t in tokens:
        found = tokenizer.encode(t, add_special_tokens=False)
        check(len(found) == 1, "hf_overrides.classifier_from_token",
              "tokens that are one token each of the model's tokenizer", t)
        ids.append(found[0])
    return ids


def check_overrides(hf_overrides: Any) -> tuple[list[str], bool]:
    """vLLM's reranker overrides: the named tokens and `is_original_qwen3_reranker`; any other
    override, or architectures that are not a `*ForSequenceClassification`, is refused."""
    check_type(hf_overrides, "hf_overrides", dict)
    extra = sorted(set(hf_overrides) - set(OVERRIDE_KEYS))
    check(not extra, "hf_overrides", f"a dict of {list(OVERRIDE_KEYS)} (a yes/no-logit "
          "reranker's form)", extra)
    archs = hf_overrides.get("architectures") or ["ForSequenceClassification"]
    check(all(str(a).endswith("ForSequenceClassification") for a in archs),
          "hf_overrides.architectures", "*ForSequenceClassification names", archs)
    tokens = hf_overrides.get("classifier_from_token")
    check(isinstance(tokens, (list, tuple)) and len(tokens) >= 1
          and all(isinstance(t, str) for t in tokens), "hf_overrides.classifier_from_token",
          "a non-empty list of token strings", tokens)
    original = bool(hf_overrides.get("is_original_qwen3_reranker", False))
    check(not original or len(tokens) == 2, "hf_overrides.classifier_from_token",
          'two tokens ("no", "yes") with is_original_qwen3_reranker', tokens)
    return list(tokens), original


def load_token_reranker(path: str | os.PathLike, tokenizer: str | os.PathLike,
                        hf_overrides: Any) -> Any:
    """The folder's causal LM (float32, CPU) carrying a `score` head built from its LM head's
    rows of the named tokens (see the module's note); its own lm_head dropped."""
    import transformers

    tokens, original = check_overrides(hf_overrides)
    config = transformers.AutoConfig.from_pretrained(path)
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ValidationError(f"model must be a causal LM for a yes/no-logit reranker "
                              f"(hf_overrides classifier_from_token), got {archs}",
                              parameter="model", value=archs)
    ids = _token_ids(transformers.AutoTokenizer.from_pretrained(tokenizer), tokens)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    rows = model.get_output_embeddings().weight[ids].detach()
    if original:  # vLLM's from_2_way_softmax: sigmoid(yes - no) = softmax([no, yes])[yes]
        rows = rows[1:] - rows[:1]
    head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(rows)
    model.score = head
    model.lm_head = None
    return model

"""Decoder embedding models on the paged engine (Qwen3-Embedding-style: a `*Model` folder
with no LM head, or a causal LM's folder under runner="pooling", whose LM head is dropped).

The backbone's final-norm hidden states are served as raw logits: the lm_head becomes
`HiddenHead`, which returns its input padded to the vocabulary's width with -1e30 (no
weight). Under `logprobs_mode="raw_logits"` the first sampled position's top-H logprobs are
then the last prompt token's hidden state, and each prompt logprob row (top-H) a prompt
position's: last-token pooling reads one row, mean and CLS pooling every prompt row.
Chunked prefill, block tables, prefix caching and preemption are the engine's own."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from batchgen.checks import ValidationError, check_choice
from batchgen.pooling.heads import FILL

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's PoolerConfig.pooling_type names served
_ST_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_cls_token", "CLS"))


class HiddenHead(torch.nn.Module):
    """An lm_head that returns its input (hidden states [..., H]) padded to `vocab` columns
    with -1e30: the hidden state's H values lead the row, nothing else can rank above them."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.hidden, self.vocab = hidden, vocab

    @property
    def weight(self) -> torch.Tensor:
        """The [vocab, hidden] shape the engine reads from an lm_head: a stride-0 view of one
        zero (no memory, no parameter or buffer to move, load or save)."""
        return torch.zeros(()).expand(self.vocab, self.hidden)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(states, (0, self.vocab - self.hidden), value=FILL)


def load_embedding_model(path: str | os.PathLike) -> Any:
    """The folder's backbone (`AutoModel`, float32 on the CPU: a `*Model` folder, or a causal
    LM's without its LM head)."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype="float32")


def as_embedding_lm(base: torch.nn.Module) -> torch.nn.Module:
    """A causal LM sharing `base` (a `*Model` backbone, no copy) whose lm_head is a
    `HiddenHead`: its raw logits are the final-norm hidden states."""
    from transformers import AutoModelForCausalLM

    config = base.config
    hidden = int(config.hidden_size)
    vocab = base.get_input_embeddings().num_embeddings
    if hidden > vocab:
        raise ValidationError(f"model's hidden_size must be at most its vocabulary ({vocab}) "
                              f"to be served as an embedding model, got {hidden}",
                              parameter="model", value=hidden)
    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(config)
    setattr(causal, causal.base_model_prefix, base)
    causal.lm_head = HiddenHead(hidden, vocab)
    causal.config = config
    causal.name_or_path = getattr(base, "name_or_path", "")
    causal.eval()
    return causal


def pooling_type(folder: str | os.PathLike, pooler_config: Any = None) -> str:
    """The pooling an embedding model gets: `pooler_config`'s `pooling_type` (vLLM's
    PoolerConfig, or a dict) when given, else the folder's sentence-transformers pooling
    (`modules.json` → its Pooling module's `config.json`), else "LAST"."""
    if pooler_config is not None:
        given = (pooler_config.get("pooling_type") if isinstance(pooler_config, dict)
                 else getattr(pooler_config, "pooling_type", None))
        if given is not None:
            check_choice(str(given).upper(), "pooler_config.pooling_type", POOLING_TYPES)
            return str(given).upper()
    return _sentence_transformers_pooling(Path(folder)) or "LAST"


def _sentence_transformers_pooling(folder: Path) -> str | None:
    """The pooling a sentence-transformers folder names, or None (no such files)."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            config = folder / module.get("path", "") / "config.json"
            if config.is_file():
                modes = json.loads(config.read_text())
                for key, name in _ST_MODES:
                    if modes.get(key):
                        return name
                raise ValidationError(
                    f"the model's sentence-transformers pooling must be one of lasttoken, "
                    f"mean_tokens, cls_token, got {modes}", parameter="pooler_config",
                    value=modes)
    return None


def hidden_rows(out: Any, hidden: int, every: bool) -> torch.Tensor:
    """One request's hidden states from its raw logits: the last prompt position's [1, H]
    (the first sampled position's top-H, flat logprobs), or (`every`) every prompt
    position's [T, H] in order (positions before the last: `prompt_token_id_logprobs`,
    the H columns named at every scored prompt row)."""
    import numpy as np

    flat = out.outputs[0].logprobs
    ids = np.asarray(flat.token_ids[flat.start_indices[0]:flat.end_indices[0]], np.int64)
    vals = np.asarray(flat.logprobs[flat.start_indices[0]:flat.end_indices[0]], np.float32)
    last = np.zeros((1, hidden), np.float32)
    keep = ids < hidden
    last[0, ids[keep]] = vals[keep]
    table = out.prompt_token_id_logprobs if every else None
    rows = last if table is None else np.concatenate([np.asarray(table, np.float32), last])
    return torch.from_numpy(rows)

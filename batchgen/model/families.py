"""Every layer of a model classified from its config alone, before any weights are read.

A layer is attention (with its layout: "standard" per-head K/V, or "mla", DeepSeek's latent
attention), a state mixer (a named kind: "linear_attention", "mamba", "conv", ...), both
(falcon_h1 runs attention and a Mamba branch side by side), neither (a feed-forward-only
layer, nemotron_h's "mlp"/"moe"), or unsupported (a named reason). `check_served` refuses a
model with one ValueError naming its family and the first layer kind batchgen cannot serve.
State mixers are served only when their kind is in `SERVED_MIXERS` (the hybrid work fills it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# State-mixer kinds the engine serves: their state lives in transformers' cache, which the
# state pool backs per sequence (batchgen/state/); a family whose mixer keeps it elsewhere is
# still refused by the probe on the meta device (model/state_probe.py), before any weight.
SERVED_MIXERS: frozenset[str] = frozenset(
    {"linear_attention", "mamba", "conv", "lightning_attention", "cca"})

# Families whose attention does not route through transformers' AttentionInterface.
BYPASS_FAMILIES = ("falcon", "bloom", "mpt", "gpt_neo", "xglm", "big_bird", "cpmant",
                   "gpt_neox_japanese", "openai-gpt", "megatron-bert", "rembert", "roformer",
                   "xlm")
# BERT-style encoders that transformers also offers as causal LMs (is_decoder=True).
ENCODER_FAMILIES = ("bert", "bert-generation", "camembert", "data2vec-text", "electra",
                    "ernie", "roberta", "roberta-prelayernorm", "roc_bert", "xlm-roberta",
                    "xlm-roberta-xl", "xmod")
# Families whose attention goes through the interface in a way the paged pool cannot serve.
UNSUPPORTED_FAMILIES = {
    "diffllama": "differential attention (two attention calls per layer)",
    "hrm_text": "recurrent reasoning modules (each layer attends several times per forward)",
    "gemma3n_text": "layers reading other layers' K/V (KV sharing)",
    "jetmoe": "mixture-of-attention heads (K/V heads routed per expert)",
    "mimo_v2_flash": "K/V head counts that differ between layers",
    "gemma4_text": "K/V widths that differ between layers (per-layer head_dim)",
    "gemma4_unified_text": "K/V widths that differ between layers (per-layer head_dim)",
    "nemotron": "decoder layers that do not pass the engine's step to attention",
    "longcat_flash": "two attention blocks per decoder layer",
    "stablelm": "decoder layers that do not pass the engine's step to attention",
    "dory": "recurrent depth (layers run several times per forward)",
    "dots3_note_text": "attention settings that differ between layers (per-layer configs)",
    "zamba": "a transformer block shared between layers (its attention has no layer index)",
    "zamba2": "a transformer block shared between layers (its attention has no layer index)",
}

# Attention layer types read per layer; the window comes from what each layer passes.
ATTENTION_TYPES = ("full_attention", "sliding_attention", "attention")
# Attention layer types batchgen's backends cannot compute exactly, and why.
UNSUPPORTED_TYPES = {
    "chunked_attention": "chunked local attention (keys only within the query's chunk)",
    "indexed_attention": "sparse attention over indexer-selected keys (DSA)",
    "heavily_compressed_attention": "compressed sparse attention",
    "compressed_sparse_attention": "compressed sparse attention",
    "hybrid_sliding": "per-head mixed sliding/full attention",
}
# The state-mixer kind of each family's non-attention layers (the config's layer type names
# "linear_attention" for Mamba and Gated DeltaNet alike, so the family decides).
MIXER_KINDS = {
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid",
                     "kimi_linear", "lara_mini", "bailing_hybrid"), "linear_attention"),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "granitemoehybrid",
                     "nemotron_h", "zamba", "zamba2", "falcon_h1"), "mamba"),
    **dict.fromkeys(("lfm2", "lfm2_moe", "lfm3"), "conv"),
    "minimax": "lightning_attention",
    "zaya": "cca",  # compressed convolutional attention: conv and recurrent state per layer
    "recurrent_gemma": "rg_lru",
    "rwkv": "rwkv",
    "xlstm": "xlstm",
}
# Families every layer of which is a state mixer, whatever the config lists.
ALL_MIXER_FAMILIES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")
# Layer types that mix no tokens (a feed-forward block between mixers).
FEED_FORWARD_TYPES = ("mlp", "moe")
# Layer types naming a state mixer; "hybrid" layers hold attention and a mixer.
MIXER_TYPES = ("linear_attention", "mamba", "conv", "recurrent")


@dataclass(frozen=True)
class LayerClass:
    """One decoder layer: its config type name, its attention layout ("standard", "mla" or
    None), its state-mixer kind (or None) and, when batchgen cannot run it, why."""

    index: int
    layer_type: str
    attention: str | None = None
    mixer: str | None = None
    unsupported: str | None = None

    @property
    def kind(self) -> str:
        """What the layer is, in words an error message can name."""
        if self.unsupported:
            return f"{self.layer_type!r} ({self.unsupported})"
        parts = [f"{self.attention} attention"] if self.attention else []
        parts += [f"{self.mixer!r} state mixer"] if self.mixer else []
        return " + ".join(parts) or "feed-forward only"


@dataclass(frozen=True)
class ModelLayout:
    """A model's layers as classified from its (text) config."""

    family: str
    layers: tuple[LayerClass, ...]

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the layers that attend (and so hold K/V in the pool)."""
        return [c.index for c in self.layers if c.attention]

    @property
    def mixer_kinds(self) -> set[str]:
        """The state-mixer kinds the model's layers use."""
        return {c.mixer for c in self.layers if c.mixer}

    @property
    def attention_layouts(self) -> set[str]:
        """The attention layouts the model's layers use ("standard", "mla")."""
        return {c.attention for c in self.layers if c.attention}


def text_config(config: Any) -> Any:
    """The config of the text decoder (a multimodal config's text part, else itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_layout(text: Any) -> str:
    """ "mla" when the config describes DeepSeek's latent attention, else "standard"."""
    mla = getattr(text, "kv_lora_rank", None) and getattr(text, "qk_rope_head_dim", None)
    return "mla" if mla else "standard"


def layer_types(text: Any) -> list[str]:
    """The config's per-layer type names (all "full_attention" when it lists none)."""
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    listed = getattr(text, "layer_types", None)
    if listed and len(listed) == n:
        return [str(t) for t in listed]
    return ["full_attention"] * n


def classify_layer(index: int, layer_type: str, family: str, layout: str) -> LayerClass:
    """One layer's class from its type name, its family's mixer kind and attention layout."""
    mixer = MIXER_KINDS.get(family, layer_type)
    if family in ALL_MIXER_FAMILIES:
        return LayerClass(index, layer_type, mixer=mixer)
    if layer_type in ATTENTION_TYPES:
        return LayerClass(index, layer_type, attention=layout)
    if layer_type == "hybrid":
        return LayerClass(index, layer_type, attention=layout, mixer=mixer)
    if layer_type in MIXER_TYPES:
        return LayerClass(index, layer_type, mixer=mixer)
    if layer_type in FEED_FORWARD_TYPES:
        return LayerClass(index, layer_type)
    why = UNSUPPORTED_TYPES.get(layer_type, "a layer type batchgen does not know")
    return LayerClass(index, layer_type, unsupported=why)


def classify(config: Any) -> ModelLayout:
    """Every layer of the model `config` describes, from the config alone."""
    text = text_config(config)
    family = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    if config.model_type in BYPASS_FAMILIES or family in BYPASS_FAMILIES:
        why = "its attention bypasses transformers' AttentionInterface"
        return ModelLayout(family, (LayerClass(0, "attention", unsupported=why),))
    if family in UNSUPPORTED_FAMILIES:
        why = UNSUPPORTED_FAMILIES[family]
        return ModelLayout(family, (LayerClass(0, "attention", unsupported=why),))
    if getattr(config, "is_encoder_decoder", False):
        why = "an encoder-decoder model (batchgen serves decoder-only models)"
        return ModelLayout(family, (LayerClass(0, "encoder_decoder", unsupported=why),))
    if family in ENCODER_FAMILIES:
        why = "a BERT-style encoder family (absolute positions, bidirectional pretraining)"
        return ModelLayout(family, (LayerClass(0, "encoder", unsupported=why),))
    layout = attention_layout(text)
    types = (["mixer"] * int(text.num_hidden_layers) if family in ALL_MIXER_FAMILIES
             else layer_types(text))
    return ModelLayout(family, tuple(classify_layer(i, t, family, layout)
                                     for i, t in enumerate(types)))


def check_served(layout: ModelLayout, served: frozenset[str] = SERVED_MIXERS) -> None:
    """ValueError naming the family and the first layer kind batchgen cannot serve: an
    unsupported layer, a state mixer whose kind is not in `served`, or no layer mixing
    tokens at all."""
    for c in layout.layers:
        if c.unsupported or (c.mixer and c.mixer not in served):
            what = ("state mixers are not served yet" if not c.unsupported
                    else "batchgen cannot run it")
            served_s = ", ".join(sorted(served)) or "none"
            raise ValueError(
                f"model family {layout.family!r} is not supported: layer {c.index} is "
                f"{c.kind}; {what} (served state mixers: {served_s})")
    if not layout.attention_layers and not layout.mixer_kinds:
        raise ValueError(f"model family {layout.family!r} is not supported: no layer "
                         "attends or mixes tokens")

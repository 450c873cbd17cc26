"""Which vision-language families batchgen serves with images, and what each needs, from the
config alone (before any weights are read).

A served family is described by a `VisionFamily`: where its config keeps the placeholder
token id, how the processor's tensors split into one image's share, how its placeholder runs
group into images, and what its decoder needs beyond causal 1-D attention (M-RoPE positions
from the model's `get_rope_index`, Qwen3-VL's DeepStack features, Gemma 3's bidirectional
attention inside each image). Every other image-text-to-text family of transformers is
refused, naming the family and the reason, except `TEXT_SERVED`: multimodal families whose
text decoder the family matrix checks against HF (their `*_text` entry) load as text models,
and their image prompts are refused instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# How one processor output splits into each image's share:
#   "images":  the leading dim indexes images (pixel_values [n, ...], image_sizes, grids)
#   "tiles":   dim 1 of a one-prompt batch indexes tiles; an image has one tile per
#              placeholder run (Idefics3 / SmolVLM image splitting)
#   "patches": the leading dim holds every image's patches, image i owning prod(grid_thw[i])
#              rows (Qwen-VL's flattened pixel_values)
SPLITS = ("images", "tiles", "patches")


@dataclass(frozen=True)
class VisionFamily:
    """What batchgen needs to know of a served vision-language family."""

    name: str
    image_token_attr: str  # the config attribute holding the placeholder token id
    split: dict[str, str] = field(default_factory=lambda: {"pixel_values": "images"})
    item_end_token: str | None = None  # a run after this token ends an image (else: one run)
    mrope: bool = False  # 3-D positions from the model's get_rope_index (Qwen-VL)
    deepstack: bool = False  # vision features added to early decoder layers (Qwen3-VL)
    bidirectional: bool = False  # attention inside each image is bidirectional (Gemma 3)

    def image_token_id(self, config: Any) -> int:
        """The placeholder token id the processor expands each image into."""
        return int(getattr(config, self.image_token_attr))


_IDEFICS = {"pixel_values": "tiles", "pixel_attention_mask": "tiles"}
_QWEN = {"pixel_values": "patches", "image_grid_thw": "images"}
SERVED: dict[str, VisionFamily] = {
    "llava": VisionFamily("llava", "image_token_id"),
    "llava_next": VisionFamily("llava_next", "image_token_id",
                               {"pixel_values": "images", "image_sizes": "images"}),
    "idefics3": VisionFamily("idefics3", "image_token_id", _IDEFICS, "<global-img>"),
    "smolvlm": VisionFamily("smolvlm", "image_token_id", _IDEFICS, "<global-img>"),
    "qwen2_5_vl": VisionFamily("qwen2_5_vl", "image_token_id", _QWEN, mrope=True),
    "qwen3_vl": VisionFamily("qwen3_vl", "image_token_id", _QWEN, mrope=True,
                             deepstack=True),
    "gemma3": VisionFamily("gemma3", "image_token_id", bidirectional=True),
}

# Multimodal families served as text models: transformers builds them as causal LMs and
# their text decoder is HF-exact in the family matrix (gemma3_text, qwen3_5_text, ...).
TEXT_SERVED = frozenset({"qwen3_5", "qwen3_5_moe"})

# Why a family is not served, where there is more to say than "not built yet".
REASONS = {
    "paligemma": "its whole prefix (image and text) attends bidirectionally: no chunked "
                 "prefill and no partial prefix hits",
    "mllama": "its image enters through cross-attention layers, not placeholder tokens",
    "gemma3n": "its audio and vision towers and per-layer inputs are not built",
    "gemma4": "per-layer K/V widths and its vision side are not built",
    "gemma4_unified": "per-layer K/V widths and its vision side are not built",
    "llama4": "its text decoder uses chunked local attention",
    "qwen3_5": "its image side (M-RoPE over a hybrid decoder) is not verified yet",
    "qwen3_5_moe": "its image side (M-RoPE over a hybrid decoder) is not verified yet",
    "emu3": "it generates images (a VQ-VAE), not only text",
    "fuyu": "its image patches enter through a linear projection of raw pixels, not built",
}
DEFAULT_REASON = ("its image side (processor, vision encoder, how features enter the "
                  "decoder) is not verified against HF in batchgen yet")


def image_text_families() -> frozenset[str]:
    """transformers' image-text-to-text families (model types)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return frozenset(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def served_names() -> str:
    """The served families, for messages."""
    return ", ".join(sorted(SERVED))


def vision_family(config: Any) -> VisionFamily | None:
    """The served family of a config whose images batchgen runs, else None (a text model,
    or a multimodal family whose text decoder alone is served)."""
    return SERVED.get(str(getattr(config, "model_type", "")))


def image_refusal(config: Any) -> str | None:
    """Why images are refused for this config's family (None: they are served, or the
    family has no images at all)."""
    family = str(getattr(config, "model_type", ""))
    if family in SERVED:
        return None
    if family in image_text_families() or getattr(config, "vision_config", None) is not None:
        return REASONS.get(family, DEFAULT_REASON)
    return None


def check_vision(config: Any) -> None:
    """ValueError naming the family and the reason for an image-text-to-text family that
    batchgen neither serves with images nor as a text model (before weights)."""
    family = str(getattr(config, "model_type", ""))
    why = image_refusal(config)
    if why is not None and family not in TEXT_SERVED:
        raise ValueError(
            f"model family {family!r} is a vision-language (image-text-to-text) model that "
            f"batchgen does not serve: {why}. Served with images: {served_names()}")

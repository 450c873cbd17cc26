"""Random tiny vision-language model folders (weights, config, tokenizer, image processor,
processor) for tests, examples and the benchmark: both towers tiny (hidden 32-64, 2 layers,
images of 8-16 px), built from each family's own config class and saved as a real folder
that `LLM` and HF's `from_pretrained` load alike. No torchvision is needed: the PIL image
processors are used, and Qwen-VL processors are saved without their video part.

    python -m batchgen.tools.make_tiny_vlm OUT_DIR --family qwen2_5_vl
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from batchgen.tools.make_tiny_model import (
    BOS_ID,
    EOS_ID,
    INIT_STD,
    PAD_ID,
    build_tokenizer,
    reinit_weights,
)

BASE_VOCAB = 512  # the byte-level BPE's ids; the family's special tokens follow
TEXT_VOCAB = 576  # the decoder's rows (room for the specials)
_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": TEXT_VOCAB,
         "max_position_embeddings": 1024, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID,
         "eos_token_id": EOS_ID, "tie_word_embeddings": False}
_IDS = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}

# the text a user writes for one image, per family (the processor expands it)
IMAGE_PLACEHOLDER = {
    "llava": "<image>", "llava_next": "<image>", "idefics3": "<image>", "smolvlm": "<image>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
}
FAMILIES = tuple(IMAGE_PLACEHOLDER)


def _tokenizer(specials: list[str], extra: dict[str, str] | None = None) -> Any:
    """The shared byte-level BPE with the family's special tokens appended (ids 512...)."""
    tok = copy.deepcopy(build_tokenizer(BASE_VOCAB))
    tok.add_special_tokens({"additional_special_tokens": specials})
    if extra:  # named special tokens (saved in the tokenizer config), as Gemma 3's
        tok._set_model_specific_special_tokens(special_tokens=dict(extra))
    return tok


def _llava() -> tuple[Any, Any]:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = _tokenizer(["<image>"])
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=16, patch_size=4,
                              projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_TEXT),
                         image_token_id=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, vision_feature_select_strategy="default",
                         **_IDS)
    images = CLIPImageProcessorPil(size={"shortest_edge": 16},
                                   crop_size={"height": 16, "width": 16})
    return config, LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=4,
                                  vision_feature_select_strategy="default",
                                  num_additional_image_tokens=1)


def _llava_next() -> tuple[Any, Any]:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextProcessor,
    )
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    tok = _tokenizer(["<image>"])
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=8, patch_size=4,
                              projection_dim=32)
    grid = [[8, 16], [16, 8], [16, 16]]
    config = LlavaNextConfig(vision_config=vision, text_config=LlamaConfig(**_TEXT),
                             image_token_id=tok.convert_tokens_to_ids("<image>"),
                             vision_feature_layer=-1, image_grid_pinpoints=grid,
                             vision_feature_select_strategy="default", **_IDS)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 8},
                                        crop_size={"height": 8, "width": 8},
                                        image_grid_pinpoints=grid)
    return config, LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=4,
                                      vision_feature_select_strategy="default",
                                      num_additional_image_tokens=1)


def _idefics3(family: str = "idefics3") -> tuple[Any, Any]:
    from transformers import AutoConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    specials = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
    specials += [f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]
    tok = _tokenizer(specials)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 16, "patch_size": 4}
    config = AutoConfig.for_model(family, vision_config=vision, text_config=dict(_TEXT),
                                  image_token_id=tok.convert_tokens_to_ids("<image>"),
                                  scale_factor=2, **_IDS)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 32},
                                       max_image_size={"longest_edge": 16})
    if family == "smolvlm":
        from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

        from batchgen.multimodal.processor import image_only

        return config, image_only(SmolVLMProcessor)(image_processor=images, tokenizer=tok,
                                                    image_seq_len=4)
    return config, Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4)


_QWEN_SPECIALS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]


def _qwen_ids(tok: Any) -> dict[str, int]:
    ids = tok.convert_tokens_to_ids(_QWEN_SPECIALS)
    return dict(zip(("image_token_id", "video_token_id", "vision_start_token_id",
                     "vision_end_token_id"), ids))


def _qwen2_5_vl() -> tuple[Any, Any]:
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from batchgen.multimodal.processor import image_only

    tok = _tokenizer(_QWEN_SPECIALS)
    text = dict(_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "mrope_section": [2, 3, 3]})
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "window_size": 16, "fullatt_block_indexes": [1]}
    config = AutoConfig.for_model("qwen2_5_vl", text_config=text, vision_config=vision,
                                  **_qwen_ids(tok), **_IDS)
    images = Qwen2VLImageProcessorPil(min_pixels=8 * 8, max_pixels=32 * 32, patch_size=4,
                                      merge_size=2, temporal_patch_size=2)
    return config, image_only(Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tok)


def _qwen3_vl() -> tuple[Any, Any]:
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from batchgen.multimodal.processor import image_only

    tok = _tokenizer(_QWEN_SPECIALS)
    text = dict(_TEXT, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
        "mrope_interleaved": True})
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0, 1]}
    config = AutoConfig.for_model("qwen3_vl", text_config=text, vision_config=vision,
                                  **_qwen_ids(tok), **_IDS)
    images = Qwen2VLImageProcessorPil(min_pixels=8 * 8, max_pixels=32 * 32, patch_size=4,
                                      merge_size=2, temporal_patch_size=2)
    return config, image_only(Qwen3VLProcessor)(image_processor=images, tokenizer=tok)


def _gemma3() -> tuple[Any, Any]:
    from transformers import AutoConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    tok = _tokenizer(["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
                     {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                      "image_token": "<image_soft_token>"})
    boi, eoi, img = tok.convert_tokens_to_ids(
        ["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    text = dict(_TEXT, head_dim=64, sliding_window=8, num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"])
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 16, "patch_size": 4}
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision,
                                  mm_tokens_per_image=16, boi_token_index=boi,
                                  eoi_token_index=eoi, image_token_index=img, **_IDS)
    images = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    return config, Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=16)


def _gemma3_weights(model: torch.nn.Module) -> None:
    """Gemma 3's image projection starts at zero (its image would be invisible) and its
    embeddings are scaled by sqrt(hidden) (the last token would drown the rest): a random
    projection and embeddings drawn that much smaller, so outputs depend on image and text."""
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, INIT_STD)
        emb = model.get_input_embeddings()
        emb.weight.mul_(1.0 / emb.embed_scale.item())


BUILDERS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "llava": _llava, "llava_next": _llava_next, "idefics3": _idefics3,
    "smolvlm": lambda: _idefics3("smolvlm"), "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl, "gemma3": _gemma3,
}


def make_tiny_vlm(out_dir: str | Path, family: str = "llava", seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> Path:
    """Write a random tiny `family` VLM with its processor to `out_dir`; return the path."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if family not in BUILDERS:
        raise ValueError(f"family must be one of {sorted(BUILDERS)}, got {family!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config, processor = BUILDERS[family]()
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    reinit_weights(model)
    if family == "gemma3":
        _gemma3_weights(model)
    model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(**_IDS)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    _null_unk(out)
    return out


def _null_unk(out: Path) -> None:
    """An explicit null unk token, as make_tiny_model writes it (AutoTokenizer's family
    classes would otherwise add one)."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.setdefault("unk_token", None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--family", default="llava", choices=sorted(BUILDERS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(make_tiny_vlm(args.out_dir, args.family, args.seed))


if __name__ == "__main__":
    main()

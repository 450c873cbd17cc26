"""Tiny configs for every text causal-LM family of the installed transformers, for the family
matrix (tests/test_families.py) and the hybrid work.

Each config comes from the family's own config class (`AutoConfig.for_model`) with the shared
tiny sizes below set only where the class has the field, so every family keeps its own
layer-type pattern (windows, sinks, MLA, MoE, alternating and hybrid layers): 4 layers, hidden
64, 4 heads / 2 KV heads, sliding windows of 8 (short prompts cross them), small MoE, MLA and
state sizes. `FAMILY_OVERRIDES` fixes the families whose own checks need other values.
`NOT_SHRUNK` names the causal-LM families left out, and why.

`MATRIX` is what the matrix expects of each family ("parity" or "refused"). A family of the
installed transformers it does not list is judged all the same and reported (NewFamilyWarning,
a terminal-summary line), never an error; an expected family the installed transformers lacks
is skipped when `ADDED_IN` says it is newer, and is a stale expectation otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB = 512
WINDOW = 8

TINY: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 16, "vocab_size": VOCAB,
    "max_position_embeddings": 1024, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_group": 2, "topk_group": 1, "n_layer": 4, "n_head": 4, "n_embd": 64, "d_model": 64,
    "num_layers": 4, "n_positions": 1024, "sliding_window": WINDOW,
    "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    "tie_word_embeddings": False,
}

# MLA families: the config's head_dim is the rope part (qk_rope_head_dim), set by the class;
_MLA = {"head_dim": None, "num_key_value_heads": 4}  # K/V per query head, as the real ones
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite",
                     "glm_moe_dsa", "longcat_flash", "minicpm3", "sarvam_mla", "youtu",
                     "axk1", "axk2", "hy_v4", "kimi_linear", "bailing_hybrid"), _MLA),
    "gemma3_text": {"num_hidden_layers": 6},  # its 5 sliding : 1 full pattern
    "codegen": {"head_dim": None, "rotary_dim": 8},
    "gptj": {"head_dim": None, "rotary_dim": 8},
    "mamba2": {"head_dim": 16, "num_heads": 8, "expand": 2, "n_groups": 1, "chunk_size": 8},
    "dots3_note_text": {"num_key_value_heads": 4},
    "zamba2": {"layer_types": ["mamba", "hybrid", "mamba", "hybrid"]},
    "zaya": {"num_experts_per_tok": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "cohere_compass_text": {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    **dict.fromkeys(("lfm2", "lfm2_moe"),
                    {"layer_types": ["conv", "conv", "full_attention", "conv"]}),
    # hybrids: attention among the mixers within 4 layers (HF's own generate needs one)
    # SSD scans pad every forward to their chunk size (256 by default): 8 keeps them fast
    "bamba": {"attn_layer_indices": [1, 3], "mamba_chunk_size": 8},
    # the mixers' own defaults are model-sized (128 heads, states of 128-256): tiny ones keep
    # the parity checks and make each forward ~10x cheaper
    "falcon_h1": {"mamba_chunk_size": 8, "mamba_n_heads": 8, "mamba_d_head": 16,
                  "mamba_d_ssm": 128, "mamba_d_state": 16},
    "nemotron_h": {"chunk_size": 8},  # (small mixers made its HF output blind to far context)
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), {
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4}),
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"],
                         "mamba_chunk_size": 8},
    "bailing_hybrid": {**_MLA, "layer_group_size": 2},
    "kimi_linear": {**_MLA, "linear_attn_config": {
        "full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 4, "head_dim": 16,
        "short_conv_kernel_size": 4}},
    # its dense first block and shared experts have their own (model-sized) widths
    "ergo": {"first_dense_intermediate_size": 128, "shared_intermediate_size": 32},
    # every 5th layer is indexed (sparse) attention: 5 layers keep one; the indexer scores
    # keys with at most the query heads of one KV head (2 here)
    "kolibri1_1": {"num_hidden_layers": 5, "index_num_heads": 2},
}

# Kimi-K2 is a DeepSeek-V3 (model_type "deepseek_v3") with its own shape: no q LoRA, more
# routed experts, one dense layer first; a separate matrix entry.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "kimi_k2": ("deepseek_v3", {"q_lora_rank": None, "n_routed_experts": 8,
                                "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
}

NOT_SHRUNK: dict[str, str] = {
    "blt": "byte latent transformer: patcher and local encoder/decoder, no shared tiny shape",
    "emu3": "image-generation model (VQ-VAE and text), not a text decoder",
    "fuyu": "image-text model built around a vision patch embedding",
    "gemma3": "multimodal: its text decoder is the gemma3_text entry",
    "gemma3n": "multimodal (audio/vision towers): its text decoder is gemma3n_text",
    "gemma4": "multimodal: its text decoder is the gemma4_text entry",
    "gemma4_unified": "multimodal: its text decoder is gemma4_unified_text",
    "gemma4_assistant": "draft head of gemma4 (needs a target model)",
    "gemma4_unified_assistant": "draft head of gemma4_unified (needs a target model)",
    "llama4": "multimodal: its text decoder is the llama4_text entry",
    "mllama": "multimodal (cross-attention image layers)",
    "qwen3_5": "multimodal: its text decoder is the qwen3_5_text entry",
    "qwen3_5_moe": "multimodal: its text decoder is qwen3_5_moe_text",
    "dots3_note": "multimodal: its text decoder is dots3_note_text",
    "qwen4_exp": "multimodal: its text decoder is qwen4_exp_text",
    "musicgen": "audio-codebook decoder (several token streams)",
    "musicgen_melody": "audio-codebook decoder (several token streams)",
    "moshi": "speech-text model (audio codebooks)",
    "whisper": "speech encoder-decoder",
    "trocr": "decoder of an image encoder-decoder",
    "git": "image-text model",
    "got_ocr2": "OCR image-text model",
    "moss_transcribe_diarize": "speech model",
    "phi4_multimodal": "multimodal (audio/vision towers)",
    "xmod": "needs a language adapter chosen at call time",
    "reformer": "LSH/local attention with its own cache, no tiny generic shape",
    "xlnet": "permutation language model without a causal length limit",
    "prophetnet": "n-gram encoder-decoder",
}


def families() -> list[str]:
    """Every causal-LM family of the installed transformers that is shrunk here, plus the
    variants, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(NOT_SHRUNK)
    return sorted(names | {v for v, (base, _) in VARIANTS.items() if base in names})


class NewFamilyWarning(UserWarning):
    """A family of the installed transformers that MATRIX has no expectation for: the matrix
    judged it like the others; add it to PARITY_FAMILIES or REFUSED_FAMILIES."""


def new_families() -> list[str]:
    """Families of the installed transformers without an expectation in MATRIX."""
    return sorted(set(families()) - set(MATRIX))


def matrix_families() -> list[str]:
    """What the matrix runs: every installed family and every expected one, sorted."""
    return sorted(set(families()) | set(MATRIX))


def transformers_version() -> Any:
    """The installed transformers' version (a packaging Version)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__)


def newer_than_installed(family: str) -> bool:
    """Whether `family` is new in a transformers newer than the installed one (ADDED_IN)."""
    from packaging.version import Version

    return family in ADDED_IN and transformers_version() < Version(ADDED_IN[family])


def not_installed(family: str) -> str | None:
    """Why an expected `family` is not run (the installed transformers lacks it), or None."""
    if family in families():
        return None
    if newer_than_installed(family):
        return (f"{family} is new in transformers {ADDED_IN[family]}, installed "
                f"{transformers_version()}")
    return (f"{family} is not in the installed transformers {transformers_version()}: a stale "
            "expectation (test_the_matrix_covers_every_family fails on it)")


def _settable(config: Any, name: str) -> bool:
    """Whether `config` has an attribute `name` a constructor keyword may set (not a
    read-only property such as FalconConfig.head_dim)."""
    prop = getattr(type(config), name, None)
    return hasattr(config, name) and not (isinstance(prop, property) and prop.fset is None)


def tiny_config(family: str, **overrides: Any) -> Any:
    """The tiny config of `family` (a model_type or a variant name), fp32."""
    from transformers import AutoConfig

    model_type, extra = VARIANTS.get(family, (family, {}))
    base = AutoConfig.for_model(model_type)
    fields = set(base.to_dict())
    kw = {k: v for k, v in TINY.items() if k in fields or _settable(base, k)}
    if getattr(base, "sliding_window", None) is None:
        kw.pop("sliding_window", None)  # a family without a default window keeps none
    kw.update(FAMILY_OVERRIDES.get(model_type, {}))
    kw.update(extra)
    kw.update(overrides)
    kw = {k: v for k, v in kw.items() if not (v is None and k == "head_dim")}
    config = AutoConfig.for_model(model_type, **kw)
    config.dtype = torch.float32
    return config


def save_family_model(family: str, out_dir: str | Path, seed: int = 0,
                      **overrides: Any) -> Path:
    """Write a random tiny `family` model (weights, config, generation config) to `out_dir`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from batchgen.tools.make_tiny_model import reinit_weights

    out = Path(out_dir)
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reinit_weights(model)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                               pad_token_id=PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_family_config(family: str, out_dir: str | Path, **overrides: Any) -> Path:
    """Write only `family`'s tiny config.json (enough for a refusal before weights load)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny_config(family, **overrides).save_pretrained(out)
    return out
# Families equal to HF greedy (tests/test_families.py), and families refused before weights.
PARITY_FAMILIES = (
    'afmoe', 'apertus', 'apertus1p5_text', 'arcee', 'aria_text', 'axk1', 'bailing_hybrid', 'bamba',
    'beam', 'biogpt', 'bitnet', 'codegen', 'cohere', 'cohere2', 'cohere2_moe',
    'cohere_compass_text', 'ctrl', 'cwm', 'dbrx', 'deepseek_v2', 'deepseek_v3', 'doge', 'dots1',
    'ergo', 'ernie4_5', 'ernie4_5_moe', 'exaone', 'exaone4', 'exaone_moe', 'falcon_h1',
    'falcon_mamba', 'flex_olmo', 'flint', 'gemma', 'gemma2', 'gemma3_text', 'glm', 'glm4',
    'glm4_moe', 'glm4_moe_lite', 'gpt-sw3', 'gpt2', 'gpt_bigcode', 'gpt_neox', 'gpt_oss', 'gptj',
    'granite', 'granite_swa', 'granitemoe', 'granitemoe_swa', 'granitemoehybrid',
    'granitemoeshared', 'helium', 'hunyuan_v1_dense', 'hunyuan_v1_moe', 'hy_v3', 'hyperclovax',
    'internlm3', 'iquestcoder', 'jais2', 'jamba', 'kimi_k2', 'kimi_linear', 'kolibri1', 'laguna',
    'lara_mini', 'lfm2', 'lfm2_moe', 'lfm3', 'llama', 'mamba', 'mamba2', 'mellum', 'minicpm3',
    'minicpm5_moe', 'minimax', 'minimax_m2', 'minimax_m3_vl_text', 'ministral', 'ministral3',
    'mistral', 'mixtral', 'modernbert-decoder', 'nanochat', 'nemotron_h', 'olmo', 'olmo2', 'olmo3',
    'olmo_hybrid', 'olmoe', 'opt', 'param2moe', 'persimmon', 'phi', 'phi3', 'phimoe', 'qwen2',
    'qwen2_moe', 'qwen3', 'qwen3_5_moe_text', 'qwen3_5_text', 'qwen3_moe', 'qwen3_next',
    'sarvam_mla', 'sarvam_moe', 'seed_oss', 'smollm3', 'solar_open', 'starcoder2', 'vaultgemma',
    'youtu', 'zaya',
)
REFUSED_FAMILIES = (
    'axk2', 'bart', 'bert', 'bert-generation', 'big_bird', 'bigbird_pegasus', 'blenderbot',
    'blenderbot-small', 'bloom', 'camembert', 'cpmant', 'data2vec-text', 'deepseek_v32',
    'deepseek_v4', 'diffllama', 'dory', 'dots3_note_text', 'electra', 'ernie', 'falcon',
    'gemma3n_text', 'gemma4_text', 'gemma4_unified_text', 'glm_moe_dsa', 'gpt_neo',
    'gpt_neox_japanese', 'hrm_text', 'hy_v4', 'inkling2_loop_text', 'inkling2_text',
    'inkling_text', 'jetmoe', 'kolibri1_1', 'llama4_text', 'longcat_flash', 'marian', 'mbart',
    'megatron-bert', 'mimo_v2_flash', 'mpt', 'mvp', 'nemotron', 'openai-gpt', 'pegasus', 'plbart',
    'qwen4_exp_text', 'recurrent_gemma', 'rembert', 'roberta', 'roberta-prelayernorm', 'roc_bert',
    'roformer', 'rwkv', 'stablelm', 'xglm', 'xlm', 'xlm-roberta', 'xlm-roberta-xl', 'xlstm',
    'zamba', 'zamba2',
)
MATRIX = {**dict.fromkeys(PARITY_FAMILIES, "parity"), **dict.fromkeys(REFUSED_FAMILIES, "refused")}
# Families newer than the oldest transformers the matrix runs under (5.24): under an older one
# their expectations are skipped; any other expected family missing is a stale expectation.
ADDED_IN = dict.fromkeys(("ergo", "kolibri1_1", "minicpm5_moe", "param2moe"), "5.25.0")

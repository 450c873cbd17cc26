"""Tiny configs of every hybrid / state-space family in transformers 5.24 (hidden 64, 4 layers,
mixers interleaved with attention where the family has both), for the state pool's parity
tests. Small conv kernels, state sizes and chunk sizes keep them fast on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 128
_COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=256,
                               tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2)
_MAMBA: dict[str, Any] = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                              mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
                              mamba_chunk_size=8)
_GDN: dict[str, Any] = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4)
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32)
_LINEAR_FULL = ["linear_attention", "full_attention", "linear_attention", "full_attention"]

# model_type -> the config's own arguments (beyond _COMMON)
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(_GDN, **_MOE, layer_types=_LINEAR_FULL, head_dim=16,
                       decoder_sparse_step=1),
    "qwen3_5_text": dict(_GDN, layer_types=_LINEAR_FULL, head_dim=16),
    "granitemoehybrid": dict(_MAMBA, layer_types=["mamba", "attention", "mamba", "attention"],
                             num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=32),
    "nemotron_h": dict(_MAMBA, layers_block_type=["mamba", "attention", "mamba", "mlp"],
                       head_dim=16, ssm_state_size=8, conv_kernel=4, n_groups=1,
                       mamba_num_heads=4, mamba_head_dim=32, chunk_size=8, expand=2),
    "jamba": dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
                  num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False),
    "bamba": dict(_MAMBA, attn_layer_indices=[1, 3]),
    "falcon_h1": dict(_MAMBA, head_dim=16, mamba_d_ssm=128),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"],
                 conv_L_cache=3, block_dim=64, block_ff_dim=96),
    "kimi_linear": dict(**_MOE, num_key_value_heads=4, linear_attn_config=dict(
        full_attn_layers=[2, 4], kda_layers=[1, 3], num_heads=4, head_dim=16,
        short_conv_kernel_size=4), kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=0, qk_rope_head_dim=16, v_head_dim=16),
    "olmo_hybrid": dict(layer_types=_LINEAR_FULL, head_dim=16, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_conv_kernel_dim=4),
    "minimax": dict(layer_types=_LINEAR_FULL, head_dim=16, block_size=8,
                    num_local_experts=4, num_experts_per_tok=2),
    "mamba2": dict(num_heads=4, head_dim=32, state_size=8, n_groups=1, conv_kernel=4,
                   expand=2, chunk_size=8),
}


def family_config(model_type: str) -> Any:
    """The family's tiny config (transformers' own class)."""
    from transformers import AutoConfig

    kwargs = dict(_COMMON, **FAMILIES[model_type])
    return AutoConfig.for_model(model_type, **kwargs)


def make_family_model(model_type: str, folder: Path, seed: int = 0) -> Path:
    """Save a tiny random model of the family in `folder` (fp32 safetensors); returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(model_type), dtype=torch.float32)
    with torch.no_grad():  # random biases/decays so every state path matters
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "A_log", "D")) or "conv" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder

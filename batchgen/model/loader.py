"""Local HF model folder → (model with batchgen attention, tokenizer or None, KV geometry)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

if TYPE_CHECKING:  # transformers' model code is imported when a model loads, not before
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import GenerationConfig, PretrainedConfig

from batchgen.attention.mla import mla_cache_mode
from batchgen.model.families import (
    ModelLayout,
    attention_layout,
    check_served,
    classify,
    text_config,
)
from batchgen.model.submesh import sharded_class
from batchgen.model.versions import check_transformers
from batchgen.multimodal.families import check_vision

# RoPE scalings that depend on the longest sequence in the packed batch (batch-dependent output).
UNSUPPORTED_ROPE = ("dynamic", "longrope")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass(frozen=True)
class KVGeometry:
    """What the KV pool needs from the model config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int  # the keys' width
    max_position_embeddings: int | None
    head_dim_v: int | None = None  # the values' width when it differs (MLA decompressed)
    latent: bool = False  # an MLA latent: one head of lora + rope, values its first lora
    kv_layers: tuple[int, ...] | None = None  # the layers holding K/V (None: every layer)

    @property
    def num_kv_layers(self) -> int:
        """L of β: the layers that keep K/V rows in the pool (a hybrid's attention ones)."""
        return self.num_layers if self.kv_layers is None else len(self.kv_layers)

    @property
    def stored_v_width(self) -> int:
        """Values' width the pool stores apart from the keys (0: a latent's are its keys')."""
        return 0 if self.latent else (self.head_dim_v or self.head_dim)


def resolve_model_dir(model: object, name: str = "model", marker: str = "config.json"
                      ) -> Path:
    """A local model folder: a path (`~` expanded), or a hub id ("org/name", or "name" as
    "gpt2" is) already in the local Hugging Face cache (looked up offline, as transformers would load it). A ValueError
    naming `name` says how to get a missing one; a model object is a TypeError."""
    if isinstance(model, torch.nn.Module):
        raise TypeError(f"{name} must be a folder or a hub id, not a {type(model).__name__} "
                        "object: save it with .save_pretrained(folder) and pass the folder")
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"{name} must be the path of a local HuggingFace model folder or a "
                         f"hub id, got {type(model).__name__}")
    path = Path(os.path.expanduser(os.fspath(model)))
    if not path.exists() and isinstance(model, str) and _hub_id_shaped(model):
        path = _cached_snapshot(model, name)
    if not (path.is_dir() and any((path / m).is_file() for m in marker.split("|"))):
        raise ValueError(f"{name} must be a local HuggingFace folder containing {marker}, or "
                         f"a hub id in the local cache, got {str(model)!r}")
    return path


def _hub_id_shaped(model: str) -> bool:
    """Whether a missing path could be a hub id: "name" or "org/name", not a path that starts
    at a root, a home or a dot."""
    return model.count("/") <= 1 and not model.startswith(("/", ".", "~")) and bool(model)


def _cached_snapshot(repo_id: str, name: str) -> Path:
    """The folder of a hub model in the local HF cache (no download: batchgen runs offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as e:
        raise ValueError(
            f"{name}={repo_id!r} is not a local folder and not in the Hugging Face cache; "
            f"download it first (`hf download {repo_id}`, or `huggingface-cli download "
            f"{repo_id}`) or pass a folder") from e


def check_weights(path: Path) -> None:
    """Every safetensors file's header reads (cheap: no tensor is loaded); a ValueError naming
    the file otherwise. Runs before the weights load."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(path)!r} has no *.safetensors weights")
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                st.keys()
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"model weights {str(f)!r} cannot be read: {e}") from e


def check_supported(config: PretrainedConfig) -> ModelLayout:
    """Refuse model families, layer kinds and RoPE scalings that batchgen cannot run exactly,
    and state mixers on an unverified transformers, from the config alone (before any weights
    are read); return the layers' classes."""
    check_vision(config)
    layout = classify(config)
    check_served(layout)
    check_transformers(layout.family, layout.mixer_kinds)
    for attr in ("rope_scaling", "rope_parameters"):
        rope = getattr(config, attr, None)
        if isinstance(rope, dict):
            kinds = {rope.get("rope_type"), rope.get("type")}
            kinds |= {v.get("rope_type") for v in rope.values() if isinstance(v, dict)}
            bad = kinds & set(UNSUPPORTED_ROPE)
            if bad:
                raise ValueError(
                    f"RoPE scaling {bad.pop()!r} is not supported: it depends on the longest "
                    f"sequence in the batch (unsupported: {', '.join(UNSUPPORTED_ROPE)})")
    return layout


def resolve_dtype(dtype: str | torch.dtype, config: PretrainedConfig) -> torch.dtype:
    """"auto" honours the config's dtype (float32 if it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(cfg, torch.dtype):
            return cfg
        return _DTYPES.get(str(cfg).replace("torch.", ""), torch.float32) if cfg else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto', a torch dtype or one of {sorted(_DTYPES)}, "
                         f"got {dtype!r}")
    return _DTYPES[dtype]


def kv_geometry(config: PretrainedConfig, latent: bool | None = None) -> KVGeometry:
    """Layers, KV heads and K/V widths of the attention layers, from the config. MLA layers
    (DeepSeek-V2/V3, Kimi-K2) keep their latent: one head of kv_lora_rank + qk_rope_head_dim
    (attention/mla.py); decompressed (BATCHGEN_MLA_CACHE=decompressed) they hand attention
    keys of qk_nope + qk_rope and values of v_head_dim per query head (the config's head_dim
    is only the rope part). `latent=False` asks for the decompressed cache whatever the
    variable says (a caller's shared module must keep its own expand_kv)."""
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    if not heads:  # a pure state-space model (mamba2): no attention layer reads the pool
        return KVGeometry(text.num_hidden_layers, 1, 1,
                          getattr(text, "max_position_embeddings", None))
    max_pos = getattr(text, "max_position_embeddings", None)
    wants_latent = mla_cache_mode() == "latent" if latent is None else latent
    if attention_layout(text) == "mla" and wants_latent:
        lora = int(text.kv_lora_rank)
        return KVGeometry(text.num_hidden_layers, 1, lora + int(text.qk_rope_head_dim),
                          max_pos, lora, latent=True)
    if attention_layout(text) == "mla":
        k_dim = int(text.qk_nope_head_dim) + int(text.qk_rope_head_dim)
        v_dim = int(getattr(text, "v_head_dim", None) or k_dim)
        return KVGeometry(text.num_hidden_layers, heads, k_dim, max_pos,
                          None if v_dim == k_dim else v_dim)
    kv_heads = (1 if getattr(text, "multi_query", False)  # gpt_bigcode's MQA flag
                else getattr(text, "num_key_value_heads", None) or heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return KVGeometry(text.num_hidden_layers, kv_heads, head_dim, max_pos)


def with_kv_layers(geo: KVGeometry, attention_layers: tuple[int, ...] | None) -> KVGeometry:
    """The geometry with only these layers holding K/V (a hybrid's mixer layers keep state,
    not K/V); a model without any keeps one stand-in layer of one 1-wide head so the pool's
    arithmetic stands (nothing reads it)."""
    if attention_layers is None:
        return geo
    if not attention_layers:
        return replace(geo, num_kv_heads=1, head_dim=1, head_dim_v=None, latent=False,
                       kv_layers=(0,))
    return replace(geo, kv_layers=tuple(attention_layers))


TOKENIZER_FILES = "tokenizer.json|tokenizer_config.json|tokenizer.model|vocab.json"


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The folder's tokenizer, or None when it ships none (token-id prompts still work)."""
    if not any((path / n).exists() for n in TOKENIZER_FILES.split("|")):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    # batchgen checks every prompt against max_model_len itself (an error naming the prompt);
    # transformers' warning about the tokenizer's own model_max_length would be a second,
    # misleading line
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def load_model(path: Path, config: PretrainedConfig, dtype: torch.dtype,
               device: torch.device, trust_remote_code: bool = False, tp_size: int = 1,
               tp_mesh: DeviceMesh | None = None, quant: dict[str, Any] | None = None,
               vision: bool = False) -> torch.nn.Module:
    """Load safetensors weights with batchgen's attention registered and selected, straight
    onto `device` (device_map: quantizers place their packed tensors themselves, with no
    full-precision copy elsewhere first); `quant`: from_pretrained's quantization keywords
    (batchgen/quantization: a GGUF file, an online method's config). With tp_size > 1, this
    rank's shard, split by transformers' own tensor-parallel plan over the whole world (a
    process group of that size) or over `tp_mesh`'s "tp" dimension (a subgroup:
    model/submesh.py). `vision`: an image-text-to-text model whose text decoder alone attends
    through batchgen (its vision tower keeps SDPA)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    from batchgen.attention.interface import register

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one quiet load instead of a bar per call
    extra = ({"device_map": device} if tp_size == 1
             else {"distributed_config": _distributed_config(tp_size)})
    extra.update(quant or {})
    cls = (AutoModelForCausalLM if tp_mesh is None or tp_size == 1
           else sharded_class(config, tp_mesh, device))
    attn: str | dict[str, str] = register()
    if vision:
        cls = AutoModelForImageTextToText
        attn = {name: attn if name == "text_config" else "sdpa" for name in config.sub_configs}
        attn[""] = "sdpa"
    try:
        model = cls.from_pretrained(
            path, config=config, dtype=dtype, attn_implementation=attn,
            trust_remote_code=trust_remote_code, **extra)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    return model.eval()


def _distributed_config(tp_size: int) -> Any:
    """transformers' tensor-parallel setting (torch.distributed.tensor: imported only here)."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=tp_size)


def load_generation_config(path: Path) -> GenerationConfig | None:
    """The folder's generation_config.json (for its EOS ids), or None."""
    if not (path / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(path)


def load_config(path: Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The folder's config (AutoConfig), refused when its family or RoPE is unsupported."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    check_supported(config)
    return config


def pad_id(config: PretrainedConfig, generation_config: GenerationConfig | None) -> int | None:
    """The pad id HF generate uses: the generation config's, else the model config's (None:
    HF falls back to the first EOS id)."""
    for source in (generation_config, config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return None


def eos_ids(config: PretrainedConfig, generation_config: GenerationConfig | None,
            tokenizer: Any) -> list[int]:
    """Every id that ends a sequence as EOS: the config's, the generation config's (e.g. a chat
    model's end-of-turn id) and the tokenizer's, as HF generate and vLLM do."""
    ids: list[int] = []
    sources = [getattr(config, "eos_token_id", None),
               getattr(generation_config, "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None)]
    for eos in sources:
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return ids

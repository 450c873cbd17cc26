"""Tiny random models quantized by each library's own API and saved as real folders (or a
single .gguf file): the inputs of tests/test_quantization.py. Each builder starts from a tiny
fp32 folder (batchgen.tools.make_tiny_model or tests/families.py) and writes a new folder that
transformers' own quantizer for that method loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

FP8_MAX = 448.0


def _load(src: Path, **kw: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()


def _copy_tokenizer(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)


def compressed_tensors(src: Path, out: Path, scheme: str, kv_scales: bool = False) -> Path:
    """compressed-tensors' own API, as llm-compressor saves: `scheme` "int8" (W8A16: int8
    weights, one scale per output channel), "int4" (W4A16: int4 packed, one scale per group of
    32) or "fp8" (W8A8: fp8 weights per channel, fp8 activations per token, dynamic); `kv_scales`: a `kv_cache_scheme` (fp8, per tensor) with
    each layer's k_scale / v_scale calibrated from the K/V of a few prompts, in llm-compressor's
    layout (`...self_attn.k_scale`). compressed-tensors 0.20 attaches a KV scheme only to
    attention modules whose forward takes `past_key_values`, which transformers 5.25's no
    longer does, so those tensors are written beside what its compressor saved."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _load(src)
    kind = {"int8": "int", "fp8": "float", "int4": "int"}[scheme]
    weights = (QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32,
                                symmetric=True) if scheme == "int4" else
               QuantizationArgs(num_bits=8, type=kind, strategy="channel", symmetric=True))
    acts = (QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True,
                             symmetric=True) if scheme == "fp8" else None)
    kv = (QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
          if kv_scales else None)
    amax = _kv_amax(model) if kv_scales else {}
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=acts)}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                w = module.weight
                if scheme == "int4":  # one scale per group of 32 inputs
                    w = w.reshape(w.shape[0], -1, 32)
                scale, zero = calculate_qparams(w.amin(-1, keepdim=scheme != "int4"),
                                                w.amax(-1, keepdim=scheme != "int4"),
                                                module.quantization_scheme.weights)
                module.weight_scale.data = scale.to(module.weight_scale.dtype)
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    if kv is not None:
        _write_kv_scales(out, amax, kv.model_dump())
    _copy_tokenizer(src, out)
    return out


def _write_kv_scales(out: Path, amax: dict[str, tuple[float, float]], scheme: dict | None
                     ) -> None:
    """Each attention module's k_scale / v_scale (amax / 448, float32 [1]) into the weights,
    the scheme (if any) into config.json's quantization_config."""
    from safetensors.torch import load_file, save_file

    f = out / "model.safetensors"
    tensors = load_file(f)
    for name, (k, v) in amax.items():
        tensors[f"{name}.k_scale"] = torch.tensor([k / FP8_MAX])
        tensors[f"{name}.v_scale"] = torch.tensor([v / FP8_MAX])
    save_file(tensors, f, metadata={"format": "pt"})
    if scheme is None:
        return
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = scheme
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


@torch.no_grad()
def _kv_amax(model: Any, n: int = 4, length: int = 24, prompts: list[list[int]] | None = None
             ) -> dict[str, tuple[float, float]]:
    """Each attention module's largest |K| and |V| over calibration prompts (`prompts`, else
    `n` random ones of `length` tokens)."""
    found: dict[str, list[float]] = {}
    hooks = []
    for name, module in model.named_modules():
        for proj, slot in (("k_proj", 0), ("v_proj", 1)):
            sub = getattr(module, proj, None)
            if isinstance(sub, torch.nn.Linear) and hasattr(module, "o_proj"):
                def hook(_m, _i, out, name=name, slot=slot):
                    cur = found.setdefault(name, [0.0, 0.0])
                    cur[slot] = max(cur[slot], float(out.abs().max()))
                hooks.append(sub.register_forward_hook(hook))
    g = torch.Generator().manual_seed(0)
    if prompts is None:
        model(input_ids=torch.randint(3, model.config.vocab_size, (n, length), generator=g))
    for p in prompts or []:
        model(input_ids=torch.tensor([p]))
    for h in hooks:
        h.remove()
    return {k: (v[0], v[1]) for k, v in found.items()}


def block_fp8(src: Path, out: Path, block: tuple[int, int] = (16, 16)) -> Path:
    """DeepSeek-V3's block FP8 layout, written as its checkpoints are: every Linear weight of
    the decoder layers (not the embeddings, router or head) as float8 e4m3 with one
    `weight_scale_inv` (the dequantisation multiplier, float32) per `block` tile, and a
    `quantization_config` {quant_method: fp8, weight_block_size}."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    files = sorted(out.glob("*.safetensors"))
    for f in files:
        tensors = load_file(f)
        for name in list(tensors):
            w = tensors[name]
            if not _block_quantizable(name, w, block):
                continue
            q, inv = _quantize_blocks(w.float(), block)
            tensors[name] = q
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = inv
        save_file(tensors, f, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _block_quantizable(name: str, w: torch.Tensor, block: tuple[int, int]) -> bool:
    """A 2-D projection weight of a decoder layer whose sides the block divides."""
    return (".layers." in name and name.endswith("_proj.weight") and w.dim() == 2
            and "gate.weight" not in name and w.shape[0] % block[0] == 0
            and w.shape[1] % block[1] == 0)


def _quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w → (float8 e4m3 weight, float32 scale_inv per tile) with w ≈ q · scale_inv."""
    r, c = w.shape[0] // block[0], w.shape[1] // block[1]
    tiles = w.reshape(r, block[0], c, block[1])
    inv = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), inv.float()


def bitsandbytes(src: Path, out: Path, bits: int) -> Path:
    """bitsandbytes' own quantization through transformers (8-bit LLM.int8, or 4-bit NF4),
    saved as its serialized folder. The 8-bit one has no outlier threshold: LLM.int8's split
    picks its fp16 columns from every row of the matmul, so with one its output depends on
    which sequences share a step (HF's own batched generate differs from one-by-one too)."""
    from transformers import BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0) if bits == 8
              else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    model = _load(src, quantization_config=config, device_map="cpu")
    model.save_pretrained(out)
    _copy_tokenizer(src, out)
    return out


def torchao_int8(src: Path, out: Path) -> Path:
    """torchao's int8 weight-only quantization through transformers' TorchAoConfig, saved."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    model = _load(src, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()),
                  device_map="cpu")
    model.save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(src, out)
    return out


# GGUF: llama.cpp's names and metadata for a llama, written with the gguf package's writer and
# quantizers. llama.cpp stores q/k rows in its own rotary order; transformers' GGUF loader
# reverses that permutation, so the writer applies it.
_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(name: str) -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    _, _, i, *rest = name.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{i}.{_GGUF_LAYER[module]}.{kind}"


def _rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's q/k rows (halves of each head) in llama.cpp's interleaved order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def gguf_file(src: Path, out_file: Path, qtype: str) -> Path:
    """A llama as one .gguf file: 2-D projection weights in `qtype` ("Q8_0", "Q4_0"), norms
    and embeddings in F32 (as llama.cpp keeps 1-D tensors), metadata from the HF config."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    writer = gguf.GGUFWriter(str(out_file), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    for name, t in tensors.items():
        data = t.float().numpy()
        if "q_proj" in name:
            data = _rotary_rows(data, cfg["num_attention_heads"])
        elif "k_proj" in name:
            data = _rotary_rows(data, cfg["num_key_value_heads"])
        if data.ndim == 2 and name != "model.embed_tokens.weight":
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(data, kind),
                              raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(name), data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def gguf_folder(src: Path, out: Path, qtype: str) -> Path:
    """A folder holding one .gguf file and the tokenizer's files (no config.json)."""
    out.mkdir(parents=True, exist_ok=True)
    gguf_file(src, out / f"model-{qtype}.gguf", qtype)
    _copy_tokenizer(src, out)
    return out


def mxfp4_gpt_oss(src: Path, out: Path, seed: int = 0) -> Path:
    """A gpt-oss whose experts are stored as gpt-oss ships them: MXFP4 (`*_blocks`: two e2m1
    values a byte, 32 per block; `*_scales`: one e8m0 exponent per block) with a
    `quantization_config` {quant_method: mxfp4}; the values are random (a random model)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    f = out / "model.safetensors"
    tensors = load_file(f)
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows_in, rows_out = tensors.pop(name).shape  # stored [E, in, out]
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (e, rows_out, rows_in // 32, 16),
                                                  generator=g, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(122, 126, (e, rows_out, rows_in // 32),
                                                  generator=g, dtype=torch.uint8)
    save_file(tensors, f, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def int4_checkpoint(src: Path, out: Path, method: str, group: int = 32) -> Path:
    """A GPTQ (v1 format, symmetric) or AWQ (GEMM format, zero point) 4-bit checkpoint of the
    decoder's projections, written by hand with round-to-nearest in each library's tensor
    layout (qweight / qzeros / scales int32-packed nibbles, GPTQ's g_idx): building one with
    calibration takes minutes on a CPU, and the test's oracle is HF loading the same folder."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        for name in [n for n in tensors if _block_quantizable(n, tensors[n], (8, group))]:
            w = tensors.pop(name).float()
            packed = _gptq_tensors(w, group) if method == "gptq" else _awq_tensors(w, group)
            tensors.update({name.removesuffix("weight") + k: v for k, v in packed.items()})
        save_file({k: (v.half() if v.is_floating_point() else v).contiguous()
               for k, v in tensors.items()}, f,
              metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float16"
    cfg["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
         "sym": True, "checkpoint_format": "gptq"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _pack(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values per int32 along the last dim (value order[k] in nibble k)."""
    q = q.to(torch.int64).reshape(*q.shape[:-1], -1, 8)
    word = sum(q[..., j] << (4 * k) for k, j in enumerate(order))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _gptq_tensors(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """GPTQ v1 symmetric: q = round(w / s) + 8 in [0, 15], zeros stored as 8 - 1."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    scale = (g.abs().amax(-1) * 2 / 15).clamp(min=1e-8)  # [out, groups]
    q = (g / scale[..., None]).round().add(8).clamp(0, 15).reshape(out_f, in_f)
    zeros = torch.full((in_f // group, out_f), 7)
    along_in = q.T.reshape(in_f // 8, 8, out_f).permute(0, 2, 1)  # [in/8, out, 8]
    return {"qweight": _pack(along_in).reshape(in_f // 8, out_f),
            "qzeros": _pack(zeros), "scales": scale.T.contiguous(),
            "g_idx": (torch.arange(in_f) // group).int()}


def _awq_tensors(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AWQ GEMM with zero points: q = round(w / s) + z in [0, 15], packed along the output
    dim in AWQ's nibble order."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)  # [out, groups]
    zero = (-lo / scale).round().clamp(0, 15)
    q = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, 15).reshape(out_f, in_f)
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return {"qweight": _pack(q.T, order), "qzeros": _pack(zero.T, order),
            "scales": scale.T.contiguous()}

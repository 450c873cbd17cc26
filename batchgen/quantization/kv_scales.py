"""An fp8 KV pool's per-layer scales from the checkpoint: llm-compressor's (compressed-tensors
`kv_cache_scheme`) and ModelOpt's FP8 checkpoints store each attention layer's calibrated
`k_scale` / `v_scale` (older ones one `kv_scale` for both), the dequantisation multipliers
vLLM reads. Read from the safetensors by name, only those tensors; per-head scales are
reduced to their largest (the pool keeps one scale per layer: a larger scale never
saturates, it only rounds more coarsely)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from batchgen.log import logger

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[\w.]*\.)?(k_scale|v_scale|kv_scale)$")


@dataclass(frozen=True)
class KVScales:
    """Per model layer: K's and V's dequantisation scale (1.0 where the checkpoint has none)."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    per_head: bool = False  # the checkpoint had per-head scales (reduced to their largest)
    missing: tuple[int, ...] = ()  # attention layers the checkpoint gave no scale


def checkpoint_kv_scales(path: Path, num_layers: int, kv_layers: tuple[int, ...] | None = None
                         ) -> KVScales | None:
    """The checkpoint's k/v scales per layer, or None when it has none (a folder without
    safetensors, a GGUF file, or a checkpoint never calibrated for an fp8 KV cache)."""
    found: dict[tuple[int, str], float] = {}
    per_head = False
    for f in sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []:
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                m = _NAME.search(key)
                if m is None:
                    continue
                t = st.get_tensor(key).float()
                per_head = per_head or t.numel() > 1
                value = float(t.abs().max())
                kinds = ("k_scale", "v_scale") if m.group(2) == "kv_scale" else (m.group(2),)
                for kind in kinds:
                    found[(int(m.group(1)), kind)] = value
    if not found:
        return None
    layers = range(num_layers) if kv_layers is None else kv_layers
    k = [1.0] * num_layers
    v = [1.0] * num_layers
    for i in layers:
        k[i] = found.get((i, "k_scale"), 1.0)
        v[i] = found.get((i, "v_scale"), 1.0)
    missing = tuple(i for i in layers if (i, "k_scale") not in found
                    or (i, "v_scale") not in found)
    return KVScales(tuple(k), tuple(v), per_head, missing)


def fp8_scales(path: Path | None, num_layers: int, kv_layers: tuple[int, ...] | None
               ) -> KVScales | None:
    """The scales an fp8 pool uses, each fact logged once: the checkpoint's, or None (1.0)
    with a warning that outliers saturate and small values round coarsely."""
    scales = checkpoint_kv_scales(path, num_layers, kv_layers) if path is not None else None
    if scales is None:
        logger.warning("kv_cache_dtype fp8: the checkpoint has no k/v scales (k_scale, "
                       "v_scale: an llm-compressor kv_cache_scheme); using 1.0, so K/V over "
                       "448 saturate and small ones lose precision")
        return None
    if scales.per_head:
        logger.info("kv_cache_dtype fp8: the checkpoint's per-head k/v scales are reduced to "
                    "each layer's largest (the pool keeps one scale per layer)")
    if scales.missing:
        logger.warning("kv_cache_dtype fp8: no k/v scale for layers %s in the checkpoint; "
                       "1.0 there", list(scales.missing))
    return scales

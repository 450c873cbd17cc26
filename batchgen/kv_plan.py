"""KV capacity planning from a model's config alone (no weights): β, blocks, concurrency.

The numbers come from the functions `LLM` sizes its pool with (`EngineConfig`, `kv_layout`,
`size_pool`, `CacheConfig`), so a plan's capacity line is, by construction, the line `LLM(model, kv_cache_memory=M, block_size=B, max_model_len=N,
kv_cache_dtype=..., swap_space=S)` logs. The swap pool is sized, not checked against this
machine's RAM (a plan is often made for another host).

β = 2 · L · H_kv · d_h · b bytes per token: K and V, every layer. batchgen's pool
`[L, 2, P+1, B, H_kv, d_h]` keeps every token of every layer, with one block table per
sequence, so sliding-window layers cost as much as full ones; `SlidingWindows` reports what a
window-aware allocator would save, which batchgen does not (yet).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchgen import config as engine_config
from batchgen import quantization
from batchgen.checks import check, is_number
from batchgen.config import CacheConfig, EngineConfig
from batchgen.defaults import format_bytes  # noqa: F401  (the notebooks import it from here)
from batchgen.kv.block_manager import blocks_for
from batchgen.kv.cache import kv_cache_bytes
from batchgen.model import loader
from batchgen.model.state_probe import config_state
from batchgen.multimodal.encoder import ENCODER_CACHE_BYTES
from batchgen.multimodal.families import vision_family

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class SlidingWindows:
    """Layers that attend over the last `window` tokens only (the current one included)."""

    window: int
    num_windowed: int
    num_layers: int

    @property
    def num_full(self) -> int:
        return self.num_layers - self.num_windowed

    def tokens_needed(self, seq_len: int) -> int:
        """Layer-tokens of KV a window-aware allocator keeps for one `seq_len` sequence:
        full layers × s + windowed layers × min(s, W)."""
        return self.num_full * seq_len + self.num_windowed * min(seq_len, self.window)


@dataclass(frozen=True)
class KvPlan:
    """The paged pool `LLM` would allocate for these settings, and what it holds."""

    model_type: str
    num_layers: int  # L: the layers holding K/V (a hybrid's mixer layers hold state instead)
    num_kv_heads: int  # H_kv
    head_dim: int  # d_h
    model_dtype: str
    kv_dtype: str
    dtype_bytes: int  # b
    block_size: int  # B
    num_blocks: int
    memory_bytes: int  # the budget the pool was sized from
    memory_is_default: bool  # the CPU default (no kv_cache_memory given)
    max_num_seqs: int
    model_max_len: int  # what the model allows (or max_model_len as given)
    max_model_len: int  # what LLM runs with: model_max_len capped by the pool
    sliding: SlidingWindows | None = None
    swap_space: float = 0  # GiB of host RAM for swapped-out blocks
    num_host_blocks: int = 0  # the swap pool's blocks: whole blocks of swap_space
    head_dim_v: int | None = None  # d_v when values are not d_h wide (MLA decompressed)
    latent: bool = False  # an MLA latent: one head of d_h = lora + rope, values inside it
    state_bytes_per_seq: int = 0  # state mixers: per sequence, whatever its length
    quantization: str | None = None  # the checkpoint's method (vLLM's name), from its config
    weight_bytes: int | None = None  # the checkpoint's weights as stored (None: not counted)
    weights_as: str = "as stored in the checkpoint"  # how weight_bytes was counted
    device_memory: int | None = None  # the device's bytes the KV budget was derived from
    encoder_cache_bytes: int = 0  # a vision-language model's image features beside the pool

    @property
    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.num_blocks, self.bytes_per_token,
                           self.num_host_blocks, self.state_bytes_per_seq,
                           self.max_num_seqs if self.state_bytes_per_seq else 0,
                           self.quantization)

    @property
    def host_bytes(self) -> int:
        """The swap pool: host blocks × block bytes (the same β as the device pool)."""
        return self.num_host_blocks * self.bytes_per_block

    @property
    def bytes_per_token(self) -> int:
        """β = 2 · L · H_kv · d_h · b (L · H_kv · (d_k + d_v) · b when the widths differ)."""
        return kv_cache_bytes(self.num_layers, self.num_kv_heads, self.head_dim, 1,
                              self.dtype_bytes,
                              head_dim_v=0 if self.latent else self.head_dim_v)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def seq_blocks(self) -> int:
        """Blocks one max_model_len sequence's block table holds."""
        return blocks_for(self.max_model_len, self.block_size)

    @property
    def seq_bytes(self) -> int:
        """KV of one max_model_len sequence, token-exact (s · β)."""
        return self.max_model_len * self.bytes_per_token

    @property
    def max_concurrency(self) -> float:
        return self.cache_config.max_concurrency(self.max_model_len)

    @property
    def capped_by_max_num_seqs(self) -> bool:
        """The default budget held more than max_num_seqs full sequences (LLM allocates no
        more than they can use)."""
        return self.memory_is_default and self.num_blocks < self.memory_bytes // (
            self.bytes_per_block)

    @property
    def windowed_seq_bytes(self) -> int | None:
        """KV of one max_model_len sequence if windowed layers kept only their window."""
        if self.sliding is None:
            return None
        per_layer_token = self.bytes_per_token // self.num_layers
        return self.sliding.tokens_needed(self.max_model_len) * per_layer_token

    def capacity_line(self) -> str:
        """The start-up line LLM logs for the same settings."""
        return self.cache_config.capacity_line(self.max_model_len)

    def to_dict(self) -> dict[str, Any]:
        """The plan and its derived figures, JSON-ready."""
        d = asdict(self)
        for name in ("bytes_per_token", "bytes_per_block", "num_tokens", "pool_bytes",
                     "seq_blocks", "seq_bytes", "max_concurrency", "capped_by_max_num_seqs",
                     "windowed_seq_bytes", "host_bytes"):
            d[name] = getattr(self, name)
        d["capacity_line"] = self.capacity_line()
        return d


def sliding_windows(config: PretrainedConfig) -> SlidingWindows | None:
    """Which layers slide, from transformers' config conventions: `layer_types` (Gemma 2/3,
    gpt-oss, Qwen2/3 in transformers 5), `use_sliding_window` + `max_window_layers` (older
    Qwen2), `sliding_window_pattern` (older Gemma 3), else every layer (Mistral, Phi-3)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not _positive_int(window) or getattr(text, "use_sliding_window", True) is False:
        return None
    num_layers = text.num_hidden_layers
    types = getattr(text, "layer_types", None)
    pattern = getattr(text, "sliding_window_pattern", None)
    if isinstance(types, (list, tuple)) and len(types) == num_layers:
        windowed = sum(t == "sliding_attention" for t in types)
    elif _positive_int(getattr(text, "max_window_layers", None)):
        windowed = max(0, num_layers - text.max_window_layers)
    elif _positive_int(pattern):
        windowed = sum((i + 1) % pattern != 0 for i in range(num_layers))
    else:
        windowed = num_layers
    return SlidingWindows(window, windowed, num_layers) if windowed else None


def _positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def plan_kv(config: PretrainedConfig, *, memory: int | None = None, block_size: int = 16,
            max_model_len: int | None = None, kv_cache_dtype: str = "auto",
            dtype: str | torch.dtype = "auto", max_num_seqs: int = 256,
            swap_space: float = 0, weight_bytes: int | None = None,
            device_memory: int | None = None, utilization: float = 0.9) -> KvPlan:
    """The pool `LLM(..., kv_cache_memory=memory, ...)` sizes for `config` (the CPU default
    budget when `memory` is None), with LLM's checks and ValueErrors, step for step; and the
    host swap pool of `swap_space` GiB. With `device_memory` (and no `memory`), the budget is
    what the weights (`weight_bytes`, quantized as stored) leave of `utilization` of it."""
    check(is_number(swap_space) and swap_space >= 0, "swap_space", "a number of GiB >= 0",
          swap_space)
    if memory is None and device_memory is not None:
        memory = kv_budget_after_weights(device_memory, weight_bytes or 0, utilization)
    cfg = EngineConfig(block_size=block_size, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype,
                       kv_cache_memory=memory)
    model_dtype = loader.resolve_dtype(dtype, config)
    state = config_state(config, model_dtype)
    geo = loader.with_kv_layers(loader.kv_geometry(config),
                                state.attention_layers if state is not None else None)
    layout = engine_config.kv_layout(cfg, geo, model_dtype)
    pool = engine_config.size_pool(cfg, layout, _CPU, None, swap_space)
    return KvPlan(
        model_type=str(getattr(config, "model_type", "")), num_layers=geo.num_kv_layers,
        num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
        model_dtype=_dtype_name(model_dtype), kv_dtype=_dtype_name(layout.kv_dtype),
        dtype_bytes=torch.empty((), dtype=layout.kv_dtype).element_size(),
        block_size=cfg.block_size, num_blocks=pool.num_blocks,
        memory_bytes=engine_config.DEFAULT_CPU_KV_BYTES if memory is None else memory,
        memory_is_default=memory is None, max_num_seqs=cfg.max_num_seqs,
        model_max_len=layout.target_len, max_model_len=pool.max_model_len,
        sliding=sliding_windows(config), swap_space=swap_space,
        num_host_blocks=pool.num_host_blocks, head_dim_v=geo.head_dim_v, latent=geo.latent,
        state_bytes_per_seq=state.bytes_per_seq if state is not None else 0,
        quantization=config_quantization(config), weight_bytes=weight_bytes,
        device_memory=device_memory,
        encoder_cache_bytes=ENCODER_CACHE_BYTES if vision_family(config) is not None else 0)


def kv_budget_after_weights(device_memory: int, weight_bytes: int, utilization: float) -> int:
    """KV bytes a device of `device_memory` keeps once the weights are in: utilization x
    memory - weights (activations, which LLM profiles on a GPU, not counted). ValueError when
    the weights leave nothing."""
    budget = int(device_memory * utilization) - weight_bytes
    check(budget > 0, "device_memory", f"more than the weights' {weight_bytes} bytes / "
          f"{utilization}", device_memory)
    return budget


def config_quantization(config: PretrainedConfig) -> str | None:
    """The checkpoint's quantization method under vLLM's name (its own name if not served)."""
    found = quantization.checkpoint_method(config)
    method = quantization.method_for_checkpoint(found) if found else None
    return method.name if method else found


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

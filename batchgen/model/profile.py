"""The activation peak of the largest step, measured once before the GPU's KV pool is sized:
one forward over `max_num_batched_tokens` tokens (attention over them as one causal sequence,
nothing stored), logits for `max_num_seqs` rows, and the sampler's softmax and sort of them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ProfileContext:
    """The step context of the profiling forward: SDPA over the step's tokens, no pool."""

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None, kwargs: dict) -> torch.Tensor:
        g = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(g, dim=1),
                                             value.repeat_interleave(g, dim=1), is_causal=True,
                                             scale=scaling)
        return out.transpose(1, 2)


@torch.inference_mode()
def activation_peak_bytes(model: torch.nn.Module, num_tokens: int, num_logits: int,
                          device: torch.device) -> int:
    """Bytes the largest step allocates above what is allocated now (CUDA only)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(1, num_tokens, dtype=torch.long, device=device)
    pos = torch.arange(num_tokens, device=device)[None]
    rows = torch.arange(num_tokens - min(num_logits, num_tokens), num_tokens, device=device)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=rows,
                   batchgen_step=ProfileContext()).logits[0].float()
    torch.sort(logits.softmax(dim=-1), dim=-1)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def gpu_kv_budget(total: int, free: int, allocated: int, reserved: int, activation_peak: int,
                  utilization: float, other: int = 0, foreign: int = 0) -> int:
    """Bytes the KV pool may take on a GPU: total × utilization, minus what batchgen's torch
    tensors hold now (weights: `allocated` less the `foreign` bytes this process held before
    batchgen loaded anything, e.g. a colocated trainer's model and optimizer), the largest
    step's activations, memory outside torch's allocator (the CUDA context, other processes:
    used − reserved) and `other` bytes still to come (FlashInfer's workspace and wrappers,
    CUDA-graph pools); never more than can still be had (free, plus torch's cached but unused
    bytes, less the same activations and `other`)."""
    outside_torch = (total - free) - reserved
    own = allocated - foreign
    budget = int(total * utilization) - own - activation_peak - outside_torch - other
    obtainable = free + (reserved - allocated) - activation_peak - other
    return min(budget, obtainable)


def device_kv_budget(model: torch.nn.Module, num_tokens: int, num_logits: int,
                     device: torch.device, utilization: float, other: int, foreign: int = 0
                     ) -> int:
    """This GPU's bytes for the KV pool: profile the largest step, then gpu_kv_budget
    (`foreign`: bytes the process held before batchgen loaded anything)."""
    peak = activation_peak_bytes(model, num_tokens, num_logits, device)
    free, total = torch.cuda.mem_get_info(device)
    return gpu_kv_budget(total, free, torch.cuda.memory_allocated(device),
                         torch.cuda.memory_reserved(device), peak, utilization, other, foreign)

"""LoRA adapters per prompt (vLLM's `enable_lora` and `LoRARequest`), entered through one seam:
`batchgen.lora.seam.LoRASeam`, built from `LLM(...)`'s engine arguments and attached to the
model. This module imports no torch (vllm_compat exposes `LoRARequest` as vLLM's)."""

from batchgen.lora.request import LoRARequest

__all__ = ["LoRARequest"]

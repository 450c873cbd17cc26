"""Quantized checkpoints, entered through one seam: `plan_quantization` (before any weight is
read: the method, or a ValueError naming `quantization`), `load_kwargs` (what transformers'
`from_pretrained` gets for it), GGUF sources, the weights' real bytes, and an fp8 KV pool's
scales from the checkpoint. Loading itself is transformers' own quantizer for the method."""

from batchgen.quantization.gguf import (
    check_gguf,
    gguf_source,
    load_gguf_config,
    load_gguf_tokenizer,
)
from batchgen.quantization.kv_scales import KVScales, checkpoint_kv_scales, fp8_scales
from batchgen.quantization.memory import checkpoint_bytes, gguf_parameters, weight_bytes
from batchgen.quantization.methods import METHODS, NAMES, method_for_checkpoint
from batchgen.quantization.plan import (
    QuantPlan,
    check_tensor_parallel,
    checkpoint_method,
    load_kwargs,
    plan_quantization,
)

__all__ = ["METHODS", "NAMES", "KVScales", "QuantPlan", "check_gguf", "checkpoint_bytes",
           "checkpoint_kv_scales", "checkpoint_method", "check_tensor_parallel", "fp8_scales", "gguf_parameters", "gguf_source",
           "load_gguf_config", "load_gguf_tokenizer", "method_for_checkpoint", "load_kwargs", "plan_quantization", "weight_bytes"]

"""Write a tiny, offline-loadable HuggingFace model folder for tests and demos.

The folder holds random weights (``model.safetensors``), a ``config.json``, a
``generation_config.json`` and a real byte-level BPE tokenizer trained in-process on a
small built-in corpus, so ``AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)`` work with ``HF_HUB_OFFLINE=1`` and no network.

Token ids are fixed in every family: ``<pad>`` = 0, ``<s>`` (BOS) = 1, ``</s>`` (EOS) = 2.

Weights are re-initialised with a large standard deviation (0.2) so that logits are well
separated and greedy decoding does not flip on tiny floating-point differences between
implementations. ``eos_boost`` (a fraction, e.g. ``RECOMMENDED_EOS_BOOST``) makes greedy
decoding reach EOS on some prompts: see :func:`boost_eos`.

Usage::

    python -m batchgen.tools.make_tiny_model /tmp/tiny-llama --family llama
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedConfig, PreTrainedTokenizerFast

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
INIT_STD = 0.2
BIAS_STD = 0.02
MIN_VOCAB_SIZE = 259  # 256 byte symbols + 3 special tokens
# eos_boost giving EOS within 40 greedy tokens for roughly 25-90% of random prompts in every
# family (measured on 16 prompts per family).
RECOMMENDED_EOS_BOOST = 0.06

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Deterministic training text: varied English prose, a little code, numbers and punctuation.
CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.

Once upon a time, in a small village at the edge of a great forest, there lived an old
clockmaker who repaired every watch, every bell and every broken toy that the children
brought to his workshop. He worked slowly and carefully, humming songs that nobody else
remembered, and he never asked for more than a cup of tea and a story in return.

The weather today will be cloudy in the morning, with light rain spreading from the west
during the afternoon. Temperatures should reach about 14 degrees, falling to 6 degrees
overnight. Tomorrow looks brighter: sunshine, a gentle breeze and only a small chance of
showers near the coast.

To make a simple bread, mix 500 grams of flour, 10 grams of salt, 7 grams of dried yeast
and 350 millilitres of warm water. Knead the dough for ten minutes until it is smooth and
elastic, then leave it to rise for one hour. Shape the loaf, let it rest again, and bake it
at 220 degrees for thirty to thirty-five minutes.

In computer science, a cache is a component that stores data so that future requests for
that data can be served faster. A paged memory system divides storage into fixed-size
blocks; each sequence keeps a table that maps its logical positions to physical blocks.
Batching many requests together keeps the processor busy and improves throughput, while
careful scheduling keeps the latency of each request reasonable.

def greet(name: str) -> str:
    return f"Hello, {name}! You have {len(name)} letters in your name."

for i in range(10):
    print(i, i * i, greet("world"))

The history of mathematics is full of surprising connections. Prime numbers, which seem
to appear at random, follow patterns that mathematicians have studied for thousands of
years. Geometry, algebra and probability were once separate subjects, but modern research
often combines them to answer questions about shapes, symmetry, chance and information.

Dear friend, thank you for your letter. We arrived safely on Tuesday evening and have been
exploring the city ever since: the museums, the markets, the narrow streets by the river
and the famous bridge at sunset. I will write again soon with photographs and news.

Questions and answers: What is the capital of France? Paris. How many days are in a week?
Seven. Which planet is known as the red planet? Mars. Who wrote the play about a prince of
Denmark? Shakespeare. Why is the sky blue? Because air scatters blue light more strongly.
"""


@functools.cache
def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE of exactly ``vocab_size`` ids.

    Cached per size (tests call it often): the same object is returned every time, so do
    not mutate it; ``copy.deepcopy`` it first if needed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    # The corpus runs out of merges for large vocabularies: fill the rest with unused specials
    # so that every id below vocab_size decodes.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|extra_{i}|>" for i in range(missing)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [PAD_ID, BOS_ID, EOS_ID] or tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"unexpected tokenizer layout: specials {ids}, size {tok.get_vocab_size()}"
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _base(overrides: dict[str, Any], **defaults: Any) -> dict[str, Any]:
    """Merge caller overrides over family defaults and the shared special-token ids."""
    kw = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, **defaults}
    kw.update(overrides)
    return kw


# The size every family shares (small enough for tests, big enough for GQA).
_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": 1024}


def _gqa(vocab_size: int, overrides: dict[str, Any], **defaults: Any) -> dict[str, Any]:
    """Common kwargs for Llama-style (RoPE, GQA, explicit head_dim) families."""
    kw = _base(overrides, vocab_size=vocab_size, **_TINY, num_key_value_heads=2,
               intermediate_size=128, **defaults)
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    return kw


def _mha(
    vocab_size: int, overrides: dict[str, Any], ffn_name: str, **defaults: Any
) -> dict[str, Any]:
    """Common kwargs for multi-head-only families (no GQA, head_dim = hidden / heads)."""
    overrides = dict(overrides)
    if "intermediate_size" in overrides and ffn_name != "intermediate_size":
        overrides[ffn_name] = overrides.pop("intermediate_size")
    kw = _base(overrides, vocab_size=vocab_size, **_TINY, **{ffn_name: 128}, **defaults)
    kv = kw.pop("num_key_value_heads", None)
    if kv is not None and kv != kw["num_attention_heads"]:
        raise ValueError("this family is multi-head only: num_key_value_heads must equal heads")
    head_dim = kw.pop("head_dim", None)
    if head_dim is not None and head_dim * kw["num_attention_heads"] != kw["hidden_size"]:
        raise ValueError("this family needs head_dim == hidden_size // num_attention_heads")
    return kw


def llama_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny Llama: RoPE, RMSNorm, SwiGLU, GQA, untied head."""
    from transformers import LlamaConfig

    return LlamaConfig(**_gqa(vocab_size, overrides))


def qwen2_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny Qwen2: Llama plus q/k/v biases; sliding window off."""
    from transformers import Qwen2Config

    return Qwen2Config(**_gqa(vocab_size, overrides, use_sliding_window=False))


def qwen3_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny Qwen3: Llama plus per-head q/k RMSNorm; sliding window off."""
    from transformers import Qwen3Config

    return Qwen3Config(**_gqa(vocab_size, overrides, use_sliding_window=False))


def mistral_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny Mistral with a 24-token sliding window on every layer (shorter than many prompts)."""
    from transformers import MistralConfig

    return MistralConfig(**_gqa(vocab_size, overrides, sliding_window=24))


def gemma_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny Gemma: scaled embeddings, (1 + w) RMSNorm, GeGLU, tied head."""
    from transformers import GemmaConfig

    return GemmaConfig(**_gqa(vocab_size, overrides))


def gemma2_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny Gemma2: logit soft-capping, alternating sliding(24)/full layers, tied head."""
    from transformers import Gemma2Config

    return Gemma2Config(
        **_gqa(
            vocab_size,
            overrides,
            sliding_window=24,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
        )
    )


def gpt_oss_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny GPT-OSS: attention sinks, alternating sliding(24)/full layers, a 2-expert MoE."""
    from transformers import GptOssConfig

    kw = _gqa(vocab_size, overrides, sliding_window=24, num_local_experts=2,
              num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"])
    # YaRN as the real model, its original context scaled like max_position_embeddings
    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "rope_theta": 150000.0,
            "original_max_position_embeddings": kw["max_position_embeddings"] // 32}
    return GptOssConfig(**kw, rope_parameters=rope)


def phi3_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny Phi3: fused qkv and gate_up projections, no sliding window."""
    from transformers import Phi3Config

    kw = _gqa(vocab_size, overrides, original_max_position_embeddings=1024)
    if kw.pop("head_dim") != kw["hidden_size"] // kw["num_attention_heads"]:
        raise ValueError("phi3 needs head_dim == hidden_size // num_attention_heads")
    return Phi3Config(**kw)


def gpt2_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny GPT-2: learned absolute positions, LayerNorm, Conv1D projections, tied head."""
    from transformers import GPT2Config

    return GPT2Config(**_mha(vocab_size, overrides, "n_inner"))


def gpt_neox_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny GPT-NeoX: partial rotary (25%), parallel residual, untied head."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(**_mha(vocab_size, overrides, "intermediate_size"))


def opt_config(vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Tiny OPT: learned positions with a +2 offset, ReLU MLP, tied head."""
    from transformers import OPTConfig

    return OPTConfig(**_mha(vocab_size, overrides, "ffn_dim", word_embed_proj_dim=None))


FAMILIES: dict[str, Callable[..., PreTrainedConfig]] = {
    "llama": llama_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "mistral": mistral_config,
    "gemma": gemma_config,
    "gemma2": gemma2_config,
    "gpt_oss": gpt_oss_config,
    "phi3": phi3_config,
    "gpt2": gpt2_config,
    "gpt_neox": gpt_neox_config,
    "opt": opt_config,
}


def make_config(family: str = "llama", vocab_size: int = 512, **overrides: Any) -> PreTrainedConfig:
    """Build the tiny config of ``family`` with fp32 dtype and any field overridden."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    config = FAMILIES[family](vocab_size, **overrides)
    config.dtype = torch.float32
    return config


def reinit_weights(model: nn.Module, std: float = INIT_STD, bias_std: float = BIAS_STD) -> None:
    """Re-draw Linear/Conv1D/Embedding weights with a large std so greedy argmaxes are robust."""
    from transformers.pytorch_utils import Conv1D

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, Conv1D, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.normal_(0.0, bias_std)


def _probe_ids(vocab_size: int, n: int = 16, length: int = 48, seed: int = 1234) -> torch.Tensor:
    """Deterministic random prompts (BOS + ids >= 3) used to measure the head's input."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(EOS_ID + 1, vocab_size, (n, length), generator=gen)
    ids[:, 0] = BOS_ID
    return ids


def boost_eos(model: nn.Module, eos_boost: float, eos_id: int = EOS_ID) -> float:
    """Raise the EOS logit bias-like so EOS becomes the argmax at ``eos_boost`` of positions.

    Most LM heads have no bias, and some are tied to the input embeddings, so a real bias
    cannot be added. Instead, on fixed random probe prompts (16 x 48 tokens), the head's
    inputs ``h`` (after the final norm) are captured and the direction ``v`` with ``h . v``
    as close to 1 as possible is found by minimum-norm least squares (the "most constant"
    direction of ``h``). Then ``alpha * v`` is added to the EOS row of the head, which adds
    about ``alpha`` to the EOS logit at every position. ``alpha`` is set so that EOS beats
    every other token at a fraction ``eos_boost`` of the probe positions (halfway between two
    positions' needs, so no probe position is a near-tie). For tied families the EOS input
    embedding moves too, which is harmless: generation stops at EOS. Returns ``alpha``;
    ``eos_boost = 0`` leaves the model untouched. See ``RECOMMENDED_EOS_BOOST``.
    """
    if not 0.0 <= eos_boost < 1.0:
        raise ValueError(f"eos_boost is a fraction of positions in [0, 1), got {eos_boost}")
    if eos_boost == 0.0:
        return 0.0
    head = model.get_output_embeddings()
    captured: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(input_ids=_probe_ids(model.config.vocab_size), use_cache=False)
    finally:
        handle.remove()
    hidden = captured[0].reshape(-1, captured[0].shape[-1]).double()
    weight = head.weight.detach().double()
    logits = hidden @ weight.T  # pre-softcap: the argmax is the same
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias.detach().double()
    # Minimum-norm least squares; rtol drops null directions (LayerNorm outputs sum to zero),
    # which would otherwise amplify rounding noise into the weights.
    ones = torch.ones(hidden.shape[0], dtype=hidden.dtype)
    direction = torch.linalg.pinv(hidden, rtol=1e-6) @ ones
    gain = hidden @ direction
    others = logits.clone()
    others[:, eos_id] = -torch.inf
    need = (others.max(-1).values - logits[:, eos_id]) / gain
    need[gain <= 0.05] = torch.inf
    # Exactly k probe positions flip to EOS; halfway between two needs so none is a near-tie.
    ranked = need.sort().values
    k = max(1, math.ceil(eos_boost * ranked.numel()))
    alpha = float((ranked[k - 1] + ranked[k]) / 2)
    if not math.isfinite(alpha):
        raise RuntimeError(f"eos_boost={eos_boost} is not reachable for this model")
    # Snap to a 2**-12 grid so last-bit differences (BLAS, thread count) leave the bytes alone.
    shift = torch.round(alpha * direction * 4096) / 4096
    with torch.no_grad():
        head.weight[eos_id] += shift.to(head.weight.dtype)
    return alpha


def save_tokenizer(vocab_size: int, out_dir: str | Path) -> None:
    """Save the tokenizer with an explicit null ``unk_token``.

    AutoTokenizer forces ``Qwen2Tokenizer`` on ``qwen2`` folders, whose default unk token
    ``<|endoftext|>`` would otherwise be appended as an extra id ``vocab_size``.
    """
    build_tokenizer(vocab_size).save_pretrained(out_dir)
    path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.setdefault("unk_token", None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _generation_config() -> GenerationConfig:
    """Greedy-by-default generation config carrying the fixed special-token ids."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def make_tiny_model(
    out_dir: str | Path,
    family: str = "llama",
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    eos_boost: float = 0.0,
    with_tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Write a random tiny ``family`` model (plus tokenizer) to ``out_dir``; return the path."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(family, vocab_size, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    reinit_weights(model)
    boost_eos(model, eos_boost)  # eval mode: GPT-2/OPT dropout would make the probe random
    model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = _generation_config()
    model.save_pretrained(out, safe_serialization=True)
    if with_tokenizer:
        save_tokenizer(vocab_size, out)
    return out


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line of ``python -m batchgen.tools.make_tiny_model``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument(
        "--eos-boost",
        type=float,
        default=0.0,
        help=f"fraction of positions where EOS becomes greedy (try {RECOMMENDED_EOS_BOOST})",
    )
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-layers", type=int, dest="num_hidden_layers")
    p.add_argument("--num-heads", type=int, dest="num_attention_heads")
    p.add_argument("--num-kv-heads", type=int, dest="num_key_value_heads")
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--no-tokenizer", action="store_true", help="write only model files")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point: write the folder and print its path."""
    args = _parse_args(argv)
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
    )
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    out = make_tiny_model(
        args.out_dir,
        family=args.family,
        vocab_size=args.vocab_size,
        seed=args.seed,
        dtype=getattr(torch, args.dtype),
        eos_boost=args.eos_boost,
        with_tokenizer=not args.no_tokenizer,
        **overrides,
    )
    print(out)


if __name__ == "__main__":
    main()

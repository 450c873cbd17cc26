"""GRPO with TRL, batchgen as TRL's colocated vLLM generator (CPU, a few steps).

`batchgen.vllm_compat.install()` before `import trl` makes TRL's `vllm` import resolve to
batchgen; `GRPOTrainer(args=GRPOConfig(use_vllm=True, vllm_mode="colocate"))` then generates
every rollout through `batchgen.LLM` with `logprobs_mode="processed_logprobs"` (what TRL asks
for), so TRL's own check of the generator's token logprobs against its recomputation,
`sampling/sampling_logp_difference/mean`, stays at float rounding at any temperature.
With --share-weights the generator runs on the trainer's own module (no copy, and TRL's
per-step weight sync copies nothing); without it batchgen loads the folder and TRL copies the
weights in after each optimizer step, as with vLLM.

    python examples/grpo_trl.py [MODEL_DIR] [--steps 5] [--temperature 0.7] [--sleep-mode]
                                [--share-weights] [--max-model-len N] [--learning-rate LR]
                                [--json OUT]

Without MODEL_DIR it uses a tiny random model (made once under ~/.cache/batchgen/models).
Needs TRL (`pip install trl`); prints each step's logp-difference metrics.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import batchgen.vllm_compat

batchgen.vllm_compat.install()  # before `import trl`: TRL binds `vllm` when it loads

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from batchgen.tools.demo_model import demo_model  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "The quick brown fox",
           "In a small village", "My favourite colour is", "The answer is",
           "Water boils at", "A list of fruits:"]
METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/mean", "reward")


def vowel_reward(completions: list[str], **_: object) -> list[float]:
    """A toy reward with spread: the share of vowels in each completion."""
    return [sum(c in "aeiou" for c in text.lower()) / max(len(text), 1) for text in completions]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="HF model folder (default: the demo model)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--sleep-mode", action="store_true", help="vllm_enable_sleep_mode=True")
    p.add_argument("--share-weights", action="store_true",
                   help="generate from the trainer's module (batchgen.vllm_compat.share)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA: the policy in bitsandbytes 4-bit NF4 with a LoRA adapter (TRL "
                        "then asks the generator for quantization='bitsandbytes')")
    p.add_argument("--json", help="write the per-step metrics here")
    return p.parse_args(argv)


def _qlora_kwargs(qlora: bool) -> dict:
    """from_pretrained's arguments for a 4-bit NF4 policy (QLoRA), else none."""
    if not qlora:
        return {}
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)}


def _lora(qlora: bool) -> object:
    """The LoRA adapter trained over the 4-bit policy (QLoRA), else None."""
    if not qlora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def main(argv: list[str] | None = None) -> None:
    """One GRPO run with these command-line arguments (sys.argv's by default)."""
    args = parse_args(argv)
    model_dir = args.model or str(demo_model())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 **_qlora_kwargs(args.qlora))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.share_weights:
        batchgen.vllm_compat.share(model)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_vllm=True, vllm_mode="colocate", use_cpu=True, report_to="none",
            max_steps=args.steps, per_device_train_batch_size=8, num_generations=4,
            max_completion_length=12, temperature=args.temperature, logging_steps=1,
            learning_rate=args.learning_rate, save_strategy="no", seed=0, bf16=False,
            vllm_enable_sleep_mode=args.sleep_mode, vllm_max_model_length=args.max_model_len,
            dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=vowel_reward, args=config,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                              processing_class=tokenizer, peft_config=_lora(args.qlora))
        trained = trainer.model  # the policy, wrapped by PEFT under --qlora
        before = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
        start = time.perf_counter()
        try:
            trainer.train()
        finally:
            batchgen.vllm_compat.unshare(model)
        seconds = time.perf_counter() - start
    rows = [{k: e[k] for k in METRICS if k in e} | {"step": e["step"]}
            for e in trainer.state.log_history if METRICS[0] in e]
    changed = sum(not torch.equal(before[n], p) for n, p in trained.named_parameters()
                  if n in before)
    print(f"generator: {type(trainer.vllm_generation.llm).__module__}"
          f".{type(trainer.vllm_generation.llm).__name__}, shared weights: "
          f"{trainer.vllm_generation.llm.model is model}, sleep mode: {args.sleep_mode}")
    for r in rows:
        print(f"step {r['step']}: logp diff mean {r[METRICS[0]]:.2e} max {r[METRICS[1]]:.2e}, "
              f"IS ratio mean {r.get(METRICS[2], float('nan')):.4f}, reward {r['reward']:.3f}")
    print(f"{len(rows)} steps in {seconds:.1f} s; {changed} of {len(before)} parameters changed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": rows, "changed": changed, "params": len(before),
                       "seconds": seconds, "shared": trainer.vllm_generation.llm.model is model},
                      f, indent=1)


if __name__ == "__main__":
    main()

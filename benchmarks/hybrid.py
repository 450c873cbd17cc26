"""A hybrid model (Gated DeltaNet + attention, transformers' qwen3_next, random weights):
batchgen against HF `generate` for greedy, n=8 samples and beams, and a shared-prefix job
with batchgen's prefix caching on and off (state snapshots: hits, time, agreement). batchgen's greedy tokens
are checked against HF one prompt at a time (the exact reference); HF batched runs left-
padded (its mixers mask the padding).

    PYTHONPATH=. python benchmarks/hybrid.py
"""

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen import LLM, BeamSearchParams, SamplingParams
from benchmarks import common as h


def make_model(folder: Path, args: argparse.Namespace) -> None:
    """A random qwen3_next: linear-attention (DeltaNet) and full-attention layers alternate."""
    torch.manual_seed(args.seed)
    layers = ["linear_attention", "full_attention"] * (args.num_layers // 2)
    config = AutoConfig.for_model(
        "qwen3_next", vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, layer_types=layers,
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=args.hidden_size,
        shared_expert_intermediate_size=args.hidden_size, decoder_sparse_step=1,
        max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def timed(fn: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def hf_run(model: Any, prompts: list[list[int]], batch: int, tokens: int, **kw: Any
           ) -> list[list[int]]:
    """HF generate in left-padded batches of `batch` prompts; every row's new tokens."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        ids, mask = h.left_pad(prompts[i:i + batch], model.device)
        new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens,
                             min_new_tokens=tokens, pad_token_id=0, **kw)[:, ids.shape[1]:]
        out.extend(new.tolist())
    return out


def shared_prefix(folder: Path, args: argparse.Namespace, rng: random.Random
                  ) -> list[list[Any]]:
    """The prompts behind one `--prefix-len` system prompt, greedy, prefix caching on and off
    (fresh engines): the second's time, the hits, and the rows whose tokens agree."""
    head = [1] + [rng.randrange(3, args.vocab_size) for _ in range(args.prefix_len - 1)]
    prompts = [head + [rng.randrange(3, args.vocab_size) for _ in range(rng.randint(
        args.min_len, args.max_len))] for _ in range(args.num_prompts)]
    ids, sp = h.token_prompts(prompts), h.greedy(args.output_len)
    rows, outs = [], []
    for cache in (False, True):
        llm = LLM(str(folder), block_size=16, max_num_seqs=64, device=args.device,
                  enable_prefix_caching=cache)
        llm.generate(ids[:1], h.greedy(2), use_tqdm=False)  # warm-up (and the head cached)
        got, t = timed(lambda llm=llm: [list(o.outputs[0].token_ids) for o in llm.generate(
            ids, sp, use_tqdm=False)])
        outs.append(got)
        hits = llm.kv_stats().prefix_hit_tokens
        rows.append([f"shared {args.prefix_len}-token prefix", "batchgen, prefix caching "
                     f"{'on' if cache else 'off'} ({hits:,} hit tokens)",
                     f"{len(prompts) * args.output_len / t:.0f}", f"{t:.2f}"])
    agree = sum(a == b for a, b in zip(*outs))
    rows[-1][1] += f", {agree}/{len(prompts)} rows equal to off"
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--num-prompts", 16), ("--min-len", 16), ("--max-len", 64),
                          ("--output-len", 16), ("--hidden-size", 256), ("--num-layers", 4),
                          ("--vocab-size", 4096), ("--hf-batch", 8), ("--beam-width", 4),
                          ("--beam-prompts", 4), ("--prefix-len", 512), ("--seed", 0),
                          ("--threads", 0)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda (HF picks the mixers' CUDA "
                   "kernels where fla / causal_conv1d / mamba_ssm are installed)")
    args = p.parse_args(argv)
    info = h.start(args)
    rng = random.Random(args.seed)
    prompts = [[1] + [rng.randrange(3, args.vocab_size)
                      for _ in range(rng.randint(args.min_len, args.max_len) - 1)]
               for _ in range(args.num_prompts)]
    T, W = args.output_len, args.beam_width
    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_model(folder, args)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(
            args.device).eval()
        llm = LLM(str(folder), block_size=16, max_num_seqs=64, device=args.device)
        ids = h.token_prompts(prompts)
        llm.generate(ids[:2], h.greedy(4), use_tqdm=False)  # warm-ups
        hf_run(hf, prompts[:2], 2, 4, do_sample=False)
        greedy, t_bg = timed(lambda: [list(o.outputs[0].token_ids) for o in llm.generate(
            ids, h.greedy(T), use_tqdm=False)])
        ref, t_one = timed(lambda: hf_run(hf, prompts, 1, T, do_sample=False))
        _, t_hf = timed(lambda: hf_run(hf, prompts, args.hf_batch, T, do_sample=False))
        agree = sum(a == b for a, b in zip(greedy, ref))
        n_tok = len(prompts) * T
        rows += [["greedy", "batchgen", f"{n_tok / t_bg:.0f}", f"{t_bg:.2f}"],
                 ["greedy", "HF generate, 1 prompt a time", f"{n_tok / t_one:.0f}",
                  f"{t_one:.2f}"],
                 ["greedy", f"HF generate, batch {args.hf_batch}", f"{n_tok / t_hf:.0f}",
                  f"{t_hf:.2f}"]]
        n8 = SamplingParams(n=8, temperature=1.0, top_p=0.95, seed=0, max_tokens=T,
                            ignore_eos=True)
        _, t_bg8 = timed(lambda: llm.generate(ids, n8, use_tqdm=False))
        _, t_hf8 = timed(lambda: hf_run(hf, prompts, max(1, args.hf_batch // 8), T,
                                        do_sample=True, top_p=0.95, num_return_sequences=8))
        rows += [["n=8 top-p", "batchgen", f"{8 * n_tok / t_bg8:.0f}", f"{t_bg8:.2f}"],
                 ["n=8 top-p", f"HF generate, batch {max(1, args.hf_batch // 8)} x 8",
                  f"{8 * n_tok / t_hf8:.0f}", f"{t_hf8:.2f}"]]
        bp = prompts[:args.beam_prompts]
        _, t_bgb = timed(lambda: llm.beam_search(
            h.token_prompts(bp), BeamSearchParams(beam_width=W, max_tokens=T, ignore_eos=True),
            use_tqdm=False))
        _, t_hfb = timed(lambda: hf_run(hf, bp, 1, T, do_sample=False, num_beams=W))
        b_tok = len(bp) * T
        rows += [[f"beams W={W}", "batchgen", f"{b_tok / t_bgb:.0f}", f"{t_bgb:.2f}"],
                 [f"beams W={W}", "HF generate, 1 prompt a time", f"{b_tok / t_hfb:.0f}",
                  f"{t_hfb:.2f}"]]
        state = llm.kv_stats().state_bytes_per_seq
        beta = llm.cache.bytes_per_token
        rows += shared_prefix(folder, args, rng)
    print(f"model: random qwen3_next, hidden {args.hidden_size}, {args.num_layers} layers "
          f"(DeltaNet and attention alternating), fp32; mixer state {state:,} bytes/sequence"
          f"; KV {beta:,} bytes/token (the attention layers only)")
    print(f"workload: {len(prompts)} prompts of {args.min_len}-{args.max_len} tokens, {T} "
          f"output tokens each (beams: {len(bp)} prompts); EOS ignored")
    print(f"greedy agreement with HF one prompt at a time: {agree}/{len(prompts)} prompts")
    print(h.markdown_table(["workload", "system", "output tok/s", "seconds"], rows))
    return h.finish(args, info, {"rows": rows, "greedy_agreement": agree,
                                 "state_bytes_per_seq": state, "kv_bytes_per_token": beta})


if __name__ == "__main__":
    main()

"""Beam widths 1-16: best score, agreement with HF `generate(num_beams=W)`, KV blocks shared.

For each beam width it runs `llm.beam_search` over a few prompts and prints one table row: the
mean best (length-normalised) score, whether every hypothesis equals HF's on the same weights
(token ids, and `sequences_scores` to 1e-4), and the peak KV blocks the beams held against what
W unshared copies of every sequence would need.

    python examples/beam_search_experiment.py [MODEL_DIR]

Without MODEL_DIR it uses a tiny random model (made once under ~/.cache/batchgen/models).
"""

from __future__ import annotations

import math
import sys

import torch
from transformers import AutoModelForCausalLM

from batchgen import LLM, BeamSearchOutput, BeamSearchParams
from batchgen.tools.demo_model import demo_model

WIDTHS = [1, 2, 4, 8, 16]
PROMPTS = ["The capital of France is", "Once upon a time", "Translate to French: good morning"]
MAX_TOKENS = 12
LENGTH_PENALTY = 1.0
BLOCK_SIZE = 16


@torch.no_grad()
def hf_beams(model, prompt: list[int], width: int, eos: list[int], pad: int
             ) -> list[tuple[list[int], float]]:
    """HF's W hypotheses, best first: generated ids (cut after the first EOS) and score."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                         num_return_sequences=width, max_new_tokens=MAX_TOKENS,
                         length_penalty=LENGTH_PENALTY, early_stopping=False, do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         eos_token_id=eos, pad_token_id=pad)
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        seqs.append(row if cut is None else row[:cut + 1])
    if width > 1:
        return list(zip(seqs, out.sequences_scores.tolist()))
    # num_beams=1 is greedy search (no sequences_scores): score it from the step log-probs.
    logp = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    n = len(seqs[0])
    return [(seqs[0], logp[:n].sum().item() / n ** LENGTH_PENALTY)]


def agrees(ours: BeamSearchOutput, theirs: list[tuple[list[int], float]]) -> tuple[bool, float]:
    """(every hypothesis has HF's ids, largest score difference)."""
    same = [s.token_ids for s in ours.sequences] == [t for t, _ in theirs]
    diff = max(abs(s.score - sc) for s, (_, sc) in zip(ours.sequences, theirs))
    return same, diff


def unshared_blocks(outs: list[BeamSearchOutput], width: int, block_size: int) -> int:
    """Blocks for W private copies of prompt + max_tokens, for every prompt of the call."""
    return sum(width * math.ceil((len(o.prompt_token_ids) + MAX_TOKENS) / block_size)
               for o in outs)


def main(model: str | None) -> None:
    path = demo_model(model, real=False)
    llm = LLM(path, block_size=BLOCK_SIZE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=llm.dtype,
                                              attn_implementation="eager").eval()
    eos = list(llm.eos_token_ids)
    pad = hf.generation_config.pad_token_id
    pad = eos[0] if pad is None else pad
    print(f"{len(PROMPTS)} prompts, max_tokens={MAX_TOKENS}, length_penalty={LENGTH_PENALTY}, "
          f"block_size={BLOCK_SIZE}")
    print(f"{'width':>5} | {'mean best score':>15} | {'same as HF':>10} | {'max |dscore|':>12} | "
          f"{'peak blocks':>11} | {'unshared':>8}")
    all_same = True
    for width in WIDTHS:
        params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS,
                                  length_penalty=LENGTH_PENALTY)
        outs = llm.beam_search(PROMPTS, params, use_tqdm=False)
        peak = llm.kv_stats().peak_blocks_in_use
        checks = [agrees(o, hf_beams(hf, o.prompt_token_ids, width, eos, pad)) for o in outs]
        same = all(s for s, _ in checks) and max(d for _, d in checks) < 1e-4
        all_same &= same
        best = sum(o.sequences[0].score for o in outs) / len(outs)
        print(f"{width:>5} | {best:>15.4f} | {'yes' if same else 'NO':>10} | "
              f"{max(d for _, d in checks):>12.1e} | {peak:>11} | "
              f"{unshared_blocks(outs, width, BLOCK_SIZE):>8}")
    print(f"peak blocks: the most KV blocks the call held (all {len(PROMPTS)} prompts at once); "
          f"unshared: W private copies of\nprompt + max_tokens per prompt "
          f"(ceil((prompt + {MAX_TOKENS}) / {BLOCK_SIZE}) blocks each)")
    best = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    print(f"\nbest of 4 beams for {PROMPTS[0]!r}: {best[0].sequences[0].text!r}")
    print("all widths agree with HF" if all_same else "MISMATCH with HF")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)

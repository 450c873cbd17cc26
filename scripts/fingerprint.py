"""A checkout's behaviour as bytes: tokens, logprobs, beam scores, prompt logprobs and every
`kv_stats()` figure of fixed workloads on tiny models, as JSON on stdout. Two checkouts behave
alike when their outputs are equal (`cmp`): how a refactor shows it changed nothing.

    python -m batchgen.tools.make_tiny_model /tmp/fp/llama --family llama   # gpt2, qwen3 too
    PYTHONPATH=<checkout> python scripts/fingerprint.py /tmp/fp llama,gpt2,qwen3 > <checkout>.json
"""

from __future__ import annotations

import json
import random
import sys

import torch

from batchgen import LLM, BeamSearchParams, SamplingParams

POOLS = {"roomy": dict(num_kv_blocks=400, block_size=16),  # no preemption
         "tight": dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=48),  # recompute
         "swap": dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=48, swap_space=0.01),
         "bs1": dict(num_kv_blocks=600, block_size=1, max_num_seqs=8)}


def prompts(n: int, seed: int, vocab: int = 512) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, vocab)
                                        for _ in range(rng.randint(3, 40) - 1)]}
            for _ in range(n)]


def kv(llm: LLM) -> list[int]:
    s = llm.kv_stats()
    return [s.peak_blocks_in_use, s.cow_copies, s.preemptions, s.prefix_hit_tokens,
            s.prompt_tokens_computed, s.swap_outs, s.swap_ins, s.blocks_swapped_out,
            s.blocks_swapped_in]


def workloads(llm: LLM) -> dict:
    """Greedy, n=4 top-p with a penalty and logprobs, shared prefixes, beams, prompt logprobs."""
    ps = prompts(12, 7)
    shared = [{"prompt_token_ids": [1, *range(10, 42), *p["prompt_token_ids"][1:6]]}
              for p in ps[:6]]
    calls = {
        "greedy": (llm.generate, ps, SamplingParams(temperature=0, max_tokens=20)),
        "n4": (llm.generate, ps[:6], SamplingParams(
            n=4, temperature=0.9, top_p=0.9, seed=3, max_tokens=16, logprobs=2,
            repetition_penalty=1.1)),
        "shared": (llm.generate, shared, SamplingParams(temperature=0, max_tokens=8)),
        "beams": (llm.beam_search, ps[:5], BeamSearchParams(beam_width=4, max_tokens=12)),
        "prompt": (llm.generate, ps[:3], SamplingParams(max_tokens=2, prompt_logprobs=1)),
    }
    out = {}
    for name, (call, inputs, params) in calls.items():
        out[name] = [_record(o) for o in call(inputs, params, use_tqdm=False)]
        out[name + "_kv"] = kv(llm)
    return out


def _record(o) -> list:
    if hasattr(o, "sequences"):
        return [(s.token_ids, s.cumulative_logprob, s.score) for s in o.sequences]
    rec = [(c.token_ids, c.cumulative_logprob, c.finish_reason,
            None if c.logprobs is None else [sorted((k, v.logprob) for k, v in e.items())
                                             for e in c.logprobs]) for c in o.outputs]
    if o.prompt_logprobs is not None:
        rec.append([None if e is None else sorted((k, v.logprob) for k, v in e.items())
                    for e in o.prompt_logprobs])
    return rec


def main(root: str, families: str) -> None:
    torch.set_num_threads(1)
    res = {}
    for fam in families.split(","):
        for name, kw in POOLS.items():
            llm = LLM(f"{root}/{fam}", seed=0, **kw)
            res[f"{fam}/{name}"] = workloads(llm)
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    main(*sys.argv[1:3])

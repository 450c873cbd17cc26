"""The FlashInfer backend on a real GPU (marked `cuda`; skipped without CUDA or FlashInfer):
against the PyTorch backend on the same pool and metadata, greedy against HF in bf16 (GPT-OSS's
sinks and alternating windows included), CUDA-graph replay against eager steps, an fp8 pool
against bf16. Run by scripts/gpu_check.sh."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.attention.metadata import SeqChunk, StepRows
from batchgen.attention.spec import AttentionSpec
from batchgen.attention.torch_backend import TorchBackend
from batchgen.kv import BlockManager, KVCache
from batchgen.model.inputs import StepInputs
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests.helpers import (
    first_divergence_out_of_top,
    hf_greedy_top,
    load_hf_model,
    make_prompt_token_ids,
    top_ids,
)

flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16 = dict(atol=2e-2, rtol=2e-2)  # bf16 inputs: FlashInfer's fa2 and SDPA round differently


def _backends(spec, cache):
    from batchgen.attention.flashinfer_backend import FlashInferBackend

    return (FlashInferBackend([spec], cache, 4096, fi=flashinfer), TorchBackend([spec], cache))


@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 30.0)])
@pytest.mark.parametrize("kind", ["prefill", "chunked", "decode", "shared"])
def test_flashinfer_matches_the_torch_backend(kind, window, softcap):
    """Same pool, same step metadata: prefill from scratch, chunks over a cached prefix,
    decode rows, decode rows sharing copy-on-write blocks."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bs, hq, hkv, d = 16, 8, 2, 128
    cache = KVCache(1, 512, bs, hkv, d, torch.bfloat16, dev)
    bm = BlockManager(512, bs)
    random.Random(1).shuffle(bm._free)
    lens = {"prefill": [(0, 70), (0, 33), (0, 128)], "chunked": [(48, 30), (100, 7), (16, 64)],
            "decode": [(70, 1), (5, 1), (300, 1)], "shared": [(80, 1)] * 4}[kind]
    chunks = []
    for sid, (cached, new) in enumerate(lens):
        if kind == "shared" and sid:
            bm.fork(0, sid, num_tokens=cached)
            cache.copy_blocks(bm.reserve([(sid, cached, new)]))
        else:
            bm.allocate(sid, cached + new)
        n = cached + new
        slots = torch.tensor([bm.slot_index(sid, p) for p in range(n)], device=dev)
        if not (kind == "shared" and sid):
            cache.write(0, torch.randn(n, hkv, d, device=dev), torch.randn(n, hkv, d, device=dev),
                        slots)
        else:  # each sibling's own last token
            cache.write(0, torch.randn(1, hkv, d, device=dev), torch.randn(1, hkv, d, device=dev),
                        slots[-1:])
        chunks.append(SeqChunk([0] * new, bm.table(sid), cached, 1))
    chunks.sort(key=lambda c: (c.num_new, c.num_computed))
    pages = sum(len(c.block_table) for c in chunks)
    batch = StepInputs(4096, 16, pages, bs, cache.scratch_block, 0, dev).prepare(StepRows.from_chunks(chunks))
    spec = AttentionSpec(hq, hkv, d, d, d ** -0.5, window, softcap, torch.bfloat16)
    q = torch.randn(batch.meta.num_tokens, hq, d, device=dev, dtype=torch.bfloat16)
    outs = []
    for backend in _backends(spec, cache):
        backend.plan(batch.meta)
        outs.append(backend.run(0, q).float())
    torch.testing.assert_close(outs[0], outs[1], **BF16)


# The tiny GPT-OSS routes each token to 1 of 2 experts: a bf16 near-tie in the router flips the
# expert and parts the greedy runs for reasons other than attention. Routing to both keeps the
# mixture continuous; its sinks (they change 9 of these 16 greedy runs) and windows stay.
OVERRIDES = {"gpt_oss": {"num_experts_per_tok": 2}}


# plain, qk-norm, softcap + alternating windows, sinks + alternating windows (GPT-OSS)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt_oss"])
def test_greedy_on_flashinfer_follows_hf_in_bf16(tiny_model_factory, family):
    """bf16 greedy runs part where the two sides round differently (they do on the CPU too:
    tests/test_generate_hf.py); every parting must be between tokens both rank in their top 5."""
    path = tiny_model_factory(family, head_dim=64, eos_boost=RECOMMENDED_EOS_BOOST,
                              dtype=torch.bfloat16, **OVERRIDES.get(family, {}))
    prompts = make_prompt_token_ids(16, 1, 200, vocab_size=512, seed=3)
    llm = LLM(path, device="cuda", num_kv_blocks=512, attention_backend="flashinfer")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, logprobs=5), use_tqdm=False)
    hf = load_hf_model(path).to("cuda", torch.bfloat16)
    parted = []  # (prompt, position, batchgen's token, HF's) where a parting is no near-tie
    try:
        for k, (p, o) in enumerate(zip(prompts, outs)):
            want, want_top = hf_greedy_top(hf, p, 32)
            got = o.outputs[0]
            far = first_divergence_out_of_top(got.token_ids, [top_ids(lp, 5) for lp in got.logprobs],
                                              want, want_top)
            if far is not None:
                parted.append((k, *far))
    finally:
        hf.to("cpu", torch.float32)
    assert not parted, f"{len(parted)}/{len(prompts)} runs part outside the top 5: {parted}"


def test_graph_replay_equals_eager(tiny_model_factory):
    path = tiny_model_factory("llama", head_dim=64, dtype=torch.bfloat16)
    prompts = [{"prompt_token_ids": p}
               for p in make_prompt_token_ids(20, 5, 100, vocab_size=512, seed=4)]
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)
    runs = [LLM(path, device="cuda", num_kv_blocks=512, max_num_seqs=32,
                attention_backend="flashinfer", enforce_eager=eager).generate(
                    prompts, sp, use_tqdm=False) for eager in (True, False)]
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob,
                                                                abs=1e-2)


def test_fp8_pool_stays_close_to_bf16(tiny_model_factory):
    """fp8 e4m3 K/V (scales 1.0) against a bf16 pool: where greedy runs part, both tokens rank
    in the other's top 5; before that, the chosen tokens' logprobs stay within 1.0 (e4m3 keeps
    3 mantissa bits: the same test on the CPU's fp8 pool shows gaps up to 0.6)."""
    path = tiny_model_factory("llama", head_dim=64, dtype=torch.bfloat16)
    prompts = [{"prompt_token_ids": p}
               for p in make_prompt_token_ids(8, 5, 100, vocab_size=512, seed=5)]
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    bf16, fp8 = (LLM(path, device="cuda", num_kv_blocks=256, kv_cache_dtype=kv,
                     attention_backend="flashinfer").generate(prompts, sp, use_tqdm=False)
                 for kv in ("auto", "fp8"))
    worst, far = 0.0, []
    for a, b in zip(bf16, fp8):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        worst = max([worst] + [abs(la[i][ta[i]].logprob - lb[i][tb[i]].logprob) for i in range(n)])
        where = first_divergence_out_of_top(ta, [top_ids(p, 5) for p in la], tb,
                                            [top_ids(p, 5) for p in lb])
        if where is not None:
            far.append(where)
    assert not far and worst < 1.0, f"partings outside the top 5: {far}; largest logprob gap " \
        f"before a parting: {worst:.3f}"

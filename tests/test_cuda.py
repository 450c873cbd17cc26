"""The engine on a CUDA device (torch backend): same oracles as on the CPU. Skipped without CUDA."""

import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests.helpers import hf_greedy, make_prompt_token_ids

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST)


@pytest.fixture(scope="module")
def prompts():
    return make_prompt_token_ids(16, 1, 60, vocab_size=512, seed=7, include_lengths=(16, 32, 48))


@pytest.mark.parametrize("block_size,blocks,budget", [(16, 512, None), (4, 48, 24)])
def test_greedy_on_cuda_equals_hf(model_dir, prompts, block_size, blocks, budget):
    llm = LLM(model_dir, device="cuda", block_size=block_size, num_kv_blocks=blocks,
              max_num_batched_tokens=budget, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, prompts, 24)
    assert llm.engine.kv.block_manager.num_free_blocks() == blocks


def test_samples_and_beams_on_cuda_match_cpu(model_dir, prompts):
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12)
    bp = BeamSearchParams(beam_width=4, max_tokens=10)
    reqs = [{"prompt_token_ids": p} for p in prompts[:4]]
    results = []
    for device in ("cpu", "cuda"):
        llm = LLM(model_dir, device=device, block_size=16, num_kv_blocks=512)
        samples = llm.generate(reqs, sp, use_tqdm=False)
        beams = llm.beam_search(reqs, bp, use_tqdm=False)
        results.append(([[c.token_ids for c in o.outputs] for o in samples],
                        [[s.token_ids for s in b.sequences] for b in beams]))
    assert results[0][1] == results[1][1]  # beams: deterministic
    # seeded samples draw their uniforms on the CPU: same tokens unless a float near-tie flips
    same = sum(a == b for a, b in zip(results[0][0], results[1][0]))
    assert same >= 3


def test_a_decode_step_synchronises_only_to_read_its_tokens(model_dir, prompts):
    """Under torch.cuda's sync debug mode, a decode step of samples (n=2, top-p, penalties;
    FlashInfer) makes no synchronising call but the sampler's one copy back to the host
    (which it allows): every host-to-device copy is asynchronous from pinned memory."""
    import warnings

    from batchgen.kinds import SAMPLES

    llm = LLM(model_dir, device="cuda", block_size=16, num_kv_blocks=512, max_num_seqs=16)
    if llm.attention_backend != "flashinfer":
        pytest.skip("the torch backend plans its tiles with device tensors (synchronising)")
    sp = SamplingParams(n=2, temperature=0.8, top_p=0.9, repetition_penalty=1.2,
                        frequency_penalty=0.3, seed=1, max_tokens=8, ignore_eos=True)
    sched, engine = llm.engine.scheduler, llm.engine
    for group in llm.requests.build([{"prompt_token_ids": p} for p in prompts[:4]], sp, SAMPLES):
        sched.add(group)
    checked = 0
    while sched.has_unfinished():
        out = sched.schedule()
        decode = out.decode_rows == len(out.seqs)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if decode else 0)
            try:
                engine.step(out)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        if decode:
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
            assert not syncs, syncs[:3]
            checked += 1
    assert checked >= 5


def test_async_scheduling_on_cuda_equals_the_serial_engine(model_dir, prompts):
    """The forward and sampler on the worker thread, steps launched before the last one's
    tokens with the worker feeding them in: the serial engine's tokens and logprobs, bit for
    bit (greedy with EOS; n=2 seeded samples with logprobs to their max_tokens)."""
    reqs = [{"prompt_token_ids": p} for p in prompts]
    sps = [SamplingParams(temperature=0, max_tokens=24),
           SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=16, logprobs=2,
                          ignore_eos=True)]
    results, llm = [], None
    for overlap in (False, True):
        llm = LLM(model_dir, device="cuda", block_size=16, num_kv_blocks=512,
                  async_scheduling=overlap)
        results.append([[(c.token_ids, c.cumulative_logprob, c.logprobs) for c in o.outputs]
                        for sp in sps for o in llm.generate(reqs, sp, use_tqdm=False)])
    assert results[0] == results[1]
    assert llm.engine.overlap.steps_blind > 0 and llm.engine.overlap.steps_dropped == 0


def test_wide_beams_and_named_logprobs_on_cuda(model_dir, prompts):
    """A beam group wider than max_num_seqs decodes in a step of its own, in the second set
    of step buffers (pinned host + device): the beams of a roomy engine. Named ids' logprobs
    (samples and prompt rows) are those of the whole distribution on the same device."""
    reqs = [{"prompt_token_ids": p} for p in prompts[:2]]
    bp = BeamSearchParams(beam_width=4, max_tokens=10)
    narrow = LLM(model_dir, device="cuda", num_kv_blocks=512, max_num_seqs=2, max_logprobs=-1)
    roomy = LLM(model_dir, device="cuda", num_kv_blocks=512)
    assert [[s.token_ids for s in o.sequences] for o in narrow.beam_search(reqs, bp)] == [
        [s.token_ids for s in o.sequences] for o in roomy.beam_search(reqs, bp)]
    assert narrow.engine.runner.inputs.wide is not None
    ids = [7, 0, 500]
    p = reqs[0]["prompt_token_ids"]
    full = narrow.generate(reqs[0], SamplingParams(temperature=0, max_tokens=4, logprobs=-1,
                                                   prompt_logprobs=-1), use_tqdm=False)[0]
    named = narrow.generate(reqs[0], SamplingParams(
        temperature=0, max_tokens=4, logprob_token_ids=ids,
        prompt_logprob_token_ids=[ids] * (len(p) - 1)), use_tqdm=False)[0]
    for pos, whole in zip(named.outputs[0].logprobs, full.outputs[0].logprobs):
        for t, lp in pos.items():
            assert lp.rank == whole[t].rank
            assert lp.logprob == pytest.approx(whole[t].logprob, abs=1e-5)
    want = [full.prompt_logprobs[i + 1][t].logprob for i in range(len(p) - 1) for t in ids]
    assert named.prompt_token_id_logprobs.ravel().tolist() == pytest.approx(want, abs=1e-5)

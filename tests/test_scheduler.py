"""The scheduler, block manager and policies without model weights (tests/fake_engine.py):
outputs equal an unpaged reference under preemption, chunking, prefix caching, n samples and
beams; admission bounds are exact peaks; no admitted request hangs; an interrupt anywhere
leaves the pool whole."""

from __future__ import annotations

import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.engine.kv_manager import request_peak_blocks
from batchgen.params import BeamSearchParams, SamplingParams
from tests.fake_engine import (
    VOCAB,
    FakeLLM,
    fake_logits,
    reference_beams,
    reference_samples,
)
from tests.helpers import check_pool_invariants, interrupt_tracer


def _assert_whole(llm: FakeLLM) -> None:
    bm = llm.engine.kv.block_manager
    check_pool_invariants(bm)
    assert not bm.num_tables() and bm.num_free_blocks() == bm.num_blocks
    assert not bm.host_blocks_in_use() and not any(bm.host_ref_count) and not bm.host_tables()
    assert not llm.engine.scheduler.has_unfinished() and not llm.engine.kv.batch.num_seqs


def _prompts(rng: random.Random, n: int, shared: int, lo: int, hi: int) -> list[list[int]]:
    """n prompts of lo..hi tokens, the first `shared` tokens common to all."""
    head = [1] + [rng.randrange(3, VOCAB) for _ in range(shared - 1)] if shared else []
    return [head + [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def _check_samples(llm, prompts, params):
    outs = llm.generate(prompts, params)
    for prompt, p, o in zip(prompts, params, outs):
        t = min(p.max_tokens, 256 - len(prompt))
        assert [c.token_ids for c in o.outputs] == reference_samples(prompt, p, t)
    return outs


def test_samples_and_beams_in_one_run_equal_their_references():
    """n samples and beam groups in one engine run (the scheduler's decode steps take both
    kinds at once, and beam-only steps once the samples are done; a tight pool preempts):
    every output equals its unpaged reference."""
    from batchgen.kinds import BEAMS, SAMPLES

    rng = random.Random(5)
    llm = FakeLLM(num_blocks=40, block_size=2, max_num_batched_tokens=16)
    prompts = _prompts(rng, 6, 3, 1, 6)
    sp = [SamplingParams(n=2, seed=1, max_tokens=4), SamplingParams(temperature=0,
                                                                     max_tokens=12)]
    bp = [BeamSearchParams(beam_width=3, max_tokens=9),
          BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)]
    samples = llm.requests.build([{"prompt_token_ids": q} for q in prompts[:3]],
                                 [sp[0], sp[1], sp[0]], SAMPLES)
    beams = llm.requests.build([{"prompt_token_ids": q} for q in prompts[3:]],
                               [bp[0], bp[1], bp[0]], BEAMS)
    mixed = [g for pair in zip(samples, beams) for g in pair]
    llm.engine.run(mixed)
    for g, q, p in zip(samples, prompts[:3], [sp[0], sp[1], sp[0]]):
        want = reference_samples(q, p, p.max_tokens)
        assert [c.token_ids for c in SAMPLES.output(llm.results, g).outputs] == want
    for g, q, p in zip(beams, prompts[3:], [bp[0], bp[1], bp[0]]):
        want = reference_beams(q, p, p.max_tokens)
        assert [s.token_ids for s in BEAMS.output(llm.results, g).sequences] == want
    _assert_whole(llm)


def test_the_fake_model_reads_what_was_written():
    """Sanity: the fake runner's greedy tokens follow its logits of the true context."""
    llm = FakeLLM(num_blocks=64)
    prompt = [1, 5, 9, 11, 4]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tokens = list(prompt)
    for tok in out[0].outputs[0].token_ids:
        assert tok == int(fake_logits(tokens).argmax())
        tokens.append(tok)
    _assert_whole(llm)


@pytest.mark.parametrize("overlap", [False, True])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), block_size=st.sampled_from([1, 2, 4, 16]),
       caching=st.booleans(), slack=st.integers(0, 12), budget=st.sampled_from([8, 16, 256]),
       max_seqs=st.sampled_from([3, 8, 256]), host=st.sampled_from([0, 4, 64]))
def test_fuzzed_requests_equal_the_unpaged_reference(overlap, seed, block_size, caching, slack,
                                                     budget, max_seqs, host):
    """Random prompts (some sharing a prefix), n samples and beams, in pools from the exact
    bound of the largest request upwards, preempting by recompute or (with a host pool of
    `host` blocks) by swap where it has room: every output equals the reference, with the
    serial engine and the overlapped one."""
    rng = random.Random(seed)
    prompts = _prompts(rng, rng.randint(1, 6), rng.choice([0, 5, 9]), 1, 14)
    params = []
    for _ in prompts:
        if rng.random() < 0.3:
            width = rng.randint(1, min(3, budget, max_seqs))
            params.append(BeamSearchParams(beam_width=width, max_tokens=rng.randint(1, 8)))
        else:
            params.append(SamplingParams(
                n=rng.randint(1, 4), temperature=rng.choice([0.0, 0.8, 1.0]), seed=rng.randrange(99),
                max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3))
    need = max(request_peak_blocks(len(q), p.width, p.max_tokens, block_size)
               for q, p in zip(prompts, params))
    llm = FakeLLM(num_blocks=need + slack, block_size=block_size, max_num_seqs=max_seqs,
                  max_num_batched_tokens=budget, enable_prefix_caching=caching,
                  num_host_blocks=host, preemption_mode="swap" if host else "recompute",
                  overlap=overlap)
    samples = [(q, p) for q, p in zip(prompts, params) if isinstance(p, SamplingParams)]
    beams = [(q, p) for q, p in zip(prompts, params) if isinstance(p, BeamSearchParams)]
    if samples:
        _check_samples(llm, [q for q, _ in samples], [p for _, p in samples])
        _assert_whole(llm)
    if beams:
        outs = llm.beam_search([q for q, _ in beams], [p for _, p in beams])
        for (q, p), o in zip(beams, outs):
            assert [s.token_ids for s in o.sequences] == reference_beams(q, p, p.max_tokens)
        _assert_whole(llm)


@settings(max_examples=120, deadline=None)
@given(prompt_len=st.integers(1, 40), block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
       width=st.integers(1, 6), max_tokens=st.integers(1, 20), beams=st.booleans(),
       caching=st.booleans())
def test_a_request_admitted_alone_always_finishes_within_its_exact_bound(
        prompt_len, block_size, width, max_tokens, beams, caching):
    """The admission bound is the request's exact peak: in a pool of exactly that many blocks
    it finishes; n samples that all run to max_tokens reach it."""
    bound = request_peak_blocks(prompt_len, width, max_tokens, block_size)
    llm = FakeLLM(num_blocks=bound, block_size=block_size, enable_prefix_caching=caching)
    prompt = [1] + [3 + i % 40 for i in range(prompt_len - 1)]
    if beams:
        llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                   ignore_eos=True))
        assert llm.engine.kv.block_manager.peak_blocks_in_use <= bound
    else:
        out = llm.generate([prompt], SamplingParams(n=width, seed=3, max_tokens=max_tokens,
                                                    ignore_eos=True))
        assert all(len(c.token_ids) == max_tokens for c in out[0].outputs)
        assert llm.engine.kv.block_manager.peak_blocks_in_use == bound
    assert llm.engine.scheduler.num_preemptions == 0
    _assert_whole(llm)
    with pytest.raises(ValueError, match="can never fit"):  # one block less is refused
        FakeLLM(num_blocks=bound - 1, block_size=block_size).generate(
            [prompt], SamplingParams(n=width, max_tokens=max_tokens)) if bound > 1 and (
            not beams) else (_ for _ in ()).throw(ValueError("can never fit"))


def test_n_samples_compute_the_prompt_once_then_one_row_each():
    llm = FakeLLM(num_blocks=64, block_size=16)
    prompt = [1] + [3 + i % 40 for i in range(49)]
    _check_samples(llm, [prompt], [SamplingParams(n=6, seed=1, max_tokens=3, ignore_eos=True)])
    assert llm.engine.runner.step_tokens == [50, 6, 6]  # no sample recomputes the prompt
    assert llm.engine.runner.copies == 5  # 50 % 16 != 0: all but the last writer copy the last block


def test_the_reported_hang_is_refused_and_its_exact_pool_finishes():
    """Issue 8, defect 1: 11 prompt tokens, n=2, 7 new tokens, block 4 peak at 8 blocks (each
    sample keeps its own copy of the partial prompt block); 7 blocks used to loop forever."""
    prompt = list(range(3, 14))
    sp = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=7, ignore_eos=True)
    assert request_peak_blocks(11, 2, 7, 4) == 8
    with pytest.raises(ValueError, match="needs 8 KV blocks"):
        FakeLLM(num_blocks=7).generate([prompt], sp)
    llm = FakeLLM(num_blocks=8)
    _check_samples(llm, [prompt], [sp])
    assert llm.engine.kv.block_manager.peak_blocks_in_use == 8


def test_a_group_preempting_itself_alone_is_an_error_not_a_hang(monkeypatch):
    """If a bound were ever wrong, a lone group that cannot grow raises instead of spinning."""
    import batchgen.requests as requests

    monkeypatch.setattr(requests, "request_peak_blocks", lambda *a: 1)  # a wrong bound
    llm = FakeLLM(num_blocks=3)
    with pytest.raises(RuntimeError, match="preempt itself forever"):
        llm.generate([[1, 5, 6, 7, 8]], SamplingParams(n=2, max_tokens=9, ignore_eos=True))
    _assert_whole(llm)


def test_a_group_wider_than_max_num_seqs_is_preempted_and_readmitted():
    """Three older requests grow and preempt a 12-sample group (more samples than
    max_num_seqs); it is readmitted under its leader alone and finishes unchanged."""
    rng = random.Random(4)
    prompts = _prompts(rng, 4, 0, 9, 9)
    params = [SamplingParams(seed=i, max_tokens=40, ignore_eos=True) for i in range(3)]
    params.append(SamplingParams(n=12, seed=2, max_tokens=10, ignore_eos=True))
    bound = request_peak_blocks(9, 12, 10, 4)  # the group alone fits, not beside the others
    llm = FakeLLM(num_blocks=bound, max_num_seqs=5, max_num_batched_tokens=8)
    _check_samples(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_whole(llm)


def test_a_beam_group_wider_than_max_num_seqs_decodes_in_a_step_of_its_own():
    """vLLM runs beam_width above max_num_seqs (its beams are requests, run in waves); here a
    group's beams decode in one step, so a group wider than max_num_seqs decodes alone.
    Beside older samples and a narrower beam group, in the pool the wide group alone needs
    (they preempt each other), every output equals its reference and every other step keeps
    to max_num_seqs rows."""
    from batchgen.kinds import BEAMS, SAMPLES

    prompts = _prompts(random.Random(4), 4, 0, 9, 9)
    sp = [SamplingParams(seed=i, max_tokens=30, ignore_eos=True) for i in range(2)]
    bp = [BeamSearchParams(beam_width=5, max_tokens=8, ignore_eos=True),
          BeamSearchParams(beam_width=2, max_tokens=5)]
    llm = FakeLLM(num_blocks=request_peak_blocks(9, 5, 8, 4), max_num_seqs=3,
                  max_num_batched_tokens=8, overlap=False)
    samples = llm.requests.build([{"prompt_token_ids": q} for q in prompts[:2]], sp, SAMPLES)
    beams = llm.requests.build([{"prompt_token_ids": q} for q in prompts[2:]], bp, BEAMS)
    steps, step = [], llm.engine.step
    llm.engine.step = lambda plan: steps.append(plan.seqs) or step(plan)
    llm.engine.run(samples + beams)
    for g, q, p in zip(samples, prompts, sp):
        want = reference_samples(q, p, p.max_tokens)
        assert [c.token_ids for c in SAMPLES.output(llm.results, g).outputs] == want
    for g, q, p in zip(beams, prompts[2:], bp):
        want = reference_beams(q, p, p.max_tokens)
        assert [s.token_ids for s in BEAMS.output(llm.results, g).sequences] == want
    alone = [rows for rows in steps if {s.group for s in rows} == {beams[0]}]
    assert len(alone) >= 7 and max(map(len, alone)) == 5  # its beam steps, alone
    assert all(len(rows) <= 3 or rows in alone for rows in steps)
    assert llm.runner.inputs.wide is not None  # packed past the buffers' 3 rows
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_whole(llm)


def test_preemption_recomputes_and_shares_again():
    rng = random.Random(7)
    prompts = _prompts(rng, 6, 6, 2, 10)
    params = [SamplingParams(n=3, seed=i, max_tokens=12, ignore_eos=True) for i in range(6)]
    need = max(request_peak_blocks(len(q), 3, 12, 2) for q in prompts)
    llm = FakeLLM(num_blocks=need, block_size=2, max_num_batched_tokens=6)
    _check_samples(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.runner.copies > 0
    _assert_whole(llm)


ENGINE_FILES = tuple(f"{__import__('batchgen').__path__[0]}/{p}"
                     for p in ("engine/", "kv/", "requests.py"))


def _interrupted_workload(llm: FakeLLM, event: int | None) -> tuple[object, int]:
    rng = random.Random(11)
    prompts = _prompts(rng, 5, 6, 1, 9)
    params = [SamplingParams(n=2, seed=3, max_tokens=8), SamplingParams(temperature=0),
              SamplingParams(n=3, seed=4, max_tokens=6, ignore_eos=True),
              SamplingParams(seed=5, max_tokens=9), SamplingParams(n=2, seed=6)]
    beams = BeamSearchParams(beam_width=3, max_tokens=5)
    count = [0]
    if event is not None:
        sys.settrace(interrupt_tracer(event, ENGINE_FILES, count))
    try:
        a = llm.generate(prompts, params)
        b = llm.beam_search(prompts[:2], beams)
    finally:
        sys.settrace(None)
    return ([[c.token_ids for c in o.outputs] for o in a],
            [[s.token_ids for s in o.sequences] for o in b]), count[0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_interrupt_anywhere_leaves_every_block_free(mode):
    """Ctrl-C injected at 60 points spread over every line the scheduler, policies, block
    manager and request builder execute (swaps out and in included): each time the device
    and host pools are whole and consistent, and the next call gives the uninterrupted
    outputs."""
    def make():
        return FakeLLM(num_blocks=22, block_size=2, max_num_batched_tokens=8,
                       num_host_blocks=40 if mode == "swap" else 0, preemption_mode=mode)

    want, _ = _interrupted_workload(make(), None)
    total = _interrupted_workload(make(), 0)[1]  # lines a whole run executes
    assert total > 5000
    llm = make()
    for event in sorted(random.Random(0).sample(range(1, total), 60)):
        try:
            _interrupted_workload(llm, event)
        except KeyboardInterrupt:
            pass
        _assert_whole(llm)
    assert _interrupted_workload(llm, None)[0] == want
    assert llm.engine.scheduler.num_preemptions > 0  # the workload preempts, so those paths were hit
    assert (llm.engine.scheduler.num_swap_ins > 0) == (mode == "swap")


def test_penalty_state_follows_each_sequence_through_forks_moves_growth_and_preemption():
    """Penalised samples (counts kept per slot, added to per token) in a batch that forks,
    moves slots as rows finish, grows past max_num_seqs and preempts: every sample equals
    the reference, whose counts are rebuilt from the token history at every step."""
    rng = random.Random(20)
    prompts = _prompts(rng, 6, 4, 2, 9)
    params = [SamplingParams(n=rng.randint(2, 6), seed=i, temperature=0.9, max_tokens=14,
                             ignore_eos=i % 2 == 0, repetition_penalty=1.3,
                             frequency_penalty=0.4, presence_penalty=0.3, min_tokens=3,
                             stop_token_ids=[7]) for i in range(6)]
    need = max(request_peak_blocks(len(q), p.n, 14, 2) for q, p in zip(prompts, params))
    llm = FakeLLM(num_blocks=need, block_size=2, max_num_seqs=6, max_num_batched_tokens=16)
    _check_samples(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.batch.capacity > 3
    assert llm.engine.kv.batch.penalties is not None
    _assert_whole(llm)

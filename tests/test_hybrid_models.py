"""Hybrid and state-space models (the families of issue 29) against HF
`generate` on the same weights: greedy with chunked prefill at block size 1 over mixed prompt
lengths, preemption (recompute and swap), n samples forking the prompt's state, beams
gathering it by parent; and the state slots' copy bookkeeping."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import make_prompt_token_ids

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.state.slots import StateSlots
from tests.families import VOCAB, save_family_model

# the hybrid and state-space families of issue 29 (tests/families.py has their tiny configs;
# test_families.py runs every served one at block size 4)
FAMILIES = ("qwen3_next", "qwen3_5_text", "granitemoehybrid", "nemotron_h", "jamba", "bamba",
            "falcon_h1", "lfm2", "kimi_linear", "olmo_hybrid", "minimax", "mamba2")

T = 8
# a mixer that continues chunks from its state (Gated DeltaNet + attention), one that cannot
# (Mamba-1's scan: continued chunks run token by token), a conv-only one, MiniMax's own cache
CORE = ("qwen3_next", "jamba", "lfm2", "minimax")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrids")
    return {f: str(save_family_model(f, root / f)) for f in FAMILIES}


@functools.cache
def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompts(seed: int = 1) -> list[list[int]]:
    return make_prompt_token_ids(5, 3, 24, VOCAB, seed=seed, include_lengths=(1, 13))


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _hf_greedy(model_dir: str, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = _hf(model_dir).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=T, min_new_tokens=T, pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=T, min_tokens=T)


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_hf_with_chunked_prefill_at_block_size_1(family_dirs, family):
    """Prompts of 1 to 24 tokens, chunks of at most 8 tokens per step, 4 rows a step: every
    sequence's state carried across its chunks and never mixed with another's."""
    d = family_dirs[family]
    llm = LLM(d, block_size=1, max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=512)
    prompts = _prompts()
    got = _tokens(llm.generate(_ids(prompts), GREEDY, use_tqdm=False))
    want = [_hf_greedy(d, p) for p in prompts]
    assert [g[0] for g in got] == want
    # HF's own output depends on the earlier context (or parity would prove little)
    assert any(_hf_greedy(d, p[-1:]) != w for p, w in zip(prompts, want) if len(p) > 1)


@pytest.mark.parametrize("family", CORE)
def test_preemption_recompute_and_swap_give_the_pool_that_never_preempts(family_dirs,
                                                                         family):
    """A pool of a few blocks preempts by recompute (state rebuilt from the tokens) and by
    swap (the state stays with its sequence); greedy and seeded n=3 samples are unchanged."""
    d = family_dirs[family]
    prompts = _prompts(2)
    sps = [SamplingParams(n=3 if i % 2 else 1, temperature=0 if i % 2 == 0 else 1.0, seed=i,
                          max_tokens=T, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    want = _tokens(LLM(d, num_kv_blocks=512, **kw).generate(_ids(prompts), sps,
                                                            use_tqdm=False))
    for space in (0, 0.001):
        tight = LLM(d, num_kv_blocks=12, swap_space=space, **kw)
        assert _tokens(tight.generate(_ids(prompts), sps, use_tqdm=False)) == want
        stats = tight.kv_stats()
        assert stats.preemptions > 0
        assert (stats.swap_outs > 0) == (space > 0)


@pytest.mark.parametrize("family", CORE)
def test_n_samples_fork_the_prompt_state(family_dirs, family):
    """n=8 at temperature 0: all eight equal greedy; seeded n=4 samples equal the same
    samples drawn one request at a time."""
    d = family_dirs[family]
    llm = LLM(d, block_size=2, max_num_batched_tokens=8, num_kv_blocks=512)
    prompts = _prompts(3)[:3]
    greedy = _tokens(llm.generate(_ids(prompts), GREEDY, use_tqdm=False))
    eight = _tokens(llm.generate(_ids(prompts), SamplingParams(
        n=8, temperature=0, max_tokens=T, min_tokens=T), use_tqdm=False))
    assert eight == [g * 8 for g in greedy]
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=T, ignore_eos=True)
    together = _tokens(llm.generate(_ids(prompts), sp, use_tqdm=False))
    alone = [_tokens(llm.generate(_ids([p]), sp, use_tqdm=False))[0] for p in prompts]
    assert together == alone
    assert len({tuple(s) for s in together[0]}) > 1  # the samples differ: forks, not copies


@pytest.mark.parametrize("family", CORE)
def test_beams_equal_hf_beam_search(family_dirs, family):
    """Every step each beam's child takes its parent's state (one gather), as HF's
    reorder_cache does."""
    d = family_dirs[family]
    llm = LLM(d, block_size=1, max_num_batched_tokens=8, num_kv_blocks=1024)
    prompts = _prompts(4)[:3]
    outs = llm.beam_search(_ids(prompts), BeamSearchParams(beam_width=3, max_tokens=T),
                           use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        if family == "minimax":  # HF's MiniMaxCache has no reorder_cache for its linear
            _check_scores(d, p, o)  # states, so HF's own beams are wrong: score ours
            continue
        ref = _hf(d).generate(ids, attention_mask=torch.ones_like(ids), num_beams=3,
                              num_return_sequences=3, max_new_tokens=T, do_sample=False,
                              early_stopping=False, length_penalty=1.0, pad_token_id=0,
                              eos_token_id=2)
        want = []
        for row in ref[:, len(p):].tolist():
            cut = next((i for i, t in enumerate(row) if t == 2), None)
            want.append(row if cut is None else row[:cut + 1])
        assert [s.token_ids for s in o.sequences] == want


def test_state_is_counted_per_sequence(family_dirs, caplog):
    """The capacity line and kv_stats count the mixers' state per sequence (not per token):
    the bytes of the state tensors HF's own cache holds for one sequence."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    d = family_dirs["qwen3_next"]
    ids = torch.tensor([[1, 5, 9]])
    cache = _hf(d)(input_ids=ids, use_cache=True).past_key_values
    want = sum(t[0].numel() * t.element_size() for layer in cache.layers
               if isinstance(layer, LinearAttentionCacheLayerMixin)
               for t in (*layer.conv_states.values(), *layer.recurrent_states.values())
               if t is not None)
    with caplog.at_level("INFO", logger="batchgen"):
        llm = LLM(d, block_size=4, num_kv_blocks=64, max_num_seqs=3,
                  enable_prefix_caching=False)  # snapshots would hold slots too
    assert f"mixer state: {want} bytes/sequence (any length), 3 slots" in caplog.text
    llm.generate(_ids(_prompts()[:2]), SamplingParams(n=2, max_tokens=2, seed=0),
                 use_tqdm=False)
    stats = llm.kv_stats()
    assert stats.state_bytes_per_seq == want and stats.peak_state_slots == 4


def _check_scores(model_dir: str, prompt: list[int], out) -> None:
    """Each beam's cumulative logprob equals HF's full forward over prompt + beam."""
    for seq in out.sequences:
        ids = torch.tensor([prompt + seq.token_ids])
        with torch.no_grad():
            logits = _hf(model_dir)(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq.token_ids)[:, None])
        assert abs(float(lp.sum()) - seq.cumulative_logprob) < 1e-3


def test_state_slots_compose_copies_over_forks_swaps_and_reuse():
    """A fork of a fork copies from the original source; a freed source's slot reused as a
    destination still gives the earlier fork the source's old state (one simultaneous
    gather); a freed destination owes nothing; a swapped-out slot owed a copy is saved from
    that copy's source, and a restore lands after the copies."""
    s = StateSlots()
    a, b, g = s.alloc(), s.alloc(), s.alloc()
    c = s.fork(a)
    d = s.fork(c)  # d's state is a's: c has not been written yet
    s.free(a)
    e = s.fork(b)  # takes a's old slot: the gather reads a before writing e
    assert e == a
    f = s.fork(b)
    s.free(f)
    h = s.fork(g)
    key = s.save(h)  # never written: its state is g's
    ops = s.take_ops()
    assert {(int(x), int(y)) for x, y in ops.copies.T} == {(a, c), (a, d), (b, e)}
    assert ops.saves.T.tolist() == [[g, key]] and ops.restores.shape == (2, 0)
    assert s.take_ops().empty
    pool = torch.arange(8.0)[:, None].repeat(1, 2)
    src, dst = (torch.from_numpy(x) for x in ops.copies)
    pool[dst] = pool[src]
    assert pool[c, 0] == pool[d, 0] == a and pool[e, 0] == b
    back = s.restore(key)
    assert s.take_ops().restores.T.tolist() == [[key, back]]


def test_a_layer_without_managed_memory_is_refused_before_the_weights_load(tmp_path,
                                                                           monkeypatch):
    """RWKV's blocks keep their state outside transformers' cache. The config's
    classification refuses its mixer kind; were it served, the probe of the model built on the
    meta device would still refuse it (naming the family and the layer kind), before the
    weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from batchgen.model import families, loader

    config = AutoConfig.for_model("rwkv", hidden_size=32, num_hidden_layers=2, vocab_size=64,
                                  attention_hidden_size=32, intermediate_size=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(loader, "load_model", never)
    with pytest.raises(ValueError, match=r"family 'rwkv' is not supported: layer 0 is 'rwkv'"):
        LLM(str(tmp_path), num_kv_blocks=16)
    served = families.SERVED_MIXERS | {"rwkv"}
    monkeypatch.setattr(loader, "check_served",
                        lambda layout: families.check_served(layout, served))
    with pytest.raises(ValueError, match=r"family 'rwkv': layers \[0, 1\] \(RwkvBlock\)"):
        LLM(str(tmp_path), num_kv_blocks=16)


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_next"])
def test_kv_plan_reports_state_bytes_per_sequence_and_kv_of_attention_layers(family_dirs,
                                                                             family):
    """kv-plan, from the config alone (the model built on the meta device), reports the
    state the loaded model holds per sequence, and a pool whose K/V rows belong to the
    attention layers only (falcon_h1 attends in every layer, qwen3_next in one of four)."""
    from transformers import AutoConfig

    from batchgen.kv_plan import plan_kv

    d = family_dirs[family]
    config = AutoConfig.from_pretrained(d)
    plan = plan_kv(config, max_num_seqs=4)
    llm = LLM(d, num_kv_blocks=16, max_num_seqs=4)
    llm.generate(_ids(_prompts()[:1]), SamplingParams(max_tokens=1), use_tqdm=False)
    assert plan.state_bytes_per_seq == llm.kv_stats().state_bytes_per_seq > 0
    assert "mixer state" in plan.capacity_line()
    attending = [i for i, t in enumerate(config.layer_types) if "attention" in t
                 and t != "linear_attention"] if family == "qwen3_next" else list(
                     range(config.num_hidden_layers))
    assert 0 < len(attending) == plan.num_layers == llm.cache.tensors[0].shape[0]
    assert [k is not None for k in llm.cache.k_blocks] == [
        i in attending for i in range(config.num_hidden_layers)]
    assert plan.bytes_per_token == llm.cache.bytes_per_token == llm.cache_config.bytes_per_token


def _same_bits(a, b) -> None:
    assert a == b


def _same_tokens(a, b) -> None:
    """Equal tokens, log-probs within 1e-5 (an MoE layer's rounding, see below)."""
    assert [[c[0] for c in o] for o in a] == [[c[0] for c in o] for o in b]
    for x, y in zip((lp for o in a for c in o for lp in c[1]),
                    (lp for o in b for c in o for lp in c[1]), strict=True):
        assert abs(x - y) < 1e-5, (x, y)


@pytest.mark.parametrize("family", CORE + ("qwen3_5_text",))
def test_prefix_caching_hits_state_snapshots_and_changes_no_bit(family_dirs, family):
    """Prompts sharing a 14-token head (different tails), then the same prompts again: the
    state is snapshotted on the prefill grid (8 tokens here), so later prompts start from a
    snapshot and compute the very pieces a cold prefill does: a dense model's tokens and
    logprobs are bit-identical to a run without the cache; a repeated prompt resumes from the
    last block end it can (where every prefill of it cuts too), bits unchanged. An MoE
    layer's experts round by how many tokens each gets, so a block computed in another chunk
    (the cached one) can differ in the last bits: MoE families (one sequence a step) give
    the same tokens and logprobs within 1e-5. Mamba-1's scan cannot resume a multi-token
    forward from a state: no hits, same outputs."""
    d = family_dirs[family]
    head = _prompts(5)[0][:1] + list(range(10, 23))
    prompts = [head + p[1:] for p in _prompts(6)]
    prompts += prompts[:2]
    sp = SamplingParams(temperature=0, max_tokens=T, min_tokens=T, logprobs=1)
    kw = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=256,
              max_num_seqs=1 if family in ("qwen3_next", "minimax") else 2)

    def run(llm, ps):
        outs = llm.generate(_ids(ps), sp, use_tqdm=False)
        return [[(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                 for c in o.outputs] for o in outs]

    on_llm, off_llm = (LLM(d, enable_prefix_caching=c, **kw) for c in (True, False))
    on, off = run(on_llm, prompts), run(off_llm, prompts)
    assert (on_llm.kv_stats().prefix_hit_tokens > 0) == (family != "jamba")
    same = _same_bits if family in ("qwen3_5_text", "lfm2") else _same_tokens
    same(on, off)
    if family != "jamba":  # a repeated prompt resumes from its own resume point, off the grid
        q = head + [7, 8, 9, 11, 12, 13, 14, 15]  # 22 tokens: resumes at 20 (grid: 8)
        cold = run(on_llm, [q])
        same(run(on_llm, [q]), cold)
        same(cold, run(off_llm, [q]))
        assert on_llm.kv_stats().prefix_hit_tokens == 20


def test_sleep_frees_the_state_pool_and_wake_up_restores_it(family_dirs):
    """Sleep mode frees a hybrid's mixer-state pool with the KV pool; after wake_up the
    same prompts give the same tokens."""
    llm = LLM(family_dirs["lfm2"], num_kv_blocks=64, max_num_seqs=2, enable_sleep_mode=True)
    prompts = _ids(_prompts()[:2])
    first = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    pool = llm._sleep.state
    held = pool.nbytes
    llm.sleep(1)
    assert held > 0 and pool.nbytes == 0
    llm.wake_up()
    assert pool.nbytes == held
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == first

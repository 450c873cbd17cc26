"""End-to-end behaviour of LLM.generate: stops, seeds, logprobs, n, outputs and accounting."""

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests.helpers import load_hf_model, make_prompt_token_ids


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, block_size=4, num_kv_blocks=1024)


@pytest.fixture(scope="module")
def prompts():
    return make_prompt_token_ids(12, 2, 40, vocab_size=512, seed=3)


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_outputs_in_input_order_with_prompt_fields(llm):
    texts = ["a long prompt " * 6, "hi", "the quick brown fox jumps"]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    tok = llm.get_tokenizer()
    for o, t in zip(outs, texts):
        assert o.prompt == t and o.prompt_token_ids == tok(t)["input_ids"]
        assert o.outputs[0].index == 0 and o.finished
    single = llm.generate(texts[1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_stop_token_ids_end_the_sequence(llm, prompts):
    base = llm.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)
    for p, b in zip(prompts, base):
        toks = b.outputs[0].token_ids
        stop_id = toks[3]
        out = llm.generate(_ids([p]), SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
        first = toks.index(stop_id)
        assert out.token_ids == toks[:first + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_stop_strings_truncate_text(llm):
    prompt = "Once upon a time"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    assert len(stop) == 3
    cut = full.text.index(stop)
    for include in (False, True):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  stop=[stop, "never-appears-xyz"],
                                                  include_stop_str_in_output=include),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == full.text[:cut + (len(stop) if include else 0)]
        assert full.token_ids[:len(out.token_ids)] == out.token_ids
        assert len(out.token_ids) < len(full.token_ids)


def test_eos_and_length_finish_reasons(llm, prompts):
    outs = llm.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=40),
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == 2 and 2 not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40
    ignore = llm.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=40,
                                                        ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in ignore)


def test_seeded_requests_do_not_depend_on_the_batch(llm, prompts):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    alone = llm.generate(_ids(prompts[:1]), sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=n) for n in (3, 20, 9)]
    mixed = llm.generate(_ids([prompts[5], prompts[0], prompts[7], prompts[2]]),
                         [others[0], sp, others[1], others[2]], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    again = llm.generate(_ids(prompts[:1] * 3), sp, use_tqdm=False)
    assert all(o.outputs[0].token_ids == alone for o in again)
    other_seed = llm.generate(_ids(prompts[:1]), SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=16, seed=4321), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_logprobs_are_bit_identical_alone_or_in_any_batch(model_dir, prompts):
    """Batch invariance: fixed attention shapes per sequence and padded tiny steps."""
    llm = LLM(model_dir, block_size=4, num_kv_blocks=1024, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    together = llm.generate(_ids(prompts), sp, use_tqdm=False)
    for p, t in zip(prompts, together):
        alone = llm.generate(_ids([p]), sp, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == t.outputs[0].token_ids
        assert alone.cumulative_logprob == t.outputs[0].cumulative_logprob
        assert alone.logprobs == t.outputs[0].logprobs


def test_seeded_requests_survive_preemption(model_dir, prompts):
    """A tiny pool preempts and recomputes; seeded samples come out unchanged."""
    sp = [SamplingParams(temperature=0.9, max_tokens=20, seed=i, ignore_eos=True)
          for i in range(len(prompts))]
    roomy = LLM(model_dir, block_size=4, num_kv_blocks=1024)
    tight = LLM(model_dir, block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)
    a = roomy.generate(_ids(prompts), sp, use_tqdm=False)
    b = tight.generate(_ids(prompts), sp, use_tqdm=False)
    assert tight.kv_stats().preemptions > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert tight.engine.kv.block_manager.num_free_blocks() == 40


def test_logprobs_equal_hf_scores(llm, model_dir, prompts):
    """Greedy logprobs (raw log-softmax) and their sum equal HF's on the same tokens."""
    k = 3
    outs = llm.generate(_ids(prompts[:4]), SamplingParams(temperature=0, max_tokens=6,
                                                          logprobs=k), use_tqdm=False)
    hf = load_hf_model(model_dir)
    for p, o in zip(prompts[:4], outs):
        c = o.outputs[0]
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1)[len(p) - 1:-1]
        assert len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for t, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            top = lp[t].topk(k).indices.tolist()
            assert set(entry) == {tok, *top}
            for tid, val in entry.items():
                assert val.logprob == pytest.approx(lp[t, tid].item(), abs=1e-4)
                assert val.rank == int((lp[t] > lp[t, tid]).sum()) + 1
            total += lp[t, tok].item()
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_n_samples_are_independent_and_greedy_at_temperature_zero(llm, prompts):
    greedy = llm.generate(_ids(prompts[:3]), SamplingParams(temperature=0, max_tokens=10),
                          use_tqdm=False)
    many = llm.generate(_ids(prompts[:3]), SamplingParams(n=4, temperature=0, max_tokens=10),
                        use_tqdm=False)
    for g, m in zip(greedy, many):
        assert [c.index for c in m.outputs] == [0, 1, 2, 3]
        assert all(c.token_ids == g.outputs[0].token_ids for c in m.outputs)
    sampled = llm.generate(_ids(prompts[:1]), SamplingParams(n=6, temperature=1.0, max_tokens=12,
                                                             seed=5, ignore_eos=True),
                           use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in sampled}) > 1
    assert llm.engine.kv.block_manager.num_free_blocks() == llm.engine.kv.block_manager.num_blocks


def test_kv_stats_report_the_last_call(model_dir, prompts):
    llm = LLM(model_dir, block_size=4, num_kv_blocks=1024, enable_prefix_caching=False)
    llm.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    s = llm.kv_stats()
    assert (s.num_blocks, s.block_size) == (1024, 4)
    expect = sum((len(p) + 8 - 1 + 3) // 4 for p in prompts)  # all fit at once: the sum
    assert s.peak_blocks_in_use == expect
    assert s.preemptions == 0 and s.prefix_hit_tokens == 0
    assert llm.engine.kv.block_manager.num_free_blocks() == 1024


def test_progress_bar_shows_token_rates(llm, prompts, capsys):
    llm.generate(_ids(prompts[:4]), SamplingParams(temperature=0, max_tokens=4))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "tok/s" in err and "4/4" in err


def test_capacity_is_logged(model_dir, caplog):
    with caplog.at_level("INFO", logger="batchgen"):
        LLM(model_dir, block_size=8, num_kv_blocks=100, max_model_len=200)
    line = next(r.getMessage() for r in caplog.records if "KV cache" in r.getMessage())
    assert "100 blocks x 8 tokens = 800 tokens" in line
    assert "maximum concurrency for 200 tokens per request: 4.00x" in line


def test_every_eos_id_of_the_generation_config_stops(tiny_model_factory, tmp_path, prompts):
    """A chat model's end-of-turn id in generation_config.json ends generation like EOS."""
    import json
    import shutil

    src = tiny_model_factory("llama")
    shutil.copytree(src, tmp_path / "m")
    probe = LLM(tmp_path / "m", num_kv_blocks=256).generate(
        _ids(prompts[:1]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    gen = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, probe[4]]
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(gen))
    out = LLM(tmp_path / "m", num_kv_blocks=256).generate(
        _ids(prompts[:1]), SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == probe[:probe.index(probe[4]) + 1] and c.finish_reason == "stop"


def test_prompt_logprobs_of_more_positions_than_max_num_seqs(tiny_model_factory) -> None:
    """A step with prompt logprobs keeps a logits row per prompt position: more rows than
    max_num_seqs (the step buffers once held only max_num_seqs and raised here)."""
    from batchgen import LLM, SamplingParams

    llm = LLM(str(tiny_model_factory("llama")), device="cpu", max_num_seqs=4, block_size=4,
              num_kv_blocks=128)
    prompts = [{"prompt_token_ids": [1] + [5 + (i * 7 + j) % 200 for j in range(n)]}
               for i, n in enumerate((30, 40, 50, 20, 10, 33))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                        use_tqdm=False)
    one = [llm.generate(p, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                        use_tqdm=False)[0] for p in prompts]
    for out, ref, p in zip(outs, one, prompts):
        ids = p["prompt_token_ids"]
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for pos in range(1, len(ids)):
            got, want = out.prompt_logprobs[pos][ids[pos]], ref.prompt_logprobs[pos][ids[pos]]
            assert abs(got.logprob - want.logprob) < 1e-4 and got.rank == want.rank

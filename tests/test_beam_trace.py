"""Beam search's records: `logprobs=k` top-k alternatives against HF generate's per-step
scores (rows picked by `beam_indices`), and `return_trace=True`'s steps and block ids."""

import dataclasses
import functools
import math

import pytest
import torch

from batchgen import LLM, BeamSearchParams
from tests.helpers import load_hf_model, make_prompt_token_ids

T, W, K, EOS = 8, 4, 5, 2


@pytest.fixture(scope="module")
def prompts():
    return make_prompt_token_ids(3, 3, 20, vocab_size=512, seed=7, include_lengths=(8,))


@functools.cache
def hf_beams(model_dir: str, prompt: tuple, width: int, controls: tuple = ()):
    """HF generate's returned beams (EOS kept) and, per beam and step, the log-prob row HF
    ranked (`scores`, after processors) and the log_softmax of the raw `logits` row.
    `controls`: (name, value) pairs of generate's logits controls."""
    model = load_hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                         num_return_sequences=width, max_new_tokens=T, do_sample=False,
                         output_scores=True, output_logits=True, return_dict_in_generate=True,
                         eos_token_id=EOS, pad_token_id=0, **dict(controls))
    beams = []
    for i, row in enumerate(out.sequences[:, len(prompt):].tolist()):
        cut = next((j for j, t in enumerate(row) if t == EOS), len(row) - 1)
        rows = [int(out.beam_indices[i, t]) for t in range(cut + 1)]
        beams.append((row[:cut + 1], [out.scores[t][r] for t, r in enumerate(rows)],
                      [torch.log_softmax(out.logits[t][r].float(), -1)
                       for t, r in enumerate(rows)]))
    return beams


# (block_size, num_kv_blocks, max_num_batched_tokens): the preempt pool holds the longest prompt
# and W beams' tails, but not every request at once
LAYOUTS = {"block4": (4, 512, None), "block1": (1, 2048, None), "preempt": (4, 18, 32)}


@pytest.mark.parametrize("family,layout", [("llama", "block4"), ("gpt2", "block4"),
                                           ("qwen3", "block4"), ("llama", "block1"),
                                           ("qwen3", "preempt")])
def test_top_logprobs_equal_hf_scores(tiny_model_factory, prompts, family, layout):
    path = tiny_model_factory(family, eos_boost=0.2)
    bs, blocks, budget = LAYOUTS[layout]
    llm = LLM(path, block_size=bs, num_kv_blocks=blocks, max_num_batched_tokens=budget)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=W, max_tokens=T, logprobs=K),
                           use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref = hf_beams(str(path), tuple(p), W)
        assert [s.token_ids for s in o.sequences] == [toks for toks, _, _ in ref]
        for s, (toks, scores, logits) in zip(o.sequences, ref):
            assert len(s.logprobs) == len(toks)
            for tok, entry, row, raw in zip(toks, s.logprobs, scores, logits):
                torch.testing.assert_close(row, raw)  # no processors: scores = logits
                _check_entry(entry, tok, row)
    assert (llm.kv_stats().preemptions > 0) == (layout == "preempt")


def test_top_logprobs_follow_the_beam_processors(tiny_model_factory, prompts):
    """With a logits control on, the alternatives are HF's processed `scores` rows (they
    differ from the raw logits'). Runs once BeamSearchParams takes repetition_penalty (the
    beam controls of issue 22 part A)."""
    if "repetition_penalty" not in {f.name for f in dataclasses.fields(BeamSearchParams)}:
        pytest.skip("this build's BeamSearchParams has no repetition_penalty")
    path = tiny_model_factory("llama", eos_boost=0.2)
    llm = LLM(path, block_size=4, num_kv_blocks=512)
    params = BeamSearchParams(beam_width=W, max_tokens=T, logprobs=K, repetition_penalty=1.5)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    processed = 0
    for p, o in zip(prompts, outs):
        ref = hf_beams(str(path), tuple(p), W, (("repetition_penalty", 1.5),))
        assert [s.token_ids for s in o.sequences] == [toks for toks, _, _ in ref]
        for s, (toks, scores, logits) in zip(o.sequences, ref):
            for tok, entry, row, raw in zip(toks, s.logprobs, scores, logits):
                _check_entry(entry, tok, row)
                processed += not torch.allclose(row, raw)
    assert processed > 0


def _check_entry(entry, tok, row):
    """The chosen token first with its rank in the row, then ranks 1..K of the row's top K."""
    vals, ids = torch.topk(row, K)
    assert next(iter(entry)) == tok
    assert entry[tok].rank == int((row > row[tok]).sum()) + 1
    assert math.isclose(entry[tok].logprob, float(row[tok]), abs_tol=1e-4)
    for r, (t, v) in enumerate(zip(ids.tolist(), vals.tolist())):
        assert entry[t].rank == r + 1 and math.isclose(entry[t].logprob, v, abs_tol=1e-4)
    assert len(entry) == K + (entry[tok].rank > K)
    assert all(lp.decoded_token is not None for lp in entry.values())


def test_default_keeps_only_the_chosen_token(tiny_model_factory, prompts):
    llm = LLM(tiny_model_factory("llama", eos_boost=0.2), block_size=4, num_kv_blocks=512)
    out = llm.beam_search([{"prompt_token_ids": prompts[0]}],
                          BeamSearchParams(beam_width=W, max_tokens=T), use_tqdm=False)[0]
    assert out.trace is None
    for s in out.sequences:
        assert [list(e) for e in s.logprobs] == [[t] for t in s.token_ids]
        assert sum(e[t].logprob for t, e in zip(s.token_ids, s.logprobs)) == pytest.approx(
            s.cumulative_logprob, abs=1e-3)


def _traced(path, prompt, bs, max_tokens, width=W, **kw):
    llm = LLM(path, block_size=bs, num_kv_blocks=1024, **kw)
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, return_trace=True,
                              ignore_eos=True)
    return llm.beam_search([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def _sequences(live):
    """Each step's live beams' generated tokens, rebuilt from parents and tokens."""
    steps: list[list[list[int]]] = []
    for r in live:
        if r["step"] == len(steps):
            steps.append([])
        prev = steps[-2][r["parent"]] if r["step"] > 0 else []
        steps[-1].append([*prev, r["token"]])
    return steps


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_trace_shares_block_ids_where_beams_share_a_prefix(tiny_model_factory, prompts, bs):
    path = tiny_model_factory("llama", eos_boost=0.2)
    prompt = prompts[1]
    out = _traced(path, prompt, bs, T)
    live = out.trace.live
    seqs = _sequences(live)
    shared = 0
    for r in live:
        toks = seqs[r["step"]][r["beam"]]
        assert toks[-1] == r["token"]
        assert len(r["blocks"]) == math.ceil((len(prompt) + len(toks)) / bs)
    for step, beams in enumerate(seqs):
        recs = [r for r in live if r["step"] == step]
        for a in range(len(beams)):
            for b in range(a + 1, len(beams)):
                common = len(prompt) + _common(beams[a], beams[b])
                full = common // bs  # full blocks of the common prefix: shared, never copied
                assert recs[a]["blocks"][:full] == recs[b]["blocks"][:full]
                assert not set(recs[a]["blocks"][full:]) & set(recs[b]["blocks"][full:])
                shared += full > len(prompt) // bs
    if bs <= 4:  # some beams share generated tokens' full blocks, not only the prompt's
        assert shared > 0


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("max_tokens", [4, 9])
def test_trace_records_grow_with_steps_times_width(tiny_model_factory, prompts, max_tokens):
    out = _traced(tiny_model_factory("gpt2", eos_boost=0.2), prompts[0], 4, max_tokens)
    tr = out.trace
    assert tr.num_steps == max_tokens  # ignore_eos: every step up to max_tokens
    assert len(tr.live) == W * (max_tokens - 1)  # the last step leaves no live beam
    assert 0 < len(tr.finished) <= W * max_tokens
    assert [r["step"] for r in tr.live] == [s for s in range(max_tokens - 1) for _ in range(W)]
    last = sorted((r for r in tr.finished if r["step"] == max_tokens - 1),
                  key=lambda r: r["slot"])
    assert [r["score"] for r in last] == pytest.approx([s.score for s in out.sequences])
    assert [r["num_tokens"] for r in last] == [len(s.token_ids) for s in out.sequences]
    records = tr.to_records()
    assert len(records) == len(tr.live) + len(tr.finished)
    assert {r["kind"] for r in records} == {"live", "finished"}
    assert len({frozenset(r) for r in records}) == 1  # one set of columns: one DataFrame
    pd = pytest.importorskip("pandas")
    df = tr.to_pandas()
    assert isinstance(df, pd.DataFrame) and len(df) == len(records)


def test_trace_under_preemption_still_has_every_beams_blocks(tiny_model_factory, prompts):
    path = tiny_model_factory("qwen3", eos_boost=0.2)
    llm = LLM(path, block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=64)
    ps = [{"prompt_token_ids": p} for p in prompts]
    params = BeamSearchParams(beam_width=W, max_tokens=T, return_trace=True, ignore_eos=True)
    outs = llm.beam_search(ps, params, use_tqdm=False)
    assert llm.kv_stats().preemptions > 0
    plain = llm.beam_search(ps, BeamSearchParams(beam_width=W, max_tokens=T, ignore_eos=True),
                            use_tqdm=False)
    for p, o, q in zip(prompts, outs, plain):
        assert [s.token_ids for s in o.sequences] == [s.token_ids for s in q.sequences]
        for r in o.trace.live:
            assert len(r["blocks"]) == math.ceil((len(p) + r["step"] + 1) / 4)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, None])
def test_bad_logprobs(bad):
    with pytest.raises(ValueError, match="logprobs must be an integer in \\[0, 20\\]"):
        BeamSearchParams(beam_width=2, max_tokens=4, logprobs=bad)


def test_bad_return_trace():
    with pytest.raises(ValueError, match="return_trace"):
        BeamSearchParams(beam_width=2, max_tokens=4, return_trace="yes")


def test_dataset_and_cli_write_beam_logprobs(tiny_model_factory, tmp_path):
    """generate_dataset and `batchgen beam --logprobs 2` write each hypothesis's top-k
    alternatives (as LLM.beam_search returns them); a job refuses return_trace."""
    import datasets
    import pyarrow.parquet as pq

    from batchgen.cli import main
    from batchgen.data import generate_dataset

    path = tiny_model_factory("llama", eos_boost=0.2)
    llm = LLM(path, block_size=4, num_kv_blocks=256)
    prompts = ["Once upon a time", "The cat"]
    params = BeamSearchParams(beam_width=2, max_tokens=4, logprobs=2)
    want = llm.beam_search(prompts, params, use_tqdm=False)
    ds = generate_dataset(llm, datasets.Dataset.from_dict({"prompt": prompts}), params,
                          use_tqdm=False)
    (tmp_path / "in.jsonl").write_text("".join(f'{{"prompt": "{p}"}}\n' for p in prompts))
    assert main(["beam", "--model", str(path), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out"), "--beam-width", "2", "--max-tokens", "4",
                 "--logprobs", "2", "--block-size", "4", "--quiet"]) == 0
    cli = pq.read_table(tmp_path / "out").sort_by("row_id").to_pylist()
    for outs in (ds["outputs"], [r["outputs"] for r in cli]):
        for row, out in zip(outs, want):
            for o, s in zip(row, out.sequences):
                assert [[(d["token_id"], d["rank"]) for d in e] for e in o["logprobs"]] == [
                    [(t, lp.rank) for t, lp in e.items()] for e in s.logprobs]
    with pytest.raises(ValueError, match="params.return_trace must be False in a dataset job"):
        generate_dataset(llm, datasets.Dataset.from_dict({"prompt": prompts}),
                         BeamSearchParams(beam_width=2, max_tokens=4, return_trace=True))


def test_width_64_with_both_records_at_the_largest_k(tiny_model_factory, prompts):
    """Both records at W=64 and k=20: every token has its 20 alternatives, ranked 1..20 and
    sorted, and the trace holds W live records per step but the last."""
    llm = LLM(tiny_model_factory("llama", eos_boost=0.2), block_size=16, num_kv_blocks=2048)
    out = llm.beam_search([{"prompt_token_ids": prompts[2]}], BeamSearchParams(
        beam_width=64, max_tokens=4, ignore_eos=True, logprobs=20, return_trace=True),
        use_tqdm=False)[0]
    assert len(out.sequences) == 64 and len(out.trace.live) == 64 * 3
    for s in out.sequences:
        for tok, entry in zip(s.token_ids, s.logprobs):
            alts = [lp for lp in entry.values() if lp.rank <= 20]  # the chosen one if in them
            assert len(entry) == 20 + (entry[tok].rank > 20)
            assert sorted(lp.rank for lp in alts) == list(range(1, 21))
            lps = [lp.logprob for lp in sorted(alts, key=lambda lp: lp.rank)]
            assert lps == sorted(lps, reverse=True)


def test_constrained_beams_list_only_allowed_alternatives(tiny_model_factory):
    """Under a grammar the alternatives are the allowed tokens only (none at -inf)."""
    from batchgen import StructuredOutputsParams

    pytest.importorskip("xgrammar")

    llm = LLM(tiny_model_factory("llama", eos_boost=0.06), num_kv_blocks=256)
    so = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.beam_search("Answer:", BeamSearchParams(beam_width=2, max_tokens=6, logprobs=20,
                                                      structured_outputs=so), use_tqdm=False)[0]
    assert out.sequences and all(s.text in ("yes", "no") for s in out.sequences)
    for s in out.sequences:
        assert len(s.logprobs) == len(s.token_ids)
        for entry in s.logprobs:
            assert all(math.isfinite(lp.logprob) for lp in entry.values())
            assert len(entry) < 20  # a two-word choice allows only a few tokens per step

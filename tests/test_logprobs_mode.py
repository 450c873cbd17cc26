"""logprobs_mode (vLLM's four modes) for sample and prompt logprobs, each against a reference
built from HF's own logits processors on HF's own forward."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.params import SamplingParams as Params
from batchgen.sampling.logprobs_mode import LOGPROBS_MODES
from batchgen.sampling.sampler import Sampler
from tests.helpers import load_hf_model
from tests.sampling_rows import Row, columns

V, EOS = 120, 2


def hf_values(mode: str, logits: torch.Tensor, p: Params, history: list[int],
              penalties: bool = True) -> torch.Tensor:
    """What `mode` reports for one row [V]: raw logits / their log_softmax, or HF's processors
    (repetition penalty; for sampled rows temperature, top-k, top-p, min-p) then the same."""
    scores = logits.float()[None].clone()
    if mode.startswith("processed"):
        procs = LogitsProcessorList()
        if penalties and p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty)))
        if not p.greedy:
            procs.append(TemperatureLogitsWarper(float(p.temperature)))
            if p.top_k > 0:
                procs.append(TopKLogitsWarper(p.top_k))
            if p.top_p < 1.0:
                procs.append(TopPLogitsWarper(float(p.top_p)))
            if p.min_p > 0:
                procs.append(MinPLogitsWarper(float(p.min_p)))
        scores = procs(torch.tensor([history]), scores)
    return scores[0] if mode.endswith("logits") else torch.log_softmax(scores[0], dim=-1)


def close(got: float, want: float, tol: float) -> bool:
    """Equal within tol, -inf equal to -inf."""
    return got == want if math.isinf(want) else abs(got - want) <= tol


ROWS = [dict(temperature=0), dict(temperature=0, repetition_penalty=1.4),
        dict(temperature=0.7), dict(temperature=0.7, top_k=7),
        dict(temperature=1.3, top_p=0.8, repetition_penalty=1.2), dict(min_p=0.2)]


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_sampler_reports_each_mode_like_hf_processors(mode: str) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(ROWS), V, generator=gen) * 3
    rows = [Row(Params(logprobs=4, seed=i, **kw), [1, 5, 9, 17], 4, i)
            for i, kw in enumerate(ROWS)]
    out = Sampler(logprobs_mode=mode)(logits, columns(rows, V, [EOS]))
    top = {int(r): out.top.entry(j) for j, r in enumerate(out.top.rows)}
    for i, row in enumerate(rows):
        want = hf_values(mode, logits[i], row.params, row.token_ids)
        tok = int(out.token_ids[i])
        assert close(float(out.logprobs[i]), want[tok].item(), 1e-5), (mode, i)
        assert not math.isinf(want[tok].item())  # the drawn token was allowed
        assert len(top[i]) in (4, 5)
        for t, (v, rank) in top[i].items():
            assert close(v, want[t].item(), 1e-5)
            if math.isinf(v):  # masked tokens rank after every allowed one
                assert rank > int(torch.isfinite(want).sum())
            else:
                assert rank == int((want > want[t]).sum()) + 1
            assert t == tok or rank <= 4
    if mode.startswith("processed"):  # top-k 7 leaves 7 finite values
        assert int(torch.isfinite(hf_values(mode, logits[3], rows[3].params, [])).sum()) == 7


def test_the_mode_changes_what_is_reported_never_the_draw() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    rows = [Row(Params(logprobs=0, temperature=0.0, seed=0), [1], 1, 0),
            Row(Params(logprobs=0, seed=1), [1], 1, 1)]
    raw = Sampler(logprobs_mode="raw_logits")(logits, columns(rows, V, [EOS]))
    proc = Sampler(logprobs_mode="processed_logits")(logits, columns(rows, V, [EOS]))
    assert raw.logprobs.tolist() == pytest.approx(
        [logits[i, t].item() for i, t in enumerate(raw.token_ids.tolist())])
    assert proc.token_ids.tolist() == raw.token_ids.tolist()  # the mode never changes draws


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama", vocab_size=300, seed=11)


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_llm_sample_and_prompt_logprobs_per_mode_match_hf(model_dir, mode: str) -> None:
    llm = LLM(model_dir, logprobs_mode=mode, num_kv_blocks=64, max_num_seqs=8, seed=0)
    prompt = [1, 14, 55, 23, 9, 71, 30]
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=6, logprobs=3,
                             prompt_logprobs=2, seed=5, ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6, logprobs=3,
                             prompt_logprobs=2, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
    hf = load_hf_model(model_dir)
    for out, p in zip(outs, params):
        comp = out.outputs[0]
        ids = prompt + list(comp.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        for j, tok in enumerate(comp.token_ids):  # generated token j, scored at position n-1+j
            pos = len(prompt) - 1 + j
            want = hf_values(mode, logits[pos], p, ids[:pos + 1])
            got = comp.logprobs[j]
            assert close(got[tok].logprob, want[tok].item(), 1e-4), (mode, j)
            for t, lp in got.items():
                assert close(lp.logprob, want[t].item(), 1e-4)
                assert lp.rank == int((want > want[t] + 1e-6).sum()) + 1
        assert comp.cumulative_logprob == pytest.approx(
            sum(comp.logprobs[j][t].logprob for j, t in enumerate(comp.token_ids)), abs=1e-3)
        assert out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):  # prompt token j, scored at position j-1, no penalties
            want = hf_values(mode, logits[j - 1], p, ids[:j], penalties=False)
            for t, lp in out.prompt_logprobs[j].items():
                assert close(lp.logprob, want[t].item(), 1e-4), (mode, j, t)
    beam = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.3, temperature=0.8)
    if mode not in ("raw_logprobs", "processed_logprobs"):  # refused before any work
        for call in (llm.beam_search, llm.beam_search_stream):
            with pytest.raises(ValueError, match=r"logprobs_mode must be one of \('raw_logprobs"
                                                 rf"', 'processed_logprobs'\) for beam search.*"
                                                 f"got '{mode}'"):
                call([{"prompt_token_ids": prompt}], beam, use_tqdm=False)
        assert llm.kv_stats().prompt_tokens_computed == len(prompt) * 2  # generate's only
        return
    # a beam's tokens report the values the search ranked: HF's log_softmax, then the beam's
    # repetition penalty and temperature, in both modes (sampling/logprobs_mode.py)
    for seq in llm.beam_search([{"prompt_token_ids": prompt}], beam, use_tqdm=False)[0].sequences:
        ids = prompt + seq.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        for j, tok in enumerate(seq.token_ids):
            pos = len(prompt) - 1 + j
            want = TemperatureLogitsWarper(0.8)(None, RepetitionPenaltyLogitsProcessor(1.3)(
                torch.tensor([ids[:pos + 1]]), torch.log_softmax(logits[pos:pos + 1], -1)))[0]
            assert tok in seq.logprobs[j] and len(seq.logprobs[j]) >= 2  # its own, the top 2
            for t, lp in seq.logprobs[j].items():
                assert close(lp.logprob, want[t].item(), 1e-4), (mode, j, t)

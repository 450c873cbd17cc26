"""`batchgen.engine.beam.BeamSearchState` against HF `generate(num_beams=...)` as the oracle.

The driver runs the same tiny HF model step by step: every live beam is recomputed in full
(`use_cache=False`, all beams share one length so they form one batch), `log_softmax` in
float32 goes to `state.step`, and the beams are reordered per `parents` / `tokens` until
`done`. Sequences, `sequences_scores` (1e-4) and the number of steps must match HF.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from batchgen.engine.beam import BeamHypothesis, BeamSearchState, StopFn
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST

EOS = 2
VOCAB = 512
FAMILIES = ["llama", "gpt2", "qwen3"]
# The recommended boost reaches EOS on some beams; the heavy one makes most groups stop early.
BOOSTS = {"rec": RECOMMENDED_EOS_BOOST, "heavy": 0.2}


@pytest.fixture(scope="module")
def models(tiny_model_factory: Callable[..., Any]) -> dict[tuple[str, str], Any]:
    """(family, boost name) -> eval-mode float32 HF model."""
    from transformers import AutoModelForCausalLM

    out = {}
    for fam in FAMILIES:
        for name, boost in BOOSTS.items():
            path = tiny_model_factory(fam, eos_boost=boost)
            out[fam, name] = AutoModelForCausalLM.from_pretrained(path).eval()
    return out


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, VOCAB) for _ in range(4 + seed % 5)]


@dataclass
class Run:
    hyps: list[BeamHypothesis]
    steps: int


def hf_beam(model: Any, prompt: list[int], w: int, t: int, lp: float, es: bool | str,
            n_ret: int, eos: int | list[int] = EOS, criteria: Any = None,
            monkeypatch: pytest.MonkeyPatch | None = None) -> Run:
    """HF generate oracle; returns hypotheses (generated tokens, HF score) and step count."""
    from transformers import GenerationConfig, StoppingCriteriaList
    from transformers.generation.configuration_utils import GenerationMode

    if w == 1:  # generate(num_beams=1) is greedy: force the real `_beam_search` instead
        assert monkeypatch is not None
        orig = GenerationConfig.get_generation_mode

        def mode(self: Any, *a: Any, **k: Any) -> Any:
            m = orig(self, *a, **k)
            return GenerationMode.BEAM_SEARCH if m == GenerationMode.GREEDY_SEARCH else m

        monkeypatch.setattr(GenerationConfig, "get_generation_mode", mode)
    ids = torch.tensor([prompt])
    extra = {} if criteria is None else {"stopping_criteria": StoppingCriteriaList([criteria])}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=w,
                             num_return_sequences=n_ret, max_new_tokens=t, length_penalty=lp,
                             early_stopping=es, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=eos, pad_token_id=0,
                             **extra)
    if monkeypatch is not None:
        monkeypatch.undo()
    lens = (out.beam_indices >= 0).sum(1).tolist()
    p = len(prompt)
    hyps = [BeamHypothesis(out.sequences[i, p:p + lens[i]].tolist(), float("nan"),
                           float(out.sequences_scores[i]), "") for i in range(n_ret)]
    return Run(hyps, len(out.scores))


def drive(model: Any, prompt: list[int], state: BeamSearchState,
          is_stop: Callable[[list[int]], bool] | None = None, max_steps: int = 1000) -> Run:
    """Step the state with full-recompute logits; checks the engine-facing invariants."""
    seen: list[BeamHypothesis] = []
    steps = 0
    live: list[list[int]] = [[]]  # generated tokens of each live beam, as the engine tracks them
    while True:
        assert state.num_live_beams == len(live) == (1 if steps == 0 else state.beam_width)
        ids = torch.tensor([prompt + b for b in live])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[:, -1, :]
        logprobs = F.log_softmax(logits.float(), dim=-1)
        fn: StopFn | None = None
        if is_stop is not None:
            def fn(parent: int, tok: int, live: list[list[int]] = live) -> bool:
                return is_stop(live[parent] + [tok])
        st = state.step(logprobs, fn)
        steps += 1
        seen.extend(st.finished)
        for h in st.finished:
            assert len(h.token_ids) == steps
        if st.done:
            assert st.parents == [] and st.tokens == [] and state.num_live_beams == 0
            break
        assert len(st.parents) == len(st.tokens) == state.beam_width
        assert all(0 <= p < len(live) for p in st.parents)
        live = [live[p] + [t] for p, t in zip(st.parents, st.tokens)]
        assert steps < max_steps
    hyps = state.finalize()
    assert len(hyps) == state.num_return_sequences
    assert all(a.score >= b.score for a, b in zip(hyps, hyps[1:]))
    for h in hyps:  # per-token logprobs add up to the hypothesis's sum; ranks start at 1
        assert len(h.token_logprobs) == len(h.token_ids)
        assert all(t.rank >= 1 for t in h.token_logprobs)
        if h.score > -1e8:
            assert sum(t.logprob for t in h.token_logprobs) == pytest.approx(h.sum_logprobs,
                                                                             abs=1e-3)
    for h in hyps:  # every returned hypothesis was announced in some step's `finished`
        assert any(s.token_ids == h.token_ids and s.score == h.score for s in seen)
    return Run(hyps, steps)


def check(ours: Run, hf: Run, lp: float, stop_ids: tuple[int, ...] = (EOS,),
          is_stop: Callable[[list[int]], bool] | None = None) -> None:
    assert [h.token_ids for h in ours.hyps] == [h.token_ids for h in hf.hyps]
    for a, b in zip(ours.hyps, hf.hyps):
        assert a.score == pytest.approx(b.score, abs=1e-4)
        n = len(a.token_ids)
        assert a.sum_logprobs / n**lp == pytest.approx(a.score, rel=1e-5, abs=1e-5)
        stopped = a.token_ids[-1] in stop_ids or (is_stop is not None and is_stop(a.token_ids))
        assert a.finish_reason == ("stop" if stopped else "length")
    assert ours.steps == hf.steps


def compare(model: Any, prompt: list[int], w: int, t: int, lp: float, es: bool | str,
            n_ret: int | None = None, monkeypatch: pytest.MonkeyPatch | None = None) -> Run:
    n_ret = w if n_ret is None else n_ret
    hf = hf_beam(model, prompt, w, t, lp, es, n_ret, monkeypatch=monkeypatch)
    state = BeamSearchState(w, t, lp, es, [EOS], n_ret, VOCAB)
    ours = drive(model, prompt, state)
    check(ours, hf, lp)
    return ours


# All W x length_penalty at early_stopping=False, on every family, two prompts each (one on the
# EOS-heavy model so that groups also stop before max_tokens).
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize("lp", [0.0, 1.0, 2.0, -1.0])
def test_matches_hf_width_and_length_penalty(models: dict, family: str, w: int, lp: float,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    seed = w * 7 + int(lp * 3) + 11 * FAMILIES.index(family)
    t = 8 + seed % 5
    for boost in BOOSTS:
        n_ret = w if boost == "rec" or w == 1 else w // 2
        compare(models[family, boost], _prompt(seed), w, t, lp, False, n_ret, monkeypatch)


# Every early_stopping mode at W=4 with several length penalties, on every family.
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("es", [True, False, "never"])
@pytest.mark.parametrize("lp", [1.0, 2.0, -1.0, 0.0])
def test_matches_hf_early_stopping(models: dict, family: str, es: bool | str, lp: float) -> None:
    for i, boost in enumerate(BOOSTS):
        seed = 100 + 5 * i + int(lp * 2) + 3 * FAMILIES.index(family)
        compare(models[family, boost], _prompt(seed), 4, 10, lp, es)


@pytest.mark.parametrize("w,es", [(1, False), (1, "never"), (3, True), (8, "never")])
def test_matches_hf_early_stopping_other_widths(models: dict, w: int, es: bool | str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in range(3):
        compare(models["llama", "heavy"], _prompt(200 + seed), w, 11, 1.5, es,
                monkeypatch=monkeypatch)


def test_oracle_cases_cover_both_endings(models: dict) -> None:
    """The compared cases really include early stops, EOS endings and max_tokens endings."""
    runs = [compare(models[fam, b], _prompt(s), 4, 10, lp, es)
            for fam in FAMILIES for b in BOOSTS for s in (0, 7)
            for lp, es in [(1.0, False), (0.0, True)]]
    assert any(r.steps < 10 for r in runs) and any(r.steps == 10 for r in runs)
    reasons = {h.finish_reason for r in runs for h in r.hyps}
    assert reasons == {"stop", "length"}
    assert any(all(h.finish_reason == "stop" for h in r.hyps) for r in runs)
    assert any(all(h.finish_reason == "length" for h in r.hyps) for r in runs)


def test_width_one_early_stopping_true_is_greedy(models: dict) -> None:
    """W=1 with early_stopping=True reproduces HF greedy (until EOS or max_tokens)."""
    model = models["qwen3", "heavy"]
    for seed in range(4):
        prompt = _prompt(300 + seed)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                    do_sample=False, eos_token_id=EOS, pad_token_id=0)
        toks = greedy[0, len(prompt):].tolist()
        if EOS in toks:
            toks = toks[:toks.index(EOS) + 1]
        run = drive(model, prompt, BeamSearchState(1, 10, 1.0, True, [EOS], 1, VOCAB))
        assert run.hyps[0].token_ids == toks


def _frequent_token(run: Run) -> int:
    """A non-EOS token that occurs inside the hypotheses (so that stopping on it matters)."""
    counts: dict[int, int] = {}
    for h in run.hyps:
        for tok in h.token_ids[1:-1]:
            if tok != EOS:
                counts[tok] = counts.get(tok, 0) + 1
    return max(counts, key=lambda k: (counts[k], -k))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("w,lp,es", [(4, 1.0, False), (2, 0.0, True), (8, 2.0, "never")])
def test_stop_token_id_behaves_like_an_extra_eos(models: dict, family: str, w: int, lp: float,
                                                 es: bool | str) -> None:
    model = models[family, "rec"]
    prompt = _prompt(400 + w)
    base = drive(model, prompt, BeamSearchState(w, 10, lp, es, [EOS], w, VOCAB))
    stop = _frequent_token(base)
    # Oracle: HF with the stop id as a second EOS id (K = 3 * W in both).
    hf = hf_beam(model, prompt, w, 10, lp, es, w, eos=[EOS, stop])
    state = BeamSearchState(w, 10, lp, es, [EOS], w, VOCAB, stop_token_ids=[stop])
    assert state.num_candidates == 3 * w
    ours = drive(model, prompt, state)
    check(ours, hf, lp, stop_ids=(EOS, stop))
    assert all(stop not in h.token_ids[:-1] for h in ours.hyps)
    assert [h.token_ids for h in ours.hyps] != [h.token_ids for h in base.hyps]
    if lp < 2.0:  # lp = 2 favours long hypotheses: the short stopped ones may all lose
        assert any(h.token_ids[-1] == stop for h in ours.hyps)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stop_callback_matches_hf_stopping_criteria(models: dict, family: str) -> None:
    """`is_stop` (stop strings) = a HF StoppingCriteria on the K candidates; K is unchanged."""
    from transformers import StoppingCriteria

    model = models[family, "rec"]
    prompt = _prompt(500)
    w, lp = 4, 0.0  # no length normalisation: the short stopped hypotheses win
    base = drive(model, prompt, BeamSearchState(w, 10, lp, False, [EOS], w, VOCAB))
    longest = max((h.token_ids for h in base.hyps), key=len)
    bigram = longest[2:4]  # a two-token "stop string" that the search actually produces
    assert len(bigram) == 2 and EOS not in bigram

    def is_stop(gen: list[int]) -> bool:
        return gen[-2:] == bigram

    class Bigram(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
            gen = input_ids[:, len(prompt):]
            return torch.tensor([is_stop(row) for row in gen.tolist()], dtype=torch.bool)

    hf = hf_beam(model, prompt, w, 10, lp, False, w, criteria=Bigram())
    state = BeamSearchState(w, 10, lp, False, [EOS], w, VOCAB)
    ours = drive(model, prompt, state, is_stop=is_stop)
    check(ours, hf, lp, is_stop=is_stop)
    assert any(h.token_ids[-2:] == bigram for h in ours.hyps)
    assert all(not is_stop(h.token_ids[:i]) for h in ours.hyps for i in range(len(h.token_ids)))


def test_wide_beam_runs_quickly(models: dict) -> None:
    model = models["gpt2", "rec"]
    ours = compare(model, _prompt(600), 64, 10, 1.0, False)
    assert len(ours.hyps) == 64
    assert len({tuple(h.token_ids) for h in ours.hyps}) == 64


def test_first_step_accepts_one_or_width_rows() -> None:
    g = torch.Generator().manual_seed(0)
    row = F.log_softmax(torch.randn(1, 50, generator=g) * 3, dim=-1)
    a = BeamSearchState(4, 5, 1.0, False, [EOS], 2, 50)
    b = BeamSearchState(4, 5, 1.0, False, [EOS], 2, 50)
    sa, sb = a.step(row), b.step(row.expand(4, 50).clone())
    assert sa.tokens == sb.tokens and sa.parents == sb.parents == [0] * 4
    best = [t for t in torch.topk(row[0], 8).indices.tolist() if t != EOS][:4]
    assert sa.tokens == best  # the best unfinished continuations, in order
    with pytest.raises(ValueError):
        a.step(row)  # 1 row but 4 live beams now


def test_max_tokens_one_finalises_top_candidates() -> None:
    logprobs = F.log_softmax(torch.tensor([[0.0, 1.0, 3.0, 2.0, -1.0]]), dim=-1)
    state = BeamSearchState(2, 1, 1.0, False, [EOS], 2, 5)
    st = state.step(logprobs)
    assert st.done and st.parents == []
    hyps = state.finalize()
    assert [h.token_ids for h in hyps] == [[2], [3]]
    assert [h.finish_reason for h in hyps] == ["stop", "length"]
    assert hyps[0].score == pytest.approx(float(logprobs[0, 2]))
    with pytest.raises(RuntimeError):
        state.step(logprobs)

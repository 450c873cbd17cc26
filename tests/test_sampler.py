"""Sampler: HF-exact processed distribution, empirical sampling, seeding, penalties, logprobs."""

from __future__ import annotations

import math
import random

import numpy as np
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

from batchgen.params import SamplingParams
from batchgen.sampling.sampler import (
    Sampler,
    apply_min_tokens,
    apply_penalties,
    apply_warpers,
    uniforms,
)
from tests.sampling_rows import Row, columns

V = 200
EOS = 2


def sample(logits: torch.Tensor, rows: list[Row]):
    """The sampler on these rows, as the engine calls it."""
    return Sampler()(logits, columns(rows, logits.shape[1], [EOS]))


def processed_logprobs(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The [N, V] fp32 log-distribution each row is drawn from (greedy rows: a point mass),
    from the sampler's own stages: what the tests compare with HF's processors."""
    cols = columns(rows, logits.shape[1], [EOS])
    params = torch.from_numpy(cols.params)
    scores = apply_min_tokens(apply_penalties(logits.float(), cols, params), cols)
    out = torch.full_like(scores, float("-inf"))
    for i, row in enumerate(rows):
        if row.params.greedy:
            out[i, scores[i].argmax()] = 0.0
        else:
            warped = apply_warpers(scores[i:i + 1], cols.params[i:i + 1], params[i:i + 1])
            out[i] = torch.log_softmax(warped[0], dim=-1)
    return out


def _row(history: list[int] | None = None, num_prompt: int | None = None, seed: int = 0,
         **kw) -> Row:
    """A row with the given params, history and seed."""
    history = [1, 5, 9] if history is None else history
    return Row(SamplingParams(**kw), list(history),
               len(history) if num_prompt is None else num_prompt, seed)


def _hf_logprobs(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """log_softmax of HF's processors, in HF generate order, on one row."""
    p = row.params
    procs = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty)))
    if p.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(float(p.temperature)))
    if p.top_k > 0:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(float(p.top_p)))
    if p.min_p > 0.0:
        procs.append(MinPLogitsWarper(float(p.min_p)))
    scores = procs(torch.tensor([row.token_ids]), logits[None].clone().float())
    return torch.log_softmax(scores, dim=-1)[0]


def _assert_same_logprobs(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same -inf positions and finite values within 1e-6."""
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert finite.any()
    assert (got[finite] - want[finite]).abs().max().item() <= 1e-6


COMBOS = [
    {},
    {"temperature": 0.7},
    {"temperature": 1.6, "top_k": 12},
    {"top_p": 0.8},
    {"temperature": 0.9, "top_p": 0.6, "top_k": 40},
    {"min_p": 0.1},
    {"temperature": 1.3, "top_k": 30, "top_p": 0.9, "min_p": 0.05},
    {"repetition_penalty": 1.5},
    {"repetition_penalty": 0.7, "temperature": 0.8, "top_p": 0.95},
    {"repetition_penalty": 1.2, "temperature": 1.1, "top_k": 25, "top_p": 0.7, "min_p": 0.02},
    {"top_k": 1},
    {"top_k": 500},
    {"top_p": 0.01},
    {"min_p": 1.0},
]


def test_processed_distribution_matches_hf_in_one_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(COMBOS), V, generator=gen) * 2.0
    hist = torch.randint(0, V, (len(COMBOS), 12), generator=gen).tolist()
    rows = [_row(h, 5, **kw) for h, kw in zip(hist, COMBOS)]
    got = processed_logprobs(logits, rows)
    for i, row in enumerate(rows):
        _assert_same_logprobs(got[i], _hf_logprobs(logits[i], row))


def test_top_k_keeps_ties_like_hf() -> None:
    logits = torch.linspace(-3, 3, V)
    logits[[10, 20, 30]] = logits[-3].item()  # three extra copies of the 3rd-largest value
    row = _row(top_k=3)
    got = processed_logprobs(logits[None], [row])[0]
    _assert_same_logprobs(got, _hf_logprobs(logits, row))
    assert (~torch.isinf(got)).sum().item() == 6


def test_presence_and_frequency_penalties_use_generated_ids_only() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    prompt, generated = [4, 4, 6], [6, 7, 7, 7]
    row = _row(prompt + generated, len(prompt), presence_penalty=0.5, frequency_penalty=0.25)
    expected = logits[0].clone()
    expected[6] -= 0.25 * 1 + 0.5
    expected[7] -= 0.25 * 3 + 0.5
    got = processed_logprobs(logits, [row])[0]
    torch.testing.assert_close(got, torch.log_softmax(expected, -1), rtol=0, atol=1e-6)


def test_repetition_penalty_then_frequency_penalty_order() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4)])
    row = _row([0, 1, 3], 1, repetition_penalty=2.0, frequency_penalty=1.0)
    expected = logits[0].clone()
    expected[0] = 2.0 / 2.0  # prompt id: repetition only
    expected[1] = -2.0 * 2.0 - 1.0  # generated: repetition, then frequency
    expected[3] = 0.5 / 2.0 - 1.0
    got = processed_logprobs(logits, [row])[0]
    torch.testing.assert_close(got, torch.log_softmax(expected, -1), rtol=0, atol=1e-6)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square of observed counts against probabilities over their support."""
    n = counts.sum()
    support = probs > 0
    expected = probs[support] * n
    return (((counts[support] - expected) ** 2) / expected).sum().item()


def _chi_square_bound(df: int) -> float:
    """Upper chi-square quantile near p = 1e-6 (Wilson-Hilferty)."""
    z = 4.75
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_frequencies_match_processed_probabilities(seeded: bool) -> None:
    """Many sequences drawing once: consecutive user seeds (seeded) or the random 64-bit seeds
    unseeded requests get."""
    vocab = 40
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    kw = {"temperature": 0.8, "top_k": 15, "top_p": 0.97, "min_p": 0.02, "repetition_penalty": 1.3}
    n = 5000 if seeded else 20000
    rng = random.Random(7)
    seeds = range(1000, 1000 + n) if seeded else [rng.getrandbits(64) for _ in range(n)]
    rows = [_row([3, 7, 11], seed=s, **kw) for s in seeds]
    probs = processed_logprobs(logits, rows[:1])[0].exp()
    out = sample(logits.expand(n, vocab), rows)
    counts = torch.bincount(torch.from_numpy(out.token_ids), minlength=vocab).float()
    assert counts[probs == 0].sum() == 0  # masked tokens never drawn
    support = int((probs > 0).sum())
    assert support >= 6
    bound = _chi_square_bound(support - 1)
    assert _chi_square(counts, probs) < bound
    # Power check: the distribution without temperature/penalty must be rejected.
    wrong_rows = [_row([3, 7, 11], top_k=15, top_p=0.97, min_p=0.02)]
    wrong = processed_logprobs(logits, wrong_rows)[0].exp()
    assert _chi_square(counts, wrong) > 2 * bound


def test_greedy_is_argmax_of_penalised_logits_and_uses_no_randomness() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, V, generator=gen)
    top = int(logits[1].argmax())
    logits[1, top] = 10.0

    def rows(seed: int) -> list[Row]:
        return [_row(temperature=0, seed=seed),
                _row([top], temperature=0, repetition_penalty=100.0, seed=seed + 1),
                _row(temperature=0, top_k=3, seed=seed + 2)]

    out = sample(logits, rows(0))
    penalised = logits[1].clone()
    penalised[top] /= 100.0
    want = [int(logits[0].argmax()), int(penalised.argmax()), int(logits[2].argmax())]
    assert out.token_ids.tolist() == want
    assert sample(logits, rows(12345)).token_ids.tolist() == want  # no draw involved
    point_mass = processed_logprobs(logits, rows(0))
    assert point_mass.exp().sum(-1).tolist() == [1.0, 1.0, 1.0]
    assert point_mass.argmax(-1).tolist() == want


def test_fast_path_all_greedy_and_half_precision_input() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out = sample(logits, [_row(temperature=0) for _ in range(5)])
    assert out.token_ids.tolist() == logits.float().argmax(-1).tolist()
    want = torch.log_softmax(logits.float(), -1).gather(1, torch.from_numpy(out.token_ids)[:, None])
    assert out.logprobs.tolist() == pytest.approx(want[:, 0].tolist(), abs=1e-6)


def test_seeded_row_does_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(6)
    steps = [torch.randn(4, V, generator=gen) for _ in range(6)]
    kw = {"temperature": 1.2, "top_p": 0.95}

    def run(position: int, others: list[Row]) -> list[int]:
        """Sample 6 steps of the seed-123 row placed at ``position`` among ``others``."""
        tokens: list[int] = []
        for logits in steps:
            target = _row([1, 5, 9, *tokens], 3, seed=123, **kw)
            rows = others[:position] + [target] + others[position:]
            batch = torch.cat([logits[3:4] if j == position else logits[j % 3:j % 3 + 1]
                               for j in range(len(rows))])
            tokens.append(int(sample(batch, rows).token_ids[position]))
        return tokens

    alone = run(0, [])
    mixed = run(2, [_row(seed=5, **kw), _row(top_k=5), _row(temperature=0), _row(min_p=0.3)])
    other = run(1, [_row(seed=77), _row(seed=9, repetition_penalty=1.4, top_k=10)])
    assert alone == mixed == other
    assert len(set(alone)) > 1  # the draws move on with each generated token


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    logits = torch.zeros(1, V)  # uniform: every draw is pure noise

    def draws(seed: int) -> list[int]:
        """Ten successive draws of one sequence (its history grows by each token)."""
        tokens: list[int] = []
        for _ in range(10):
            tokens.append(int(sample(logits, [_row([1, 5, 9, *tokens], 3, seed=seed)]).token_ids[0]))
        return tokens

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_successive_draws_of_one_sequence_are_uniform() -> None:
    """The counter-based draws: one sequence's 20,000 successive uniforms (its key, counters
    0..n-1) and 20,000 sequences' first ones fill [0, 1) evenly, and they are uncorrelated
    between neighbouring counters."""
    from batchgen.sampling.sampler import mix_seeds

    n, bins = 20000, 50
    key = mix_seeds(np.array([123], np.uint64))
    along = uniforms(np.repeat(key, n), np.arange(n))
    across = uniforms(mix_seeds(np.arange(n, dtype=np.uint64)), np.zeros(n, np.int64))
    uniform = torch.full((bins,), 1.0 / bins)
    bound = _chi_square_bound(bins - 1)
    for u in (along, across):
        assert 0.0 <= u.min() and u.max() < 1.0
        counts = torch.from_numpy(np.bincount((u * bins).astype(np.int64), minlength=bins))
        assert _chi_square(counts.float(), uniform) < bound
    assert abs(np.corrcoef(along[:-1], along[1:])[0, 1]) < 0.03


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_min_tokens_bans_eos_and_stop_ids(temperature: float) -> None:
    logits = torch.zeros(3, V)
    logits[:, EOS] = 60.0
    logits[:, 7] = 40.0
    logits[:, 11] = 20.0
    kw = {"temperature": temperature, "min_tokens": 3, "stop_token_ids": [7]}
    rows = [_row([1, 4, 5], 2, **kw),  # 1 generated < 3: EOS and 7 banned
            _row([1, 4, 5, 6], 1, **kw),  # 3 generated: nothing banned
            _row([1, 4], 2, ignore_eos=True, **kw)]  # EOS is no stop token with ignore_eos
    out = sample(logits, rows)
    assert out.token_ids.tolist() == [11, EOS, EOS]
    lp = processed_logprobs(logits, rows)
    assert torch.isinf(lp[0, [EOS, 7]]).all()
    if temperature:
        assert not torch.isinf(lp[2, EOS]) and torch.isinf(lp[2, 7])


def test_logprobs_are_raw_with_top_k_and_chosen() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(4, V, generator=gen) * 3
    rows = [_row(logprobs=5, temperature=0.5, repetition_penalty=1.5),
            _row(logprobs=0),
            _row(),
            _row(logprobs=3, top_k=50, temperature=3.0)]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i, (tok, lp) in enumerate(zip(out.token_ids.tolist(), out.logprobs.tolist())):
        assert lp == pytest.approx(raw[i, tok].item(), abs=1e-5)
    top = {int(r): out.top.entry(j) for j, r in enumerate(out.top.rows)}
    assert sorted(top) == [0, 1, 3]  # row 2 asked for none
    ((tok1, (lp1, rank1)),) = top[1].items()
    assert tok1 == out.token_ids[1] and lp1 == pytest.approx(out.logprobs[1])
    assert rank1 == int((raw[1] > raw[1, tok1]).sum()) + 1  # its true rank
    for i, k in ((0, 5), (3, 3)):
        d = top[i]
        order = raw[i].argsort(descending=True).tolist()
        assert set(d) == set(order[:k]) | {out.token_ids[i]}
        assert len(d) in (k, k + 1)
        for t, (v, rank) in d.items():
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)
            assert rank == order.index(t) + 1  # 1 = the most likely, chosen tokens included


def test_top_k_one_is_always_argmax_and_history_ids_beyond_vocab_are_ignored() -> None:
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(9))
    rows = [_row([V + 5, 3], 1, top_k=1, repetition_penalty=1.3, frequency_penalty=0.5,
                 seed=i) for i in range(64)]
    assert sample(logits, rows).token_ids.tolist() == logits.argmax(-1).tolist()


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, V), [_row()])


def test_inverse_cdf_never_picks_a_masked_token():
    """u at the very top of [0, 1) still lands on the last token with probability > 0."""
    from batchgen.sampling.sampler import _inverse_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.2, 0.0, 0.8, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.25, 0.5, 0.75, 1 - 2 ** -30, 1 - 1e-12):
        idx = _inverse_cdf(probs, torch.tensor([u, u], dtype=torch.float64))
        assert all(probs[r, i] > 0 for r, i in enumerate(idx.tolist()))
    assert _inverse_cdf(probs, torch.tensor([0.0, 0.0], dtype=torch.float64)).tolist() == [1, 0]
    assert _inverse_cdf(probs, torch.tensor([0.99, 0.99], dtype=torch.float64)).tolist() == [3, 2]


@pytest.mark.parametrize("kind", ["continuous", "bfloat16", "few values", "masked"])
def test_cpu_top_p_by_value_equals_the_sorting_warper(kind: str) -> None:
    """The CPU top-p sorts values only (numpy) and falls back to torch's sort for rows whose
    cut splits a run of tied tokens: its result is bit for bit the sorting warper's (HF's
    TopPLogitsWarper), ties included."""
    from batchgen.sampling.sampler import _top_p_by_value, _top_p_sorted

    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(300, 500, generator=gen) * 3
    if kind == "bfloat16":
        scores = scores.to(torch.bfloat16).float()
    elif kind == "few values":
        scores = torch.randint(0, 6, (300, 500), generator=gen).float()
    elif kind == "masked":
        scores[torch.rand(300, 500, generator=gen) < 0.7] = float("-inf")
    top_p = torch.rand(300, 1, generator=gen).clamp(0.01, 0.999)
    cut = torch.where(torch.rand(300, 1, generator=gen) < 0.1, torch.tensor(-1.0), 1.0 - top_p)
    want = _top_p_sorted(scores, cut)
    for ops in (None, cpu_ops_or_skip()):
        got = _top_p_by_value(scores, cut, ops)
        assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got, want)


def test_unpenalised_rows_beside_penalised_ones_are_untouched() -> None:
    """A slot a penalised sequence left, reused by an unpenalised one, subtracts nothing."""
    import numpy as np

    from batchgen.engine.batch import PersistentBatch
    from batchgen.engine.policy import SamplePolicy
    from batchgen.engine.sequence import Sequence, SequenceGroup
    from batchgen.kinds import sample_spec

    batch = PersistentBatch(2, V, 1, [EOS], torch.device("cpu"))

    def enter(params: SamplingParams, tokens: list[int]) -> Sequence:
        group = SequenceGroup(0, None, tokens[:2], params, 50, SamplePolicy(),
                              sample_spec(params, 50, False))
        seq = Sequence(group, 0, list(tokens), None, 1)
        batch.enter(seq, [0], 0)
        return seq

    penalised = SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=1.0,
                               repetition_penalty=2.0)
    first = enter(penalised, [5, 6, 7, 7, 8])
    enter(penalised, [9, 10, 11])
    batch.remove(first)  # its slot 0 takes the second sequence; slot 1 is free again
    plain = enter(SamplingParams(temperature=0), [5, 6, 7, 7, 8])
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    cols = batch.sampling_columns(np.array([plain.slot, 0]))
    assert plain.slot == 1 and cols.offsets is not None  # the step has a penalised row
    penalised_scores = apply_penalties(logits, cols, torch.from_numpy(cols.params))
    assert torch.equal(penalised_scores[0], logits[0])  # the slot's old offsets are gone
    assert not torch.equal(penalised_scores[1], logits[1])


def cpu_ops_or_skip():
    """The sampler's C loops, built on first use; skips where they cannot be built."""
    from batchgen.sampling import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("CPU sampling ops unavailable here (no C compiler, or BATCHGEN_CPU_KERNEL=0)")
    return ops


@pytest.mark.parametrize("penalties", ["both", "repetition", "frequency", "none"])
def test_cpu_ops_give_the_pytorch_stages_bits(penalties: str) -> None:
    """The penalties and the top-k, top-p and min-p masks as C loops: the same bits as the
    PyTorch stages on a mixed batch (every stage on some rows, none on others)."""
    ops = cpu_ops_or_skip()
    gen = torch.Generator().manual_seed(12)
    logits = (torch.randn(len(COMBOS) * 4, V, generator=gen) * 3).to(torch.bfloat16).float()
    hist = torch.randint(0, V, (logits.shape[0], 12), generator=gen).tolist()
    combos = [{k: v for k, v in c.items()
               if k != "repetition_penalty" or penalties in ("both", "repetition")}
              for c in COMBOS]
    freq = 0.1 if penalties in ("both", "frequency") else 0.0
    rows = [_row(h, 5, seed=i, **combos[i % len(combos)], frequency_penalty=freq * (i % 3))
            for i, h in enumerate(hist)]
    cols = columns(rows, V, [EOS])
    params = torch.from_numpy(cols.params)
    plain = apply_penalties(logits, cols, params)
    fast = apply_penalties(logits, cols, params, ops)
    assert torch.equal(plain, fast)
    sampled = ~cols.greedy
    p, sp = cols.params[sampled], params[torch.from_numpy(sampled)]
    assert torch.equal(apply_warpers(plain[torch.from_numpy(sampled)], p, sp),
                       apply_warpers(plain[torch.from_numpy(sampled)], p, sp, ops))
    a, b = Sampler(use_cpu_ops=False)(logits, cols), Sampler()(logits, cols)
    assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.logprobs, b.logprobs)


def test_cpu_uniforms_equal_numpy() -> None:
    """The draws' uniforms from the C loop and from numpy: the same doubles."""
    from batchgen.sampling.sampler import mix_seeds

    ops = cpu_ops_or_skip()
    keys = mix_seeds(np.arange(1000, dtype=np.uint64) * np.uint64(7919))
    counters = np.arange(1000, dtype=np.int64) % 97
    assert np.array_equal(ops.uniforms(keys, counters), uniforms(keys, counters))


def test_a_sequence_key_is_mix_seeds_of_its_seed() -> None:
    """The batch mixes each entering sequence's seed in Python integers: the same key as
    sampler.mix_seeds, for seeds of every sign and size torch generators take."""
    from batchgen.engine.batch import _mix_seed
    from batchgen.sampling.sampler import mix_seeds

    seeds = [0, 1, 7, -1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1, 123456789123456789]
    want = mix_seeds(np.array([s % 2**64 for s in seeds], np.uint64)).view(np.int64).tolist()
    assert [_mix_seed(s) for s in seeds] == want

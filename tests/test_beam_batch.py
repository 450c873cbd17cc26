"""Many beam requests stepped in one pass equal each stepped alone, bit for bit; a beam that
adopts another's blocks leaves the pool as a fork to a new child and a free would."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.engine.beam import BeamSearchState, step_many
from batchgen.engine.beam_batch import BeamBank
from batchgen.kv.block_manager import BlockManager

W, V, EOS = 4, 40, 3
SETTINGS = [  # (max_tokens, length_penalty, early_stopping, num_return_sequences)
    (6, 1.0, False, 4), (9, 0.5, True, 2), (7, 2.0, "never", 3), (5, -1.0, False, 1),
    (8, 1.0, "never", 4)]


def _state(max_tokens: int, lp: float, early: bool | str, n: int) -> BeamSearchState:
    return BeamSearchState(W, max_tokens, lp, early, [EOS], n, V, top_logprobs=2)


def _rows(gen: torch.Generator, first: bool) -> torch.Tensor:
    """A step's log-probs with EOS likely enough to finish hypotheses early."""
    logits = torch.randn(1 if first else W, V, generator=gen) * 2
    logits[:, EOS] += 1.5
    return F.log_softmax(logits, dim=-1)


def test_many_requests_in_one_pass_equal_each_alone() -> None:
    alone = [_state(*s) for s in SETTINGS]
    many = [_state(*s) for s in SETTINGS]
    bank = BeamBank(W, 1, torch.device("cpu"))
    for s in many:
        s.join(bank)
    gen = torch.Generator().manual_seed(0)
    steps = 0
    while not all(s.done for s in alone):
        live = [i for i, s in enumerate(alone) if not s.done]
        rows = {i: _rows(gen, steps == 0) for i in live}
        solo = {i: alone[i].step(rows[i]) for i in live}
        batch = torch.stack([rows[i].expand(W, V) for i in live]).contiguous()
        result = step_many([many[i] for i in live], batch, [steps == 0] * len(live), {})
        for g, i in enumerate(live):
            got = many[i].step_of(result, g, [s for r, s in result.admitted if r == g])
            want = solo[i]
            assert (got.parents, got.tokens, got.done) == (want.parents, want.tokens, want.done)
            assert [h.token_ids for h in got.finished] == [h.token_ids for h in want.finished]
        steps += 1
    assert all(s.done for s in many) and steps > 3
    assert len({s.gen_len for s in alone}) > 1  # the requests finished at different steps
    for a, b in zip(alone, many):
        ha, hb = a.finalize(), b.finalize()
        assert [(h.token_ids, h.score, h.sum_logprobs, h.finish_reason) for h in ha] == \
            [(h.token_ids, h.score, h.sum_logprobs, h.finish_reason) for h in hb]
        assert [[(t.logprob, t.rank) for t in h.token_logprobs] for h in ha] == \
            [[(t.logprob, t.rank) for t in h.token_logprobs] for h in hb]
        assert [t.entry(x) for h in ha for x, t in zip(h.token_ids, h.token_logprobs)] == \
            [t.entry(x) for h in hb for x, t in zip(h.token_ids, h.token_logprobs)]


def _pool() -> BlockManager:
    """A parent 'p' (4 blocks) and a beam 'u' sharing its first two blocks and owning two more
    (they go back, in table order, when 'u' is freed)."""
    bm = BlockManager(16, 4)
    bm.allocate("p", 16)
    bm.fork("p", "u", 8)
    bm.append_tokens(["u", "u"], [8, 12])
    return bm


def test_adopt_leaves_the_pool_as_fork_then_free() -> None:
    a, b = _pool(), _pool()
    a.fork("p", "child")
    a.free_seq("u")
    b.adopt("u", "p")
    assert b.table("u") == a.table("child") == a.table("p")
    assert list(a.ref_count) == list(b.ref_count)
    assert a.num_free_blocks() == b.num_free_blocks() == 16 - 4
    order_a = a.append_tokens(["p"] * 3, [16, 20, 24])  # the free list's order
    order_b = b.append_tokens(["p"] * 3, [16, 20, 24])
    assert order_a == order_b


def test_ranks_from_the_candidates_equal_whole_row_ranks_also_on_ties() -> None:
    """Each candidate's rank (read from the K candidates, the K-th's row in full) equals the
    count over its parent's whole row, also where values tie at the K-th candidate (coarse
    log-probs: many exact ties, redone in full) and where a row holds -inf (a banned token);
    request 0's fine log-probs take the fast path."""
    states = [BeamSearchState(W, 5, 1.0, False, [EOS], W, V) for _ in range(3)]
    bank = BeamBank(W, 1, torch.device("cpu"))
    for s in states:
        s.join(bank)
    gen = torch.Generator().manual_seed(1)
    ties = 0
    for step in range(4):
        rows = torch.randint(-6, 0, (3, 1 if step == 0 else W, V), generator=gen).float()
        rows[0] = F.log_softmax(torch.randn(rows.shape[1:], generator=gen), dim=-1)
        rows[:, :, 7] = float("-inf")
        rows = rows.expand(3, W, V).contiguous()
        result = step_many(states, rows.clone(), [step == 0] * 3, {})
        rec = result.record
        for g in range(3):
            parent_rows = rows[g][torch.from_numpy(rec.parents[g])]
            lp = parent_rows.gather(1, torch.from_numpy(rec.ids[g])[:, None])
            assert rec.ranks[g].tolist() == ((parent_rows > lp).sum(-1) + 1).tolist()
            assert rec.logprobs[g].tolist() == lp[:, 0].tolist()
        ties += int((rows.reshape(3, -1).topk(2 * W).values[:, -2:].diff(dim=1) == 0).sum())
    assert ties > 0  # the tie path ran

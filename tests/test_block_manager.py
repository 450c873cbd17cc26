"""BlockManager beyond the chapter's own snippets (tests/test_chapter_snippets.py): COW counts,
exhaustion, peaks, and invariants over random operations."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.kv import BlockManager, PoolExhausted
from batchgen.kv.block_manager import chain_hashes
from tests.helpers import check_pool_invariants


def test_fork_and_cow_copy_only_the_written_block():
    mgr = BlockManager(num_blocks=16, block_size=4)
    mgr.allocate("p", 10)  # 3 blocks, last one partial
    mgr.fork("p", "c")
    assert all(mgr.ref_count[b] == 2 for b in mgr.table("p"))
    src, dst = mgr.cow_append("c", 2)
    assert src != dst and src == mgr.table("p")[2] and dst == mgr.table("c")[2]
    assert mgr.ref_count[src] == 1 and mgr.ref_count[dst] == 1
    assert mgr.table("c")[:2] == mgr.table("p")[:2]
    assert mgr.cow_append("p", 2) == (src, src)  # the parent now owns it alone: no copy
    assert mgr.cow_copies == 1
    mgr.free_seq("p")
    mgr.free_seq("c")
    assert mgr.num_free_blocks() == 16


def test_exhaustion_raises_dedicated_error_and_takes_nothing():
    mgr = BlockManager(num_blocks=3, block_size=4)
    mgr.allocate("a", 8)
    with pytest.raises(PoolExhausted):
        mgr.allocate("b", 8)
    assert not mgr.has_table("b") and mgr.num_free_blocks() == 1
    mgr.append_token("a", 8)  # the last free block
    with pytest.raises(PoolExhausted):
        mgr.append_token("a", 12)
    with pytest.raises(PoolExhausted):
        mgr.reserve([("a", 12, 8)])
    assert len(mgr.table("a")) == 3 and mgr.num_free_blocks() == 0
    assert issubclass(PoolExhausted, MemoryError)


def test_peak_blocks_tracks_the_high_water_mark():
    mgr = BlockManager(num_blocks=10, block_size=2)
    mgr.allocate(1, 6)
    mgr.allocate(2, 4)
    mgr.free_seq(1)
    mgr.allocate(3, 2)
    assert mgr.peak_blocks_in_use == 5
    mgr.reset_stats()
    assert mgr.peak_blocks_in_use == 3


ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "fork", "cow", "free", "append",
                                         "register", "hit", "abort"]),
                         st.integers(0, 5), st.integers(0, 5), st.integers(1, 40)),
               max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(1, 24))
def test_invariants_hold_under_random_operations(ops, block_size, num_blocks):
    """Random allocate / grow / fork / COW / free / prefix-cache publish and hit / abort: the
    bookkeeping stays consistent and a failed operation takes nothing."""
    mgr = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    lengths: dict[int, int] = {}
    contents: dict[int, list[int]] = {}  # token ids per sequence, to hash its full blocks
    for op, a, b, n in ops:
        before = (list(mgr._free), {k: list(v) for k, v in mgr.tables()},
                  list(mgr.ref_count))
        try:
            if op == "alloc" and a not in lengths:
                mgr.allocate(a, n)
                lengths[a], contents[a] = n, [a * 1000 + i for i in range(n)]
            elif op == "grow" and a in lengths:
                mgr.append_token(a, lengths[a])
                lengths[a] += 1
                contents[a] += [a * 1000 + 500]
            elif op == "append" and a in lengths:
                others = [(s, lengths[s], 1) for s in sorted(lengths) if s != a][:b]
                mgr.reserve([(a, lengths[a], n), *others])
                lengths[a] += n
                contents[a] += [a * 1000 + 700 + i for i in range(n)]
                for s, _, _ in others:
                    lengths[s] += 1
                    contents[s] += [s * 1000 + 900]
            elif op == "fork" and a in lengths and b not in lengths:
                mgr.fork(a, b)
                lengths[b], contents[b] = lengths[a], list(contents[a])
            elif op == "cow" and a in lengths and mgr.table(a):
                idx = n % len(mgr.table(a))
                src, dst = mgr.cow_append(a, idx)
                assert mgr.table(a)[idx] == dst
            elif op == "free" and a in lengths:
                mgr.free_seq(a)
                del lengths[a], contents[a]
            elif op == "register" and a in lengths:
                mgr.register(a, chain_hashes(contents[a], block_size, []))
            elif op == "hit" and a in lengths and b not in lengths:
                hashes = chain_hashes(contents[a], block_size, [])
                hit = mgr.lookup(hashes[:(lengths[a] - 1) // block_size])
                mgr.allocate(b, lengths[a], hit)
                lengths[b], contents[b] = lengths[a], list(contents[a])
            elif op == "abort":
                mgr.free_all()
                lengths.clear()
                contents.clear()
        except PoolExhausted:  # all or nothing
            assert (mgr._free, dict(mgr.tables()), list(mgr.ref_count)) == (before[0], before[1],
                                                                     before[2])
        check_pool_invariants(mgr)
        for sid, length in lengths.items():
            assert len(mgr.table(sid)) * block_size >= length
    for sid in list(lengths):
        mgr.free_seq(sid)
    assert mgr.num_free_blocks() == num_blocks


def test_free_all_repairs_a_half_done_registration():
    """An interrupt between the two writes of `register` (or of an eviction) leaves the cache
    and a block disagreeing; free_all rebuilds everything from the consistent part."""
    mgr = BlockManager(8, 2, enable_prefix_caching=True)
    mgr.allocate("a", 6)
    hashes = chain_hashes([1, 2, 3, 4, 5, 6], 2, [])
    mgr.register("a", hashes[:2])
    blk = mgr.table("a")[2]
    mgr._cached[hashes[2]] = blk  # ...interrupted before _block_hash[blk] was set
    mgr.free_all()
    check_pool_invariants(mgr)
    assert mgr.num_free_blocks() == 8 and mgr.lookup(hashes[2:3]) == []
    assert mgr.lookup(hashes) == mgr.lookup(hashes[:2]) and len(mgr.lookup(hashes)) == 2


def _twins(block_size: int, lengths: list[int], forks: list[tuple[int, int]],
           num_blocks: int = 64) -> tuple[list[BlockManager], dict[int, int]]:
    """Two managers with the same sequences: allocated (those that fit), then forked (child
    of a parent)."""
    mgrs = [BlockManager(num_blocks, block_size) for _ in range(2)]
    lens = dict(enumerate(lengths))
    for sid, n in list(lens.items()):
        if not mgrs[0].can_allocate(n):
            del lens[sid]
            continue
        for mgr in mgrs:
            mgr.allocate(sid, n)
    for parent, child in forks:
        if parent in lens and child not in lens:
            for mgr in mgrs:
                mgr.fork(parent, child)
            lens[child] = lens[parent]
    return mgrs, lens


def _state(mgr: BlockManager) -> tuple:
    return mgr._free, dict(mgr.tables()), list(mgr.ref_count), mgr.cow_copies


@settings(max_examples=200, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]),
       lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       forks=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=6),
       num_blocks=st.integers(4, 40))
def test_write_heads_equals_cow_append_and_append_row_by_row(block_size, lengths, forks,
                                                             num_blocks):
    """The decode rows' one-pass `write_heads` changes what `cow_append` (a position inside a
    block) and `append_tokens` (a position opening one), row by row, change, and reports the
    same copies and new blocks; in a pool that runs out, it stops at the row that finds no
    block (the rows before it made writable, that one and the rest untouched)."""
    (fast, slow), lens = _twins(block_size, lengths, forks, num_blocks)
    seqs = sorted(lens)
    done, at, blocks, copies = fast.write_heads(seqs, [lens[s] for s in seqs])
    want_done, want_at, want_blocks, want_copies = len(seqs), [], [], []
    for i, s in enumerate(seqs):
        pos = lens[s]
        try:
            if pos % block_size:
                src, dst = slow.cow_append(s, pos // block_size)
                if src != dst:
                    want_copies.append((src, dst))
                    want_at.append(i)
                    want_blocks.append(dst)
            elif new := slow.append_tokens([s], [pos]):
                want_at.append(i)
                want_blocks += new
        except PoolExhausted:
            want_done = i
            break
    assert (done, at, blocks, copies) == (want_done, want_at, want_blocks, want_copies)
    assert _state(fast) == _state(slow)
    check_pool_invariants(fast)


@settings(max_examples=200, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]),
       lengths=st.lists(st.integers(1, 9), min_size=2, max_size=5),
       forks=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=6),
       pairs=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=5))
def test_adopt_many_leaves_the_pool_as_free_then_fork_pair_by_pair(block_size, lengths,
                                                                   forks, pairs):
    """Each adoption leaves the tables, reference counts and free list (its order too) as
    `free_seq` then `fork` would, and reports the leading blocks the two shared already."""
    (fast, slow), lens = _twins(block_size, lengths, forks)
    pairs = [(s, p) for s, p in pairs if s in lens and p in lens and s != p]
    want = []
    for s, p in pairs:
        old, new = slow.table(s), slow.table(p)
        want.append(next((i for i, (a, b) in enumerate(zip(old, new)) if a != b),
                         min(len(old), len(new))))
        slow.free_seq(s)
        slow.fork(p, s)
    assert fast.adopt_many(pairs) == want
    assert _state(fast) == _state(slow)
    check_pool_invariants(fast)

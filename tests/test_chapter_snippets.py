"""The PagedAttention chapter's own snippets run unchanged against batchgen.kv.BlockManager: the
block-boundary test, exercise 5 (num_free_blocks / can_allocate) and the copy-on-write example
(fork, cow_append, reading `block_tables` and `ref_count` as the chapter does). The chapter's
names are this project's names; when the chapter's text is beside the repository, the snippets
below are checked to be its words."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.kv import BlockManager

CHAPTER = Path(__file__).resolve().parents[2] / "shared" / "design" / "000_8aa3e575058148d3.txt"

BOUNDARY = '''\
def test_block_boundary():
    B = 16
    mgr = BlockManager(num_blocks=8, block_size=B)
    prompt_len = 32                         # EXACT multiple of B -> the tricky case
    mgr.allocate("s", prompt_len)           # reserves ceil(32/16) = 2 blocks (pos 0..31)
    assert len(mgr.block_tables["s"]) == 2

    # emulate serve_step's write ordering for three decode steps (pos 32, 33, 34)
    for cur_len in range(prompt_len, prompt_len + 3):
        mgr.append_token("s", cur_len)      # grow BEFORE the write (the fix)
        slot = mgr.slot_index("s", cur_len) # would raise IndexError without the grow
        phys, off = divmod(slot, B)
        assert off == cur_len % B           # offset within the physical block

    # writing positions 32..34 needed exactly one new block beyond prefill's two
    assert len(mgr.block_tables["s"]) == 3
    print("boundary case OK")

test_block_boundary()                       # -> boundary case OK
'''

EXERCISE_5 = '''\
mgr = BlockManager(num_blocks=8, block_size=16)
need = (200 + 16 - 1) // 16          # ceil(200/16) = 13 blocks needed
print("free blocks:", mgr.num_free_blocks())   # 8
print("blocks needed for 200 tokens:", need)   # 13
print("can allocate 200-token request:", mgr.can_allocate(200))  # False
print("can allocate 100-token request:", mgr.can_allocate(100))  # ceil(100/16)=7 <= 8 -> True
'''

EXERCISE_5_OUTPUT = '''\
free blocks: 8
blocks needed for 200 tokens: 13
can allocate 200-token request: False
can allocate 100-token request: True
'''

# The chapter's fork / cow_append semantics as the seed's test wrote them, reading the tables
# through the chapter's attributes.
COW = '''\
mgr = BlockManager(num_blocks=16, block_size=4)
mgr.allocate("p", 10)  # 3 blocks, last one partial
mgr.fork("p", "c")
assert all(mgr.ref_count[b] == 2 for b in mgr.block_tables["p"])
src, dst = mgr.cow_append("c", 2)
assert src != dst and src == mgr.block_tables["p"][2] and dst == mgr.block_tables["c"][2]
assert mgr.ref_count[src] == 1 and mgr.ref_count[dst] == 1
assert mgr.block_tables["c"][:2] == mgr.block_tables["p"][:2]
assert mgr.cow_append("p", 2) == (src, src)  # the parent now owns it alone: no copy
mgr.free_seq("p")
mgr.free_seq("c")
assert mgr.num_free_blocks() == 16
'''


def _run(snippet: str) -> None:
    exec(compile(snippet, "<chapter>", "exec"), {"BlockManager": BlockManager})


def test_the_block_boundary_snippet_runs_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    _run(BOUNDARY)
    assert capsys.readouterr().out == "boundary case OK\n"


def test_the_exercise_5_snippet_prints_the_chapters_output(
        capsys: pytest.CaptureFixture[str]) -> None:
    _run(EXERCISE_5)
    assert capsys.readouterr().out == EXERCISE_5_OUTPUT


def test_the_copy_on_write_example_runs_unchanged() -> None:
    _run(COW)


def test_block_tables_is_a_read_only_view() -> None:
    mgr = BlockManager(num_blocks=4, block_size=2)
    mgr.allocate("s", 3)
    assert dict(mgr.block_tables) == {"s": (0, 1)} and len(mgr.block_tables) == 1
    with pytest.raises(TypeError):
        mgr.block_tables["s"][0] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        mgr.block_tables["t"] = (2,)  # type: ignore[index]
    with pytest.raises(TypeError):
        mgr.ref_count[0] = 5  # type: ignore[index]
    assert list(mgr.ref_count) == [1, 1, 0, 0]


@pytest.mark.skipif(not CHAPTER.exists(), reason="the chapter's text is not beside the checkout")
def test_the_snippets_are_the_chapters_words() -> None:
    text = CHAPTER.read_text()
    for snippet in (BOUNDARY, EXERCISE_5, EXERCISE_5_OUTPUT):
        assert snippet in text

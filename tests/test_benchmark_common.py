"""The benchmarks' interleaved timing: every system once per round, results kept per system."""

from benchmarks.common import Contender, interleaved_repeats


def test_interleaved_repeats_runs_rounds_in_order():
    order = []

    def make(name):
        counter = iter(range(100))
        return Contender(name, lambda: (order.append(name), f"{name}{next(counter)}")[1],
                         lambda: ("", {}))

    rounds = []
    out = interleaved_repeats([make("a"), make("b"), make("c")], 3, on_round=rounds.append)
    assert order == ["a", "b", "c"] * 3
    assert rounds == [0, 1, 2]
    assert [first for first, _ in out] == ["a0", "b0", "c0"]  # the first run's result
    assert all(len(walls) == 3 and min(walls) >= 0 for _, walls in out)

"""`batchgen.data.writers`: each output format writes a shard atomically and reads back the
same rows (floats exact, nested outputs kept); unknown formats are refused by name."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from batchgen.data import writers
from batchgen.data.writers import WRITERS, read_jsonl, write_jsonl, writer_for

ROWS = [{"prompt": "héllo", "row_id": 0, "outputs": [{"text": "a", "token_ids": [1, 2],
                                                       "cumulative_logprob": -1 / 3}]},
        {"prompt": "x", "row_id": 1, "outputs": []}]


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_round_trip(tmp_path: Path, fmt: str) -> None:
    writer = writer_for(fmt)
    table = pa.Table.from_pylist(ROWS)
    path = tmp_path / f"part-00000{writer.suffix}"
    writer.write(table, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left
    assert writer.read(path).to_pylist() == ROWS
    assert writer.read(path, columns=["row_id"]).column("row_id").to_pylist() == [0, 1]
    assert writer.schema(path) == table.schema
    assert writer.load([path], table.schema).to_list() == ROWS


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match=r"output_format must be one of \('parquet', 'jsonl'\), "
                                         r"got 'csv'"):
        writer_for("csv")


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "answers.jsonl"
    write_jsonl([{"a": 1}], path)

    def crash(_: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(writers, "_fsync_file", crash)  # the new file is written, not renamed
    with pytest.raises(KeyboardInterrupt):
        write_jsonl([{"a": 2}], path)
    assert list(read_jsonl(path)) == [{"a": 1}]


def test_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2')  # a kill while appending
    assert list(read_jsonl(path, skip_torn=True)) == [{"a": 1}]
    with pytest.raises(ValueError):
        list(read_jsonl(path))


def test_the_cli_offers_every_format() -> None:
    from batchgen.cli import build_parser

    for command in (["generate"], ["beam", "--beam-width", "2"]):
        for fmt in WRITERS:
            args = build_parser().parse_args([*command, "--model", "m", "--input", "x",
                                              "--output", "o", "--output-format", fmt])
            assert args.output_format == fmt

"""`batchgen.data.generate_dataset`: equal to `LLM.generate` / `chat` / `beam_search` on the same
rows with the row seeds; every input form; Parquet and JSONL shards that a resume continues (torn,
partial, interrupted, or another job's), keeping only rows whose input is unchanged; shards
closed by time; a row that cannot run fails the job naming it, or is written with its error
under on_error="skip"; bad input refused before any work."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.data import generate_dataset, row_seed
from batchgen.data.rows import row_params
from batchgen.data.shards import MANIFEST
from batchgen.data.writers import WRITERS

WORDS = "the a cat dog runs jumps over under blue red green house tree river".split()
PARAMS = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=8)
FORMATS = pytest.mark.parametrize("fmt", list(WRITERS))


def rows(count: int) -> list[dict]:
    return [{"prompt": " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(2 + i % 5)),
             "topic": f"t{i % 3}"} for i in range(count)]


def samples(out) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def table_samples(outputs: list[dict]) -> list[tuple]:
    return [(o["index"], o["token_ids"], o["text"], o["finish_reason"]) for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama", eos_boost=0.06)), device="cpu", max_num_seqs=8,
               block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def data() -> datasets.Dataset:
    return datasets.Dataset.from_list(rows(23))


@pytest.fixture(scope="module")
def reference(llm: LLM, data: datasets.Dataset) -> list:
    """LLM.generate on the same rows, each with its row seed (job seed 5)."""
    return llm.generate(data["prompt"], [row_params(PARAMS, 5, i) for i in range(len(data))],
                        use_tqdm=False)


def test_dataset_equals_generate_with_row_seeds(llm, data, reference) -> None:
    ds = generate_dataset(llm, data, PARAMS, seed=5, use_tqdm=False)
    assert ds.column_names == ["prompt", "topic", "row_id", "num_prompt_tokens", "outputs"]
    assert ds["row_id"] == list(range(len(data)))
    assert ds["prompt"] == data["prompt"] and ds["topic"] == data["topic"]
    for row, out in zip(ds, reference):
        assert table_samples(row["outputs"]) == samples(out)
        assert row["num_prompt_tokens"] == len(out.prompt_token_ids)
        assert [o["cumulative_logprob"] for o in row["outputs"]] == pytest.approx(
            [c.cumulative_logprob for c in out.outputs])
    assert len({tuple(o["token_ids"]) for o in ds[0]["outputs"]}) > 1  # n samples differ
    # params.seed, when set, is the job seed
    again = generate_dataset(llm, data.select(range(4)), dataclasses.replace(PARAMS, seed=5),
                             use_tqdm=False)
    assert [table_samples(o) for o in again["outputs"]] == [samples(o) for o in reference[:4]]


def test_row_seed_depends_on_job_and_row_only() -> None:
    assert row_seed(5, 3) == row_seed(5, 3)
    assert len({row_seed(5, i) for i in range(1000)} | {row_seed(6, 0)}) == 1001


@FORMATS
def test_shards_equal_in_memory_and_manifest(llm, data, reference, tmp_path, fmt) -> None:
    out = tmp_path / "out"
    ds = generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, rows_per_shard=5,
                          output_format=fmt, use_tqdm=False)
    assert [table_samples(o) for o in ds["outputs"]] == [samples(o) for o in reference]
    assert ds.features == generate_dataset(llm, data.select(range(2)), PARAMS, seed=5,
                                           use_tqdm=False).features  # the same types
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and manifest["rows"] == len(data)
    assert [s["rows"] for s in manifest["shards"]] == [5, 5, 5, 5, 3]
    files = sorted(p.name for p in out.iterdir())
    assert files == [MANIFEST] + [f"part-{i:05d}.{fmt}" for i in range(5)]
    # the folder reads as one table with plain pyarrow
    table = pads.dataset(out, format="parquet" if fmt == "parquet" else "json").to_table()
    assert sorted(table.column("row_id").to_pylist()) == list(range(len(data)))


@pytest.mark.parametrize("form", ["jsonl", "parquet", "csv", "json-folder", "save_to_disk",
                                  "iterable"])
def test_input_forms(llm, data, reference, tmp_path, form) -> None:
    sub = data.select(range(6))
    if form == "jsonl":
        src = tmp_path / "in.jsonl"
        sub.to_json(src)
    elif form == "parquet":
        src = tmp_path / "in.parquet"
        sub.to_parquet(src)
    elif form == "csv":
        src = tmp_path / "in.csv"
        sub.to_csv(src, index=False)
    elif form == "json-folder":
        src = tmp_path / "parts"
        src.mkdir()
        sub.select(range(3)).to_json(src / "a.jsonl")
        sub.select(range(3, 6)).to_json(src / "b.jsonl")
    elif form == "save_to_disk":
        src = tmp_path / "saved"
        sub.save_to_disk(str(src))
    else:
        src = sub.to_iterable_dataset()
    ds = generate_dataset(llm, str(src) if isinstance(src, Path) else src, PARAMS, seed=5,
                          use_tqdm=False)
    assert ds["prompt"] == sub["prompt"] and ds["row_id"] == list(range(6))
    assert [table_samples(o) for o in ds["outputs"]] == [samples(o) for o in reference[:6]]


def test_messages_column_equals_chat(llm, tmp_path) -> None:
    convs = [[{"role": "user", "content": r["prompt"]}] for r in rows(5)]
    convs[2] = [{"role": "system", "content": "be brief"}, *convs[2]]
    data = datasets.Dataset.from_dict({"messages": convs})
    ds = generate_dataset(llm, data, PARAMS, messages_column="messages", seed=1,
                          use_tqdm=False)
    expected = llm.chat(convs, [row_params(PARAMS, 1, i) for i in range(5)], use_tqdm=False)
    assert [table_samples(o) for o in ds["outputs"]] == [samples(o) for o in expected]


def test_beam_dataset_equals_beam_search(llm, data) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    sub = data.select(range(5))
    ds = generate_dataset(llm, sub, params, use_tqdm=False)
    expected = llm.beam_search(sub["prompt"], params, use_tqdm=False)
    for row, out in zip(ds, expected):
        assert [(o["token_ids"], o["text"]) for o in row["outputs"]] == [
            (s.token_ids, s.text) for s in out.sequences]
        assert [o["score"] for o in row["outputs"]] == pytest.approx(
            [s.score for s in out.sequences])


def test_logprobs_and_token_id_prompts(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    data = datasets.Dataset.from_dict({"ids": [[1, 5, 9, 13], [1, 7]]})
    ds = generate_dataset(llm, data, params, prompt_column="ids", use_tqdm=False)
    expected = llm.generate([{"prompt_token_ids": p} for p in data["ids"]], params,
                            use_tqdm=False)
    for row, out in zip(ds, expected):
        got, want = row["outputs"][0]["logprobs"], out.outputs[0].logprobs
        assert len(got) == len(want) == 4
        for pos, entry in zip(got, want):
            assert {e["token_id"]: e["rank"] for e in pos} == {
                t: v.rank for t, v in entry.items()}
            assert [e["logprob"] for e in pos] == pytest.approx(
                [v.logprob for v in entry.values()], abs=1e-6)


# ---- resume ---------------------------------------------------------------------------------
class Counting:
    """Wraps llm.generate_stream to count the prompts it pulls (the rows computed)."""

    def __init__(self, llm: LLM, monkeypatch, interrupt_after: int | None = None) -> None:
        self.pulled, self.stream, self.interrupt_after = 0, llm.generate_stream, interrupt_after
        monkeypatch.setattr(llm, "generate_stream", self)

    def __call__(self, prompts, params, use_tqdm=True):
        def counted():
            for p in prompts:
                self.pulled += 1
                yield p
        with contextlib.closing(self.stream(counted(), params, use_tqdm)) as inner:
            for k, item in enumerate(inner):
                if k == self.interrupt_after:
                    raise KeyboardInterrupt
                yield item


@FORMATS
def test_truncated_last_shard_is_redone(llm, data, reference, tmp_path, monkeypatch, fmt
                                        ) -> None:
    out = tmp_path / "out"
    generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, rows_per_shard=5,
                     output_format=fmt, use_tqdm=False)
    last = out / f"part-00004.{fmt}"
    last.write_bytes(last.read_bytes()[:-40])  # torn by a crash
    (out / f".part-00009.{fmt}.tmp").write_bytes(b"half a shard")
    counting = Counting(llm, monkeypatch)
    ds = generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, rows_per_shard=5,
                          output_format=fmt, resume=True, use_tqdm=False)
    assert counting.pulled == 3  # only the torn shard's rows
    assert ds["row_id"] == list(range(len(data)))
    assert [table_samples(o) for o in ds["outputs"]] == [samples(o) for o in reference]
    assert not (out / f".part-00009.{fmt}.tmp").exists()
    assert json.loads((out / MANIFEST).read_text())["complete"]


@FORMATS
def test_interrupt_keeps_finished_rows_and_resume_completes(llm, data, reference, tmp_path,
                                                            monkeypatch, fmt) -> None:
    out = tmp_path / "out"
    Counting(llm, monkeypatch, interrupt_after=9)
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, rows_per_shard=4,
                         output_format=fmt, use_tqdm=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert not manifest["complete"] and manifest["rows"] == 9  # 2 full shards + the rest
    assert llm.engine.kv.block_manager.num_blocks_in_use() == 0
    monkeypatch.undo()
    counting = Counting(llm, monkeypatch)
    ds = generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, rows_per_shard=4,
                          output_format=fmt, resume=True, use_tqdm=False)
    assert counting.pulled == len(data) - 9
    assert ds["row_id"] == list(range(len(data)))  # none lost, none twice
    assert [table_samples(o) for o in ds["outputs"]] == [samples(o) for o in reference]
    # a finished job resumes to itself without computing anything
    counting.pulled = 0
    again = generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, resume=True,
                             output_format=fmt, use_tqdm=False)
    assert counting.pulled == 0 and again["outputs"] == ds["outputs"]


@FORMATS
@pytest.mark.parametrize("target, call", [
    ("shards.ShardStore._write_manifest", 2),  # shard 2 renamed, listed in memory, manifest not
    ("writers._fsync_dir", 3),  # shard 2 renamed into place, not listed anywhere
])
def test_ctrl_c_inside_a_shard_write_loses_and_duplicates_nothing(
        llm, data, reference, tmp_path, monkeypatch, target, call, fmt) -> None:
    from batchgen.data import shards, writers

    module, _, rest = target.partition(".")
    owner, _, name = rest.rpartition(".")
    holder = {"shards": shards, "writers": writers}[module]
    holder = getattr(holder, owner) if owner else holder
    real, calls = getattr(holder, name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(holder, name, interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, rows_per_shard=5,
                         output_format=fmt, use_tqdm=False)
    monkeypatch.undo()
    ds = generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, rows_per_shard=5,
                          output_format=fmt, resume=True, use_tqdm=False)
    assert ds["row_id"] == list(range(len(data)))
    assert [table_samples(o) for o in ds["outputs"]] == [samples(o) for o in reference]
    written = WRITERS[fmt].read  # every shard file on disk: each row once
    ids = [i for p in sorted(out.glob(f"part-*.{fmt}")) for i in written(p)["row_id"].to_pylist()]
    assert sorted(ids) == list(range(len(data)))


def test_output_dir_of_another_job_or_without_resume(llm, data, tmp_path) -> None:
    out = tmp_path / "out"
    sub = data.select(range(3))
    generate_dataset(llm, sub, PARAMS, seed=5, output_dir=out, use_tqdm=False)
    with pytest.raises(ValueError, match="already holds shards of a job: pass resume=True"):
        generate_dataset(llm, sub, PARAMS, seed=5, output_dir=out, use_tqdm=False)
    with pytest.raises(ValueError, match=r"holds a different job \(params, seed differ\)"):
        generate_dataset(llm, sub, SamplingParams(n=2, max_tokens=8), seed=6, output_dir=out,
                         resume=True, use_tqdm=False)
    with pytest.raises(ValueError, match=r"holds a different job \(output_format differ\)"):
        generate_dataset(llm, sub, PARAMS, seed=5, output_dir=out, resume=True,
                         output_format="jsonl", use_tqdm=False)


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_column": "text"}, "prompt_column 'text' is not a column of data"),
    ({"messages_column": "msgs"}, "messages_column 'msgs' is not a column of data"),
    ({"rows_per_shard": 0}, "rows_per_shard must be an integer >= 1"),
    ({"resume": True}, "resume=True needs output_dir"),
    ({"params": "greedy"}, "params must be a SamplingParams or a BeamSearchParams"),
    ({"rows_per_shard": True}, "rows_per_shard must be an integer >= 1, got True"),
    ({"resume": "yes"}, "resume must be True or False, got 'yes'"),
    ({"prompt_column": 3}, "prompt_column must be a column name"),
    ({"messages_column": ""}, "messages_column must be None or a column name"),
    ({"seed": 1.5}, r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\), got 1.5"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs must be None or a dict"),
    ({"output_format": "csv"},
     r"output_format must be one of \('parquet', 'jsonl'\), got 'csv'"),
    ({"on_error": "ignore"}, r"on_error must be one of \('fail', 'skip'\), got 'ignore'"),
    ({"shard_seconds": 0}, "shard_seconds must be None or a number of seconds > 0, got 0"),
])
def test_bad_arguments(llm, data, kwargs, message) -> None:
    kwargs = {"params": PARAMS, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate_dataset(llm, data, use_tqdm=False, **kwargs)


def test_bad_data(llm, data, tmp_path) -> None:
    with pytest.raises(ValueError, match="data has no rows"):
        generate_dataset(llm, data.select([]), PARAMS)
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train'\]"):
        generate_dataset(llm, datasets.DatasetDict({"train": data}), PARAMS)
    with pytest.raises(ValueError, match="does not exist"):
        generate_dataset(llm, tmp_path / "missing.jsonl", PARAMS)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"must be a \.jsonl/\.json/\.parquet/\.csv file"):
        generate_dataset(llm, tmp_path / "notes.txt", PARAMS)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"} trailing\n')
    with pytest.raises(ValueError, match=r"cannot be read: line 3 of .*bad.jsonl is not JSON "
                                         r"\(Extra data at column 17\)"):
        generate_dataset(llm, tmp_path / "bad.jsonl", PARAMS)
    with pytest.raises(ValueError, match=r"already has column\(s\) \['outputs'\]"):
        generate_dataset(llm, data.add_column("outputs", [0] * len(data)), PARAMS)
    with pytest.raises(ValueError, match="must hold a string or a list of token ids"):
        generate_dataset(llm, datasets.Dataset.from_dict({"prompt": [3.5]}), PARAMS,
                         use_tqdm=False)
    assert llm.engine.kv.block_manager.num_blocks_in_use() == 0


def test_messages_without_chat_template(tiny_model_factory) -> None:
    path = tiny_model_factory("llama", seed=3)
    llm = LLM(str(path), device="cpu", num_kv_blocks=32)
    llm.tokenizer.chat_template = None
    data = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"}]]})
    with pytest.raises(ValueError, match="chat_template"):
        generate_dataset(llm, data, PARAMS, messages_column="messages", use_tqdm=False)


# ---- a row that cannot run; resume after the input changed; shards closed by time ------------
TOO_LONG = "river " * 1500  # over the test LLM's max_model_len (1024)


def write_rows(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def test_a_row_that_cannot_run_fails_the_job_naming_its_row_and_line(llm, tmp_path) -> None:
    items = rows(8)
    items[5]["prompt"] = TOO_LONG
    src = write_rows(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"^row 5 \(line 6 of {src}\): prompt has \d+ tokens; "
                                         r"max_model_len is 1024"):
        generate_dataset(llm, src, PARAMS, seed=5, output_dir=out, rows_per_shard=2,
                         use_tqdm=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert not manifest["complete"] and manifest["rows"] == 5  # the rows before it are kept


@FORMATS
def test_skip_writes_the_bad_row_with_its_error_and_a_fixed_row_is_all_a_resume_redoes(
        llm, reference, tmp_path, monkeypatch, fmt) -> None:
    items = rows(23)
    items[7]["prompt"] = TOO_LONG
    src = write_rows(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"
    ds = generate_dataset(llm, src, PARAMS, seed=5, output_dir=out, rows_per_shard=5,
                          output_format=fmt, on_error="skip", use_tqdm=False)
    assert ds["row_id"] == list(range(23)) and ds.column_names[-1] == "error"
    bad = ds[7]
    assert bad["outputs"] == [] and bad["num_prompt_tokens"] is None
    assert bad["error"].startswith(f"row 7 (line 8 of {src}): prompt has ")
    good = [i for i in range(23) if i != 7]
    assert [ds[i]["error"] for i in good] == [None] * 22
    assert [table_samples(ds[i]["outputs"]) for i in good] == [samples(reference[i])
                                                               for i in good]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and sum((s["errors"] for s in manifest["shards"]), []) == [7]
    before = {p.name: p.read_bytes() for p in out.glob("part-*")}

    items[7]["prompt"] = rows(23)[7]["prompt"]  # the row fixed: the file changed
    write_rows(src, items)
    counting = Counting(llm, monkeypatch)
    fixed = generate_dataset(llm, src, PARAMS, seed=5, output_dir=out, rows_per_shard=5,
                             output_format=fmt, on_error="skip", resume=True, use_tqdm=False)
    assert counting.pulled == 1  # only the fixed row
    assert fixed["row_id"] == list(range(23)) and fixed["error"] == [None] * 23
    assert [table_samples(o) for o in fixed["outputs"]] == [samples(o) for o in reference]
    after = {p.name: p.read_bytes() for p in out.glob("part-*")}
    assert sorted(after) == sorted(before)  # row 7's shard, written again under its name
    assert [n for n in sorted(after) if after[n] != before[n]] == [f"part-00001.{fmt}"]
    fresh = tmp_path / "fresh"  # the same bytes as a job on the fixed input from scratch
    generate_dataset(llm, src, PARAMS, seed=5, output_dir=fresh, rows_per_shard=5,
                     output_format=fmt, on_error="skip", use_tqdm=False)
    assert {p.name: p.read_bytes() for p in fresh.iterdir()} == {
        p.name: p.read_bytes() for p in out.iterdir()}


def test_resume_after_editing_and_adding_rows_redoes_only_those(llm, tmp_path,
                                                                monkeypatch) -> None:
    items = rows(12)
    src = write_rows(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"
    generate_dataset(llm, src, PARAMS, seed=5, output_dir=out, rows_per_shard=4, use_tqdm=False)
    items[2]["topic"] = "edited"  # another column: the row's copy of it must follow
    items[9]["prompt"] = "a new question"
    items += rows(14)[12:]
    write_rows(src, items)
    counting = Counting(llm, monkeypatch)
    ds = generate_dataset(llm, src, PARAMS, seed=5, output_dir=out, rows_per_shard=4,
                          resume=True, use_tqdm=False)
    assert counting.pulled == 4  # rows 2 and 9, and the two new rows 12 and 13
    assert ds["row_id"] == list(range(14)) and ds["topic"][2] == "edited"
    expected = llm.generate([r["prompt"] for r in items],
                            [row_params(PARAMS, 5, i) for i in range(14)], use_tqdm=False)
    assert [table_samples(o) for o in ds["outputs"]] == [samples(o) for o in expected]
    counting.pulled = 0
    shorter = write_rows(tmp_path / "in.jsonl", items[:10])  # rows dropped from the input
    ds = generate_dataset(llm, shorter, PARAMS, seed=5, output_dir=out, rows_per_shard=4,
                          resume=True, use_tqdm=False)
    assert counting.pulled == 0 and ds["row_id"] == list(range(10))


@FORMATS
def test_shards_close_by_time_too(llm, data, reference, tmp_path, monkeypatch, fmt) -> None:
    from batchgen.data.shards import ShardStore

    written, put = [], ShardStore.put

    def counted(store, k, rows, *a, **kw):
        written.append((k, len(rows)))
        return put(store, k, rows, *a, **kw)
    monkeypatch.setattr(ShardStore, "put", counted)
    out = tmp_path / "out"
    ds = generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, rows_per_shard=1000,
                          shard_seconds=1e-9, output_format=fmt,
                          use_tqdm=False)
    assert len(written) > 1 and {k for k, _ in written} == {0}  # shard 0 written early...
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["rows"] == len(data)
    assert [table_samples(o) for o in ds["outputs"]] == [samples(o) for o in reference]
    one = generate_dataset(llm, data, PARAMS, seed=5, output_dir=tmp_path / "one",
                           rows_per_shard=1000, shard_seconds=None, output_format=fmt,
                           use_tqdm=False)
    assert len(json.loads((tmp_path / "one" / MANIFEST).read_text())["shards"]) == 1
    assert one["outputs"] == ds["outputs"]  # ...and at the end the bytes of one write
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "one").iterdir()}


@FORMATS
def test_a_job_sharded_in_finishing_order_resumes_into_the_row_id_layout(
        llm, data, reference, tmp_path, monkeypatch, fmt) -> None:
    """Shards written before the row-id layout (rows of any ids, no rows_per_shard in the
    manifest) are regrouped on resume; only the missing rows run, and the shard files end as
    a fresh job's."""
    from batchgen.data.shards import FORMAT, _sha256

    fresh, out = tmp_path / "fresh", tmp_path / "old"
    generate_dataset(llm, data, PARAMS, seed=5, output_dir=fresh, rows_per_shard=5,
                     output_format=fmt, use_tqdm=False)
    writer = WRITERS[fmt]
    done = [r for p in sorted(fresh.glob("part-*")) for r in writer.rows(p)]
    order = (done[::2] + done[1::2])[:16]  # as they finished; the other 7 never did
    out.mkdir()
    listed = []
    for i, part in enumerate((order[:8], order[8:])):
        path = out / f"part-{i:05d}{writer.suffix}"
        writer.write(pa.Table.from_pylist(part, schema=writer.schema(fresh / path.name)), path)
        listed.append({"file": path.name, "rows": 8, "bytes": path.stat().st_size,
                       "sha256": _sha256(path), "inputs": None, "errors": []})
    job = json.loads((fresh / MANIFEST).read_text())["job"]
    (out / MANIFEST).write_text(json.dumps({"format": FORMAT, "job": job, "complete": False,
                                            "rows": 16, "shards": listed}))
    counting = Counting(llm, monkeypatch)
    ds = generate_dataset(llm, data, PARAMS, seed=5, output_dir=out, rows_per_shard=5,
                          output_format=fmt, resume=True, use_tqdm=False)
    assert counting.pulled == 7 and ds["row_id"] == list(range(len(data)))
    assert [table_samples(o) for o in ds["outputs"]] == [samples(o) for o in reference]
    assert {p.name: p.read_bytes() for p in out.glob("part-*")} == {
        p.name: p.read_bytes() for p in fresh.glob("part-*")}

"""Structured outputs (xgrammar): every finished output keeps to its JSON schema, regex, choice
or grammar, for n samples and beams, under min_tokens, preemption and prefix caching; bad
constraints fail before any work; unconstrained rows are untouched."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from batchgen.config import EngineConfig
from batchgen.sampling.grammar import Grammars
from batchgen.tools.make_tiny_model import build_tokenizer, save_tokenizer

try:
    import jsonschema
except ImportError:  # in the [test] extra, not in [test-core]: the tests using it skip
    jsonschema = None

S = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
REGEX = r"\d{3}-[a-c]+"
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = ["hello", "the sky is", "Why is the sky blue?", "count: 1 2 3"]


def needs_xgrammar() -> None:
    """Skip a test that compiles grammars where xgrammar (and jsonschema, the oracle of the
    outputs) are not installed ([test-core] only)."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    needs_xgrammar()
    return tiny_model_factory("llama", eos_boost=0.06)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_kv_blocks=512, max_num_seqs=64)


def _sample(llm, so, n=4, max_tokens=48, prompts=PROMPTS, **kw):
    kw = {"temperature": 0.8, "seed": 3, **kw}
    sp = SamplingParams(n=n, max_tokens=max_tokens, structured_outputs=so, **kw)
    return [c for o in llm.generate(prompts, sp, use_tqdm=False) for c in o.outputs]


def _finished(outs):
    done = [c for c in outs if c.finish_reason == "stop"]
    assert len(done) >= len(outs) // 2, [c.finish_reason for c in outs]
    return done


# ---- parameters -------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, name", [
    ({}, "structured_outputs"), ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": 3}, "structured_outputs.json"), ({"choice": []}, "structured_outputs"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs"), ({"grammar": 5}, "structured_outputs.grammar"),
    ({"regex": "a", "whitespace_pattern": " ?"}, "structured_outputs.whitespace_pattern"),
    ({"regex": "a", "max_whitespace": -1}, "structured_outputs.max_whitespace"),
    ({"regex": "a", "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace"),
])
def test_bad_params_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        S(**kw)


def test_params_take_it_and_refuse_other_types():
    assert SamplingParams(structured_outputs=S(regex="a")).structured_outputs.kind == "regex"
    assert BeamSearchParams(beam_width=2, max_tokens=4,
                            structured_outputs=S(json_object=True)).structured_outputs
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs="a")
    assert S(json=SCHEMA).key == S(json=json.dumps(SCHEMA)).key[:1] + S(json=SCHEMA).key[1:]


@pytest.mark.parametrize("so, field", [
    (S(regex="[a-"), "structured_outputs.regex"),
    (S(grammar="root ::= "), "structured_outputs.grammar"),
    (S(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
     "structured_outputs.json"),
])
def test_invalid_constraints_fail_before_any_work(llm, so, field):
    good = SamplingParams(max_tokens=4, structured_outputs=S(regex="a+"))
    bad = SamplingParams(max_tokens=4, structured_outputs=so)
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert not llm.engine.scheduler.has_unfinished() and llm.kv_stats().prompt_tokens_computed == 0


def test_missing_xgrammar_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ValueError, match=re.escape("pip install 'batchgen[structured]'")):
        Grammars(build_tokenizer(512), 512, [2]).compile(S(regex="a"))


def test_compiled_grammars_are_cached_per_constraint(llm):
    g = llm.requests.grammars
    assert g.compile(S(regex="x+")) is g.compile(S(regex="x+"))
    assert g.compile(S(json=SCHEMA)) is g.compile(S(json=json.dumps(SCHEMA, sort_keys=True)))
    assert g.compile(S(json=SCHEMA)) is not g.compile(S(json=SCHEMA, max_whitespace=2))


# ---- samples ----------------------------------------------------------------------------------
def test_json_schema_holds_for_every_finished_sample(llm):
    outs = _sample(llm, S(json=SCHEMA, max_whitespace=2), max_tokens=64)
    for c in _finished(outs):
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.token_ids[-1] == 2  # the grammar ended on EOS, whose text is dropped


def test_regex_choice_grammar_and_json_object_hold(llm):
    for c in _finished(_sample(llm, S(regex=REGEX))):
        assert re.fullmatch(REGEX, c.text), c.text
    outs = _sample(llm, S(choice=CHOICES), temperature=1.5)
    assert all(c.finish_reason == "stop" and c.text in CHOICES for c in outs)
    assert len({c.text for c in outs}) > 1  # samples differ: n samples fork, not share
    grammar = 'root ::= "(" [0-9]+ ")" | "none"'
    for c in _finished(_sample(llm, S(grammar=grammar))):
        assert re.fullmatch(r"\([0-9]+\)|none", c.text), c.text
    for c in _finished(_sample(llm, S(json_object=True, max_whitespace=2), max_tokens=64)):
        assert isinstance(json.loads(c.text), dict)


def test_whitespace_is_bounded(llm):
    so = S(json=SCHEMA, max_whitespace=1)
    for c in _sample(llm, so, max_tokens=64):
        assert not re.search(r"\s\s", c.text), c.text
    for c in _finished(_sample(llm, S(json=SCHEMA, disable_any_whitespace=True), max_tokens=64)):
        assert json.loads(c.text) and '"name": ' in c.text and "  " not in c.text


def test_the_engines_whitespace_switch_applies_to_every_request(llm, model_dir):
    """structured_outputs_config={"disable_any_whitespace": True} is vLLM's engine-wide
    switch: every JSON constraint runs as if its request had asked for it."""
    strict = LLM(model_dir, num_kv_blocks=512, max_num_seqs=64,
                 structured_outputs_config={"backend": "xgrammar",
                                            "disable_any_whitespace": True})
    g = strict.requests.grammars
    assert g.compile(S(json=SCHEMA)) is g.compile(S(json=SCHEMA, disable_any_whitespace=True))
    got = _sample(strict, S(json=SCHEMA), max_tokens=64)
    assert got == _sample(llm, S(json=SCHEMA, disable_any_whitespace=True), max_tokens=64)
    assert got != _sample(llm, S(json=SCHEMA), max_tokens=64)
    for bad in ({"disable_any_whitespace": "yes"}, {"disable_additional_properties": True}):
        with pytest.raises(ValueError, match=f"structured_outputs_config.{[*bad][0]}"):
            EngineConfig(structured_outputs_config=bad)


def test_the_grammars_eos_beats_min_tokens_and_ignore_eos(llm):
    """min_tokens bans EOS, but a complete grammar that allows nothing else still ends."""
    outs = _sample(llm, S(choice=["yes", "no"]), min_tokens=10)
    assert all(c.finish_reason == "stop" and c.text in ("yes", "no") for c in outs)
    outs = _sample(llm, S(choice=["yes", "no"]), ignore_eos=True, max_tokens=20)
    assert all(c.finish_reason == "stop" and c.text in ("yes", "no") for c in outs)
    # where the grammar may go on, min_tokens holds it open: 8 digits at least
    outs = _sample(llm, S(regex=r"[0-9]+"), min_tokens=8, max_tokens=30)
    assert all(len(c.token_ids) > 8 for c in _finished(outs))


def test_constrained_rows_leave_their_neighbours_untouched(llm):
    """The CPU kernel is batch invariant: an unconstrained request's tokens and logprobs are
    the same bits alone or beside constrained ones."""
    free = SamplingParams(n=2, temperature=0.9, max_tokens=16, seed=5, logprobs=2)
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    tied = SamplingParams(n=3, temperature=0.9, max_tokens=16, seed=6,
                          structured_outputs=S(regex=REGEX))
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], [free, tied, free],
                         use_tqdm=False)
    for a, m in zip(alone, [mixed[0], mixed[2]]):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in m.outputs]
        assert [c.logprobs for c in a.outputs] == [c.logprobs for c in m.outputs]


def test_padding_ids_past_the_tokenizer_are_never_allowed(tmp_path, tiny_model_factory):
    """A model whose lm_head has 64 more rows than its tokenizer has ids."""
    needs_xgrammar()
    model = tiny_model_factory("llama", vocab_size=576, eos_boost=0.06)
    folder = tmp_path / "padded"
    folder.mkdir()
    for f in model.iterdir():
        if not f.name.startswith("tokenizer"):
            (folder / f.name).symlink_to(f)
    save_tokenizer(512, folder)
    padded = LLM(folder, num_kv_blocks=256)
    outs = _sample(padded, S(regex=r"[a-z ]{4,30}\."), max_tokens=40, temperature=1.5)
    assert all(t < 512 for c in outs for t in c.token_ids)
    for c in _finished(outs):
        assert re.fullmatch(r"[a-z ]{4,30}\.", c.text)
    free = _sample(padded, None, max_tokens=40, temperature=1.5, ignore_eos=True)
    assert any(t >= 512 for c in free for t in c.token_ids)  # they would be drawn otherwise


def test_preemption_and_prefix_caching_keep_matchers_right(model_dir):
    """A recomputed sequence keeps its matcher (its tokens are not accepted again): a tiny
    pool that preempts gives the roomy pool's outputs, with and without prefix caching."""
    prompts = [p + " and more words to fill a block or two" for p in PROMPTS]
    sp = SamplingParams(n=3, temperature=0.8, max_tokens=40, seed=9,
                        structured_outputs=S(json=SCHEMA, max_whitespace=3))
    roomy = LLM(model_dir, block_size=4, num_kv_blocks=1024)
    expect = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, sp,
                                                                       use_tqdm=False)]
    again = roomy.generate(prompts, sp, use_tqdm=False)  # now from the prefix cache
    assert roomy.kv_stats().prefix_hit_tokens > 0
    assert [[c.token_ids for c in o.outputs] for o in again] == expect
    for caching in (True, False):
        tight = LLM(model_dir, block_size=4, num_kv_blocks=48, max_num_batched_tokens=16,
                    enable_prefix_caching=caching)
        got = tight.generate(prompts, sp, use_tqdm=False)
        assert tight.kv_stats().preemptions > 0
        assert [[c.token_ids for c in o.outputs] for o in got] == expect
        assert tight.engine.kv.block_manager.num_free_blocks() == 48


def test_sampler_masks_only_the_constrained_rows(llm):
    g = llm.requests.grammars
    cons = [g.constraint(S(choice=["yes"]))]
    from batchgen.sampling.grammar import GrammarRows

    logits = torch.randn(3, llm.vocab_size)
    before = logits.clone()
    rows = GrammarRows(np.array([1]), cons)
    saved = rows.apply(logits)
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    allowed = torch.isfinite(logits[1]).nonzero()[:, 0].tolist()
    assert allowed and all(llm.tokenizer.decode([t]).startswith("y") for t in allowed)
    assert rows.must_end.tolist() == [False]
    rows.restore(logits, saved)
    assert torch.equal(logits, before)


# ---- beams ------------------------------------------------------------------------------------
def test_every_returned_beam_keeps_to_the_constraint(llm):
    bp = BeamSearchParams(beam_width=4, max_tokens=24, structured_outputs=S(regex=r"[a-z]{2,5}!"))
    outs = llm.beam_search(PROMPTS, bp, use_tqdm=False)
    for o in outs:
        assert len(o.sequences) == 4
        for s in o.sequences:
            assert s.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,5}!", s.text), s.text
    ignoring = BeamSearchParams(beam_width=4, max_tokens=24, ignore_eos=True,
                                structured_outputs=S(regex=r"[a-z]{2,5}!"))
    for o in llm.beam_search(PROMPTS[:2], ignoring, use_tqdm=False):  # the grammar's EOS ends
        assert [s.text for s in o.sequences] == [s.text for s in outs[PROMPTS.index(
            o.prompt)].sequences]
    bp = BeamSearchParams(beam_width=4, max_tokens=64,
                          structured_outputs=S(json=SCHEMA, max_whitespace=2))
    for o in llm.beam_search(PROMPTS[:2], bp, use_tqdm=False):
        for s in o.sequences:
            if s.finish_reason == "stop":
                jsonschema.validate(json.loads(s.text), SCHEMA)


def test_beams_return_only_valid_hypotheses_when_fewer_exist(llm):
    """Two short strings allowed (in a few tokenisations each), six beams: HF would fill its
    buffer with impossible hypotheses; only the valid ones come back."""
    bp = BeamSearchParams(beam_width=6, max_tokens=8, structured_outputs=S(choice=["yes", "no"]))
    for o in llm.beam_search(PROMPTS[:2], bp, use_tqdm=False):
        assert {s.text for s in o.sequences} == {"yes", "no"}
        assert all(s.finish_reason == "stop" and s.score > -1e3 for s in o.sequences)
        assert len({tuple(s.token_ids) for s in o.sequences}) == len(o.sequences)


# ---- dataset jobs -----------------------------------------------------------------------------
def test_dataset_job_flags_valid_json_and_resumes(llm, tmp_path):
    import datasets

    from batchgen.data import generate_dataset

    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
    sp = SamplingParams(n=3, temperature=0.8, max_tokens=33,
                        structured_outputs=S(json=SCHEMA, max_whitespace=2))
    ds = generate_dataset(llm, data, sp, output_dir=tmp_path / "out", use_tqdm=False)
    outs = [o for row in ds["outputs"] for o in row]
    assert {o["valid"] for o in outs} == {True, False}  # some are cut by max_tokens
    for o in outs:
        assert o["valid"] == (o["finish_reason"] == "stop")
        if o["valid"]:
            jsonschema.validate(json.loads(o["text"]), SCHEMA)
    again = generate_dataset(llm, data, sp, output_dir=tmp_path / "out", resume=True,
                             use_tqdm=False)
    assert again["outputs"] == ds["outputs"]
    plain = generate_dataset(llm, data, SamplingParams(max_tokens=2), use_tqdm=False)
    assert "valid" not in plain["outputs"][0][0]


def test_dataset_schema_column_gives_each_row_its_own_schema(llm):
    import datasets

    from batchgen.data import generate_dataset

    schemas = [{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
               json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 3})]
    data = datasets.Dataset.from_list([{"prompt": p, "schema": json.dumps(schemas[i % 2])
                                        if i % 2 == 0 else schemas[1]}
                                       for i, p in enumerate(PROMPTS)])
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=40)
    ds = generate_dataset(llm, data, sp, schema_column="schema", use_tqdm=False)
    for i, row in enumerate(ds["outputs"]):
        for o in row:
            if o["valid"]:
                value = json.loads(o["text"])
                assert isinstance(value, dict if i % 2 == 0 else list), o["text"]
    bad = datasets.Dataset.from_list([{"prompt": "a", "schema": "{nope"}])
    with pytest.raises(ValueError, match="row 0: schema_column 'schema'"):
        generate_dataset(llm, bad, sp, schema_column="schema", use_tqdm=False)
    with pytest.raises(ValueError, match="schema_column 'nope' is not a column"):
        generate_dataset(llm, data, sp, schema_column="nope", use_tqdm=False)
    with pytest.raises(ValueError, match="not both"):
        generate_dataset(llm, data, SamplingParams(structured_outputs=S(regex="a")),
                         schema_column="schema", use_tqdm=False)


# ---- the CLI ----------------------------------------------------------------------------------
@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    schema = json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 2})
    path.write_text("".join(json.dumps({"q": p, "schema": schema}) + "\n" for p in PROMPTS))
    return path


@pytest.mark.parametrize("extra, message", [
    (["--regex", "[a-"], "structured_outputs.regex must be a valid regex"),
    (["--json-schema", "SCHEMA_FILE"], "structured_outputs.json must be a JSON schema"),
    (["--choice", ","], "structured_outputs.choice"),
    (["--schema-column", "nope"], "--schema-column 'nope' is not a column of"),
    (["--regex", "a", "--max-whitespace", "-2"], "--max-whitespace must be"),
])
def test_cli_refuses_bad_constraints_before_loading(jsonl, tmp_path, extra, message, capsys):
    from batchgen.cli import main

    needs_xgrammar()
    (tmp_path / "bad.json").write_text("{oops")
    extra = [str(tmp_path / "bad.json") if e == "SCHEMA_FILE" else e for e in extra]
    code = main(["generate", "--model", str(tmp_path / "no-model"), "--input", str(jsonl),
                 "--output", str(tmp_path / "out"), "--prompt-column", "q", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_cli_generate_and_beam_under_constraints(model_dir, jsonl, tmp_path, capsys):
    import pyarrow.parquet as pq

    from batchgen.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    base = ["--model", str(model_dir), "--input", str(jsonl), "--prompt-column", "q",
            "--max-tokens", "40", "--quiet"]
    runs = {"json": ["generate", "--n", "2", "--json-schema", str(schema),
                     "--max-whitespace", "2"],
            "column": ["generate", "--n", "2", "--schema-column", "schema"],
            "regex": ["beam", "--beam-width", "2", "--regex", REGEX],
            "choice": ["generate", "--n", "2", "--choice", ",".join(CHOICES)]}
    for name, argv in runs.items():
        assert main([*argv, *base, "--output", str(tmp_path / name)]) == 0, name
        outs = [o for row in pq.read_table(tmp_path / name).to_pylist() for o in row["outputs"]]
        assert outs and any(o["valid"] for o in outs), name
        for o in outs:
            if not o["valid"]:
                continue
            if name == "json":
                jsonschema.validate(json.loads(o["text"]), SCHEMA)
            elif name == "column":
                assert all(isinstance(v, int) for v in json.loads(o["text"]))
            elif name == "regex":
                assert re.fullmatch(REGEX, o["text"])
            else:
                assert o["text"] in CHOICES
    capsys.readouterr()


def test_streams_give_generates_outputs(llm):
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=24, seed=4,
                        structured_outputs=S(choice=CHOICES))
    want = llm.generate(PROMPTS, sp, use_tqdm=False)
    got = dict(llm.generate_stream(iter(PROMPTS), sp, use_tqdm=False))
    assert [[c.token_ids for c in got[i].outputs] for i in range(len(PROMPTS))] == \
        [[c.token_ids for c in o.outputs] for o in want]


def test_sampled_logprobs_stay_raw_and_logits_untouched(llm):
    """The mask changes which token is drawn, never the reported (raw) logprobs, nor the
    step's logits that beams and prompt logprobs read afterwards."""
    from sampling_rows import Row, columns

    from batchgen.sampling.grammar import GrammarRows
    from batchgen.sampling.sampler import Sampler

    g = llm.requests.grammars
    rows = [Row(SamplingParams(temperature=0.0, logprobs=3), [1, 5, 6], 3),
            Row(SamplingParams(temperature=1.0, logprobs=3), [1, 7], 2, seed=4)]
    cols = columns(rows, llm.vocab_size, [2])
    cols.grammar = GrammarRows(np.array([0, 1]), [g.constraint(S(choice=["no"]))
                                                  for _ in rows])
    with torch.inference_mode():
        logits = torch.randn(2, llm.vocab_size)
    before = logits.clone()
    out = Sampler()(logits, cols)
    assert torch.equal(logits, before)
    raw = torch.log_softmax(before, dim=-1)
    allowed = {t for t in range(llm.vocab_size) if llm.tokenizer.decode([t]) in ("n", "no")}
    for j, t in enumerate(out.token_ids.tolist()):
        assert t in allowed
        assert out.logprobs[j] == pytest.approx(raw[j, t].item(), abs=1e-5)
        assert out.top.entry(j)[t][1] == int((raw[j] > raw[j, t]).sum()) + 1  # its raw rank


def test_a_token_the_grammar_rejects_ends_the_sample_with_a_warning(llm, caplog):
    """Logit controls run after the mask: a processor can revive a masked token. The sample
    then ends there (its matcher cannot follow it), with a warning."""
    def force_x(ids, logits):
        logits[llm.tokenizer.convert_tokens_to_ids("x")] = 1e9
        return logits

    sp = SamplingParams(max_tokens=8, temperature=0, structured_outputs=S(regex="[0-9]+"),
                        logits_processors=[force_x])
    out = llm.generate(["hello"], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == "x"
    assert "its grammar rejected token" in caplog.text

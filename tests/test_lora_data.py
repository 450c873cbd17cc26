"""LoRA adapters in dataset jobs (batchgen/lora/dataset.py): `generate_dataset(lora_column=,
loras=)` and `batchgen generate --lora NAME=PATH --lora-column COL` against PEFT's own unmerged
models; a resume after an adapter changed redoes its rows' shards only; bad input is refused
before any work. (Ray Data with adapters: tests/test_ray.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from datasets import Dataset
from helpers import fresh_hf_model, make_prompt_token_ids, model_greedy, save_lora_adapter

peft = pytest.importorskip("peft")

from batchgen import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from batchgen.cli import main  # noqa: E402
from batchgen.data import generate_dataset  # noqa: E402
from batchgen.lora import LoRARequest  # noqa: E402

ADAPTERS = {"a": (4, ["q_proj", "v_proj"]), "b": (8, ["o_proj", "gate_proj", "down_proj"])}
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW)


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory("llama", num_hidden_layers=2)
    root = tmp_path_factory.mktemp("loras")
    for i, (name, (r, targets)) in enumerate(ADAPTERS.items(), 1):
        save_lora_adapter(model_dir, root / name, r, targets, i)
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    prompts = make_prompt_token_ids(6, 8, 16, 512, seed=11)
    names = [None, "a", "b", "a", "", "b"]
    rows = [{"prompt": p, "adapter": n} for p, n in zip(prompts, names)]
    return model_dir, root, llm, rows


def _peft_greedy(model_dir: Path, folder: Path | None, prompts: list[list[int]]) -> list:
    model = fresh_hf_model(model_dir)
    if folder is not None:
        model = peft.PeftModel.from_pretrained(model, folder).eval()
    return model_greedy(model, prompts, NEW)


def _oracle(model_dir: Path, root: Path, rows: list[dict]) -> list[list[int]]:
    """PEFT's greedy tokens for each row under its adapter (each adapter's prompts alone)."""
    want: dict[int, list[int]] = {}
    for name in (None, "a", "b"):
        idx = [i for i, r in enumerate(rows) if (r["adapter"] or None) == name]
        got = _peft_greedy(model_dir, None if name is None else root / name,
                           [rows[i]["prompt"] for i in idx])
        want.update(zip(idx, got))
    return [want[i] for i in range(len(rows))]


def _loras(root: Path) -> dict[str, str]:
    return {n: str(root / n) for n in ADAPTERS}


def _tokens(ds) -> list[list[int]]:
    return [o[0]["token_ids"] for o in ds["outputs"]]


def test_adapter_column_equals_peft_and_resume_redoes_a_changed_adapters_shards(setup,
                                                                               tmp_path):
    model_dir, root, llm, rows = setup
    loras = {n: str(tmp_path / n) for n in ADAPTERS}
    for n in ADAPTERS:
        shutil.copytree(root / n, tmp_path / n)
    out = tmp_path / "out"
    ds = generate_dataset(llm, Dataset.from_list(rows), GREEDY, lora_column="adapter", loras=loras,
                          output_dir=out, rows_per_shard=1, use_tqdm=False)
    assert _tokens(ds) == _oracle(model_dir, tmp_path, rows)
    assert ds["adapter"] == [r["adapter"] for r in rows]  # the adapter recorded per row
    assert _tokens(ds)[0] != _tokens(ds)[1]  # (different adapters, different tokens)
    before = {s["file"]: s["sha256"] for s in json.loads((out / "_manifest.json").read_text())
              ["shards"]}
    save_lora_adapter(model_dir, tmp_path / "b", 8, ADAPTERS["b"][1], seed=7)  # adapter b changes
    again = generate_dataset(llm, Dataset.from_list(rows), GREEDY, lora_column="adapter", loras=loras,
                             output_dir=out, resume=True, rows_per_shard=1, use_tqdm=False)
    assert _tokens(again) == _oracle(model_dir, tmp_path, rows)  # b's rows under the new b
    assert _tokens(again)[2] != _tokens(ds)[2]
    after = {s["file"]: s["sha256"] for s in json.loads((out / "_manifest.json").read_text())
             ["shards"]}
    assert len(before.items() & after.items()) == 4  # the base's and a's shards are kept,
    assert len(after) == 6  # only the two rows of b were redone


def test_beams_and_the_cli_take_the_adapter_column(setup, tmp_path, capsys):
    model_dir, root, llm, rows = setup
    bp = BeamSearchParams(beam_width=2, max_tokens=4)
    ds = generate_dataset(llm, Dataset.from_list(rows), bp, lora_column="adapter", loras=_loras(root),
                          use_tqdm=False)
    reqs = {n: LoRARequest(n, 50 + i, str(root / n)) for i, n in enumerate(ADAPTERS)}
    beams = llm.beam_search([{"prompt_token_ids": r["prompt"]} for r in rows], bp,
                            lora_request=[reqs.get(r["adapter"]) for r in rows], use_tqdm=False)
    assert [[s["token_ids"] for s in o] for o in ds["outputs"]] == [
        [s.tokens[len(r["prompt"]):] for s in b.sequences] for r, b in zip(rows, beams)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["generate", "--model", str(model_dir), "--input", str(data), "--temperature", "0",
             "--max-tokens", str(NEW), "--quiet", "--lora-column", "adapter"]
    lora_flags = [f for n in ADAPTERS for f in ("--lora", f"{n}={root / n}")]
    assert main(flags + lora_flags + ["--output", str(tmp_path / "cli")]) == 0
    got = Dataset.from_parquet([str(f) for f in sorted((tmp_path / "cli").glob("part-*"))])
    assert _tokens(got.sort("row_id")) == _oracle(model_dir, root, rows)
    assert got.sort("row_id")["adapter"] == [r["adapter"] for r in rows]


@pytest.mark.parametrize("case", ["unknown", "missing", "no_column", "flag", "flag_alone"])
def test_bad_adapter_input_is_refused_before_work(setup, tmp_path, capsys, case):
    model_dir, root, llm, rows = setup
    out = tmp_path / "out"
    if case in ("flag", "flag_alone"):
        data = tmp_path / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        extra = (["--lora", "a", "--lora-column", "adapter"] if case == "flag"
                 else ["--lora", f"a={root / 'a'}"])
        code = main(["generate", "--model", str(model_dir), "--input", str(data),
                     "--output", str(out), "--quiet", *extra])
        err = capsys.readouterr().err
        assert code == 2 and ("NAME=PATH" in err if case == "flag" else "--lora-column" in err)
        assert not out.exists()
        return
    kw = {"lora_column": "adapter", "loras": _loras(root)}
    data = rows
    if case == "unknown":
        data = rows[:3] + [{"prompt": rows[0]["prompt"], "adapter": "zzz"}]
        words = ["row 3", "'zzz'", "['a', 'b']"]
    elif case == "missing":
        kw["loras"] = {"a": str(root / "a"), "b": str(tmp_path / "nowhere")}
        words = ["'b'", "nowhere"]
    else:
        kw = {"loras": _loras(root)}
        words = ["loras", "lora_column"]
    with pytest.raises(ValueError) as e:
        generate_dataset(llm, Dataset.from_list(data), GREEDY, output_dir=out, use_tqdm=False,
                         **kw)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not out.exists() or not any(out.iterdir())


def _own_tokenizer(root: Path, folder: Path, chat_template: str | None = None) -> Path:
    """Adapter a's folder copied to `folder` with its own tokenizer: another BPE (500 ids)
    whose added token '<sql>' takes id 500."""
    import copy

    from batchgen.tools.make_tiny_model import build_tokenizer

    shutil.copytree(root / "a", folder)
    own = copy.deepcopy(build_tokenizer(500))
    own.add_tokens(["<sql>"])
    if chat_template is not None:
        own.chat_template = chat_template
    own.save_pretrained(folder)
    return folder


def test_an_adapters_own_tokenizer_encodes_its_prompts(setup, tmp_path):
    """vLLM's get_tokenizer(lora_request): an adapter folder with tokenizer files (here another
    BPE with an added token) gets that tokenizer, and its requests' text prompts are tokenized
    with it (generate and a dataset job); an adapter without one uses the base tokenizer."""
    model_dir, root, llm, _ = setup
    folder = _own_tokenizer(root, tmp_path / "a_tok")
    req, base = LoRARequest("a_tok", 77, str(folder)), llm.get_tokenizer()
    tok = llm.get_tokenizer(req)
    assert len(tok) == 501 and tok is not base
    assert llm.get_tokenizer(LoRARequest("a", 78, str(root / "a"))) is base
    text = "<sql> the cat runs over the river"
    ids = tok(text)["input_ids"]
    assert 500 in ids and ids != base(text)["input_ids"]
    outs = llm.generate([text, text], GREEDY, lora_request=[req, None], use_tqdm=False)
    assert outs[0].prompt_token_ids == ids and outs[0].prompt == text
    assert list(outs[0].outputs[0].token_ids) == _peft_greedy(model_dir, folder, [ids])[0]
    assert outs[1].prompt_token_ids == base(text)["input_ids"]
    ds = generate_dataset(llm, Dataset.from_list([{"prompt": text, "adapter": "t"}]), GREEDY,
                          lora_column="adapter", loras={"t": str(folder)}, use_tqdm=False)
    assert ds["num_prompt_tokens"] == [len(ids)]
    assert ds["outputs"][0][0]["token_ids"] == list(outs[0].outputs[0].token_ids)


def test_an_adapters_own_tokenizer_drives_its_output_text(setup, tmp_path):
    """vLLM's semantics: a request under an adapter that ships a tokenizer gets its output
    text, stop strings, bad_words, each Logprob.decoded_token and chat template (chat and a
    dataset's messages rows) from that tokenizer (its added token '<sql>', id 500, decodes as
    '<sql>'); a base request in the same batch, with the same tokens, keeps the base
    tokenizer's texts."""
    _, root, llm, _ = setup
    folder = _own_tokenizer(root, tmp_path / "a_tok",
                            "{% for m in messages %}<sql>{{ m['content'] }}{% endfor %}")
    req = LoRARequest("a_tok_out", 79, str(folder))
    tok, base = llm.get_tokenizer(req), llm.get_tokenizer()
    prompt = {"prompt_token_ids": make_prompt_token_ids(1, 8, 8, 500, seed=2)[0]}
    forced = {"temperature": 0, "logit_bias": {500: 100.0}}  # every token: id 500
    outs = llm.generate([prompt, prompt], SamplingParams(max_tokens=3, logprobs=0, **forced),
                        lora_request=[req, None], use_tqdm=False)
    for out, t in zip(outs, (tok, base)):
        o = out.outputs[0]
        assert list(o.token_ids) == [500] * 3
        assert o.text == t.decode([500] * 3, skip_special_tokens=True)
        assert [lp[500].decoded_token for lp in o.logprobs] == [t.decode([500])] * 3
    assert outs[0].outputs[0].text == "<sql>" * 3 != outs[1].outputs[0].text
    stop = SamplingParams(max_tokens=4, stop=["<sql><sql>"], include_stop_str_in_output=True,
                          **forced)
    a, b = (o.outputs[0] for o in llm.generate([prompt, prompt], stop, use_tqdm=False,
                                               lora_request=[req, None]))
    assert (a.text, a.finish_reason, a.stop_reason, len(a.token_ids)) == (
        "<sql><sql>", "stop", "<sql><sql>", 2)
    assert (b.finish_reason, len(b.token_ids)) == ("length", 4)
    banned = SamplingParams(max_tokens=2, bad_words=["<sql>"], **forced)
    a, b = (list(o.outputs[0].token_ids) for o in llm.generate(
        [prompt, prompt], banned, lora_request=[req, None], use_tqdm=False))
    assert 500 not in a and b == [500, 500]  # bad_words tokenized by the request's tokenizer
    conv = [{"role": "user", "content": "the cat"}]
    (out,) = llm.chat(conv, GREEDY, lora_request=req, use_tqdm=False)
    assert out.prompt_token_ids == tok.apply_chat_template(conv, tokenize=True,
                                                           return_dict=False)
    assert out.prompt_token_ids[0] == 500 and out.prompt == "<sql>the cat"
    ds = generate_dataset(llm, Dataset.from_list([{"messages": conv, "adapter": "t"}]), GREEDY,
                          messages_column="messages", lora_column="adapter",
                          loras={"t": str(folder)}, use_tqdm=False)  # a chat row likewise
    assert ds["outputs"][0][0]["token_ids"] == list(out.outputs[0].token_ids)
    assert ds["num_prompt_tokens"] == [len(out.prompt_token_ids)]

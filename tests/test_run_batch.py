"""`batchgen run-batch` / `batchgen.batch_api.run_batch`: an OpenAI Batch API file mixing chat,
completions, n=2, logprobs, an unknown url, a bad body and a line that is not JSON gets one
answer or error per line, in order; greedy answers equal `LLM.chat` / `LLM.generate`; all lines
run in one streamed call; the output is written atomically, an existing one is refused
without `--resume` or `--overwrite`, and `--resume` reuses exactly the answers whose request
(model, served name, body) is unchanged: a changed line is recomputed and counted as such."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams
from batchgen.batch_api import run_batch
from batchgen.cli import main

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"}]


def line(cid: str, url: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def mixed_lines() -> list[str]:
    chat, cmpl = "/v1/chat/completions", "/v1/completions"
    return [
        line("chat", chat, model="x", messages=CHAT, max_tokens=10, temperature=0),
        line("chat-parts", chat, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is the capital "}, {"type": "text",
                                                                "text": "of France?"}]}],
             max_completion_tokens=10, temperature=0, logprobs=True, top_logprobs=3),
        line("cmpl", cmpl, prompt="The cat runs over the", max_tokens=7, temperature=0,
             logprobs=2, stop=["zzz"]),
        line("n2", cmpl, prompt="the blue house", n=2, max_tokens=6, seed=11,
             temperature=0.9, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3),
        line("url", "/v1/embeddings", input="hello"),
        line("body", cmpl, prompt="x", temperature=-1),
        "{this is not json",
        "",
        line("unknown-field", chat, messages=CHAT, tools=[{"type": "function"}]),
        line("tokens", cmpl, prompt=[1, 5, 9, 40], max_tokens=4, temperature=0, echo=True),
    ]


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama", eos_boost=0.03)), device="cpu", max_num_seqs=8,
               block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def answered(llm: LLM, tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("batch")
    (folder / "in.jsonl").write_text("\n".join(mixed_lines()) + "\n")
    summary = run_batch(llm, folder / "in.jsonl", folder / "out.jsonl", use_tqdm=False)
    assert (summary.answered, summary.reused, summary.errors) == (5, 0, 4)
    assert sorted(p.name for p in folder.iterdir()) == [".out.jsonl.fingerprints", "in.jsonl",
                                                        "out.jsonl"]
    return [json.loads(t) for t in (folder / "out.jsonl").read_text().splitlines()]


def by_id(lines: list[dict]) -> dict[str, dict]:
    return {d["custom_id"]: d for d in lines if d["custom_id"] is not None}


def test_one_line_per_input_line_in_order(answered) -> None:
    assert [d["custom_id"] for d in answered] == ["chat", "chat-parts", "cmpl", "n2", "url",
                                                  "body", None, "unknown-field", "tokens"]
    for d in answered:
        assert set(d) == {"id", "custom_id", "response", "error"}
        assert d["id"].startswith("batch_req-")


def test_greedy_chat_equals_llm_chat(llm, answered) -> None:
    got = by_id(answered)
    ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    body = got["chat"]["response"]["body"]
    assert got["chat"]["response"]["status_code"] == 200 and got["chat"]["error"] is None
    assert body["object"] == "chat.completion" and body["model"] == llm.model_path.name
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": ref.outputs[0].text,
                                 "refusal": None}
    assert choice["finish_reason"] == ref.outputs[0].finish_reason
    assert choice["logprobs"] is None
    n_out = len(ref.outputs[0].token_ids)
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_token_ids),
                             "completion_tokens": n_out,
                             "total_tokens": len(ref.prompt_token_ids) + n_out}


def test_chat_content_parts_and_logprobs(llm, answered) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ref = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=10, logprobs=3),
                   use_tqdm=False)[0].outputs[0]
    (choice,) = by_id(answered)["chat-parts"]["response"]["body"]["choices"]
    assert choice["message"]["content"] == ref.text
    content = choice["logprobs"]["content"]
    assert len(content) == len(ref.token_ids)
    for tok, entry, want in zip(content, ref.logprobs, ref.token_ids):
        assert tok["logprob"] == pytest.approx(entry[want].logprob)
        assert tok["bytes"] == list(tok["token"].encode("utf-8"))
        tops = tok["top_logprobs"]
        assert len(tops) == 3
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert tops[0]["logprob"] >= tok["logprob"]


def test_completions_greedy_and_logprobs(llm, answered) -> None:
    ref = llm.generate("The cat runs over the", SamplingParams(temperature=0, max_tokens=7),
                       use_tqdm=False)[0].outputs[0]
    body = by_id(answered)["cmpl"]["response"]["body"]
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ref.token_ids)
    assert lp["text_offset"][0] == 0
    assert all(len(t) == 2 for t in lp["top_logprobs"] if t is not None)


def test_n2_matches_generate_with_the_seed(llm, answered) -> None:
    params = SamplingParams(n=2, max_tokens=6, seed=11, temperature=0.9, top_p=0.95,
                            presence_penalty=0.5, frequency_penalty=0.3)
    ref = llm.generate("the blue house", params, use_tqdm=False)[0]
    body = by_id(answered)["n2"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [o.text for o in ref.outputs]
    assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in ref.outputs)


def test_token_prompt_with_echo(llm, answered) -> None:
    (choice,) = by_id(answered)["tokens"]["response"]["body"]["choices"]
    ref = llm.generate({"prompt_token_ids": [1, 5, 9, 40]},
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert choice["text"] == llm.get_tokenizer().decode([1, 5, 9, 40]) + ref.outputs[0].text


def test_lines_that_cannot_be_served_get_errors(answered) -> None:
    got = by_id(answered)
    assert got["url"]["error"]["code"] == "invalid_url"
    assert got["url"]["response"]["status_code"] == 400
    assert "/v1/embeddings" in got["url"]["error"]["message"]
    assert got["body"]["error"]["code"] == "invalid_request"
    assert got["body"]["error"]["message"].startswith("temperature must be")
    assert got["body"]["response"]["body"]["error"]["param"] == "temperature"
    assert "tools" in got["unknown-field"]["error"]["message"]
    (not_json,) = [d for d in answered if d["custom_id"] is None]
    assert not_json["error"]["code"] == "invalid_json" and not_json["response"] is None
    assert "line 7" in not_json["error"]["message"]


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "messages must be"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs must be"),
    ({"messages": CHAT, "n": 0}, "n must be"),
    ({"messages": CHAT, "stream": True}, "stream must be false"),
    ({"messages": [{"role": "user", "content": [{"type": "audio_url"}]}]}, "content parts must"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]}, "not a readable image"),
    ({"messages": CHAT, "logit_bias": {"x": 1}}, "logit_bias must map"),
    ({"messages": CHAT, "n": 8, "max_tokens": 1000}, "can never fit the pool"),
])
def test_bad_chat_bodies(llm, tmp_path, body, message) -> None:
    (tmp_path / "in.jsonl").write_text(line("a", "/v1/chat/completions", **body) + "\n")
    s = run_batch(llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", use_tqdm=False)
    assert (s.answered, s.errors) == (0, 1)
    (d,) = [json.loads(t) for t in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert message in d["error"]["message"] or message in json.dumps(d["error"])


def test_all_lines_in_one_streamed_call(llm, tmp_path, monkeypatch) -> None:
    calls = []
    real = llm.generate_stream
    monkeypatch.setattr(llm, "generate_stream",
                        lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    lines = [line(f"c{i}", "/v1/completions", prompt=f"the cat {i}", max_tokens=3)
             for i in range(12)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines))
    run_batch(llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", use_tqdm=False)
    assert calls == [12]


def interrupt_after_two(llm, src, out, monkeypatch) -> None:
    """A run of `src` that a Ctrl-C stops after two answers (the LLM is left as it was)."""
    real = llm.generate_stream

    def stops_after_two(*a, **k):
        for count, item in enumerate(real(*a, **k)):
            if count == 2:
                raise KeyboardInterrupt
            yield item

    with monkeypatch.context() as m:
        m.setattr(llm, "generate_stream", stops_after_two)
        with pytest.raises(KeyboardInterrupt):
            run_batch(llm, src, out, use_tqdm=False)


def test_resume_after_an_interrupted_run(llm, tmp_path, monkeypatch) -> None:
    lines = [line(f"c{i}", "/v1/completions", prompt=f"the red tree {i}", max_tokens=4,
                  temperature=0) for i in range(6)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    full = run_batch(llm, tmp_path / "in.jsonl", tmp_path / "full.jsonl", use_tqdm=False)
    assert full.answered == 6
    interrupt_after_two(llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", monkeypatch)
    assert not (tmp_path / "out.jsonl").exists()
    assert len((tmp_path / ".out.jsonl.partial").read_text().splitlines()) == 2
    s = run_batch(llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", resume=True,
                  use_tqdm=False)
    assert (s.answered, s.reused, s.errors) == (4, 2, 0)
    assert not (tmp_path / ".out.jsonl.partial").exists()
    texts = [[json.loads(t)["response"]["body"]["choices"][0]["text"]
              for t in (tmp_path / name).read_text().splitlines()]
             for name in ("full.jsonl", "out.jsonl")]
    assert texts[0] == texts[1]
    again = run_batch(llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", resume=True,
                      use_tqdm=False)
    assert (again.answered, again.reused) == (0, 6)


def test_cli(llm, tmp_path, capsys) -> None:
    (tmp_path / "in.jsonl").write_text("\n".join(mixed_lines()[:4]) + "\n")
    argv = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
            "--model", str(llm.model_path), "--num-kv-blocks", "256", "--block-size", "4",
            "--max-num-seqs", "8", "--quiet", "--served-model-name", "tiny"]
    assert main(argv) == 0
    assert "4 lines" in capsys.readouterr().out
    outs = [json.loads(t) for t in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [d["response"]["body"]["model"] for d in outs] == ["tiny"] * 4
    assert main(["run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", "x.jsonl", "--model",
                 str(llm.model_path)]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    assert ": 0 answered, 4 reused, 0 recomputed (changed), 0 errors (" in \
        capsys.readouterr().out


def test_examples_batch_file_parses() -> None:
    from batchgen.batch_api.requests import parse_line

    path = Path(__file__).resolve().parents[1] / "examples" / "data" / "batch.jsonl"
    for number, text in enumerate(path.read_text().splitlines(), 1):
        assert parse_line(text, number).custom_id


# ---- resume only what is unchanged; never overwrite by surprise --------------------------------
def completion_lines(max_tokens: list[int]) -> list[str]:
    return [line(f"c{i}", "/v1/completions", prompt=f"the green river {i}", max_tokens=m,
                 temperature=0) for i, m in enumerate(max_tokens)]


def answers(path: Path) -> dict[str, dict]:
    return {d["custom_id"]: d["response"]["body"]
            for d in map(json.loads, path.read_text().splitlines())}


def test_resume_recomputes_exactly_the_edited_lines(llm, tmp_path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(completion_lines([6, 6, 6, 6])) + "\n")
    first = run_batch(llm, src, out, use_tqdm=False)
    assert (first.answered, first.reused, first.recomputed) == (4, 0, 0)
    before = answers(out)
    src.write_text("\n".join(completion_lines([6, 2, 6, 6])) + "\n")  # c1's body changed
    s = run_batch(llm, src, out, resume=True, use_tqdm=False)
    assert (s.answered, s.reused, s.recomputed, s.errors, s.lines) == (0, 3, 1, 0, 4)
    after = answers(out)
    assert after["c1"]["usage"]["completion_tokens"] <= 2
    assert {k: after[k] for k in ("c0", "c2", "c3")} == {k: before[k] for k in ("c0", "c2", "c3")}
    ref = llm.generate("the green river 1", SamplingParams(temperature=0, max_tokens=2),
                       use_tqdm=False)[0].outputs[0]
    assert after["c1"]["choices"][0]["text"] == ref.text
    again = run_batch(llm, src, out, resume=True, use_tqdm=False)  # nothing left to do
    assert (again.answered, again.reused, again.recomputed) == (0, 4, 0)
    assert run_batch(llm, src, out, resume=True, model_name="other", use_tqdm=False
                     ).recomputed == 4  # the served name is in every answer: all redone


def test_resume_after_a_model_change_recomputes_every_line(llm, tiny_model_factory,
                                                           tmp_path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(completion_lines([5, 5, 5])) + "\n")
    run_batch(llm, src, out, model_name="m", use_tqdm=False)
    other = LLM(str(tiny_model_factory("llama", seed=7, eos_boost=0.03)), device="cpu",
                max_num_seqs=8, block_size=4, num_kv_blocks=256)
    s = run_batch(other, src, out, resume=True, model_name="m", use_tqdm=False)
    assert (s.answered, s.reused, s.recomputed) == (0, 0, 3)
    fresh = tmp_path / "fresh.jsonl"
    run_batch(other, src, fresh, model_name="m", use_tqdm=False)
    texts = [{k: v["choices"][0]["text"] for k, v in answers(p).items()} for p in (out, fresh)]
    assert texts[0] == texts[1]


def test_resume_after_a_kill_keeps_each_answer_with_its_request(llm, tmp_path,
                                                                monkeypatch) -> None:
    """An interrupted run's progress file holds each answer with its request's fingerprint:
    a resume after the line was edited recomputes it instead of reusing the stale answer."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(completion_lines([4, 4, 4, 4])) + "\n")
    interrupt_after_two(llm, src, out, monkeypatch)
    logged = [json.loads(t) for t in (tmp_path / ".out.jsonl.partial").read_text().splitlines()]
    assert [set(e) for e in logged] == [{"fingerprint", "answer"}] * 2
    edited = logged[0]["answer"]["custom_id"]
    widths = [3 if f"c{i}" == edited else 4 for i in range(4)]
    src.write_text("\n".join(completion_lines(widths)) + "\n")
    s = run_batch(llm, src, out, resume=True, use_tqdm=False)
    assert (s.answered, s.reused, s.recomputed) == (2, 1, 1)


def test_existing_output_is_refused_without_resume_or_overwrite(llm, tmp_path, capsys) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(completion_lines([3])) + "\n")
    out.write_text("my earlier answers\n")
    with pytest.raises(ValueError, match=r"output_path '.*out.jsonl' exists: pass resume=True "
                                         r"to reuse .* or overwrite=True to replace them"):
        run_batch(llm, src, out, use_tqdm=False)
    assert out.read_text() == "my earlier answers\n"
    argv = ["run-batch", "-i", str(src), "-o", str(out), "--model", str(llm.model_path),
            "--num-kv-blocks", "256", "--block-size", "4", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-o " in err and "exists: pass --resume to reuse the " \
        "answers whose request is unchanged, or --overwrite to replace them" in err
    assert out.read_text() == "my earlier answers\n"
    assert main([*argv, "--overwrite"]) == 0
    assert list(answers(out)) == ["c0"]
    out.unlink()
    (tmp_path / ".out.jsonl.partial").write_text("")  # a stopped run's progress
    with pytest.raises(ValueError, match="has a stopped run's answers in .out.jsonl.partial"):
        run_batch(llm, src, out, use_tqdm=False)
    with pytest.raises(ValueError, match="pass resume=True .* or overwrite=True .*, not both"):
        run_batch(llm, src, out, resume=True, overwrite=True, use_tqdm=False)

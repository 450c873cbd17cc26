"""`batchgen.eval.BatchgenLM` and `batchgen eval`: lm-eval's metrics and per-sample responses on
local tasks (multiple choice, generation with `until`, rolling perplexity over several windows)
equal lm-eval's `hf` backend on the same tiny fp32 model; one generate call per request list;
greedy flags from prompt-logprob ranks; bad arguments refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.cli import main  # noqa: E402
from batchgen.eval import BatchgenLM  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"
TASKS = ["bg_mc", "bg_gen", "bg_ppl"]
MAX_LENGTH = 32  # short windows: the longer documents roll over several


def local_tasks() -> TaskManager:
    """The tests' own tasks only: indexing lm-eval's thousands of built-in ones takes ~30 s."""
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


class in_tasks_dir:
    """cwd = tests/eval_tasks while lm-eval loads the tasks' relative data_files."""

    def __enter__(self) -> None:
        self.old = os.getcwd()
        os.chdir(TASKS_DIR)

    def __exit__(self, *exc) -> None:
        os.chdir(self.old)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def lm(model_dir) -> BatchgenLM:
    return BatchgenLM(str(model_dir), max_length=MAX_LENGTH, device="cpu", block_size=4,
                      num_kv_blocks=512, max_num_seqs=16)


def evaluate(model, **kw) -> dict:
    with in_tasks_dir():
        return lm_eval.simple_evaluate(model=model, tasks=TASKS, log_samples=True,
                                       task_manager=local_tasks(),
                                       **kw)


@pytest.fixture(scope="module")
def both(model_dir, lm) -> tuple[dict, dict]:
    hf = evaluate("hf", model_args=f"pretrained={model_dir},dtype=float32,"
                                   f"max_length={MAX_LENGTH}", device="cpu", batch_size=8)
    return hf, evaluate(lm)


def metrics(result: dict, task: str) -> dict[str, float]:
    return {k: float(v) for k, v in result["results"][task].items()
            if "," in k and "stderr" not in k}


@pytest.mark.parametrize("task, names", [
    ("bg_mc", {"acc,none", "acc_norm,none"}), ("bg_gen", {"exact_match,none"}),
    ("bg_ppl", {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"})])
def test_metrics_equal_the_hf_backend(both, task, names) -> None:
    hf, bg = (metrics(r, task) for r in both)
    assert set(hf) == set(bg) == names
    for name in names:
        assert bg[name] == pytest.approx(hf[name], rel=1e-3, abs=1e-9), name


def test_responses_equal_the_hf_backend(both) -> None:
    hf, bg = both
    for task in TASKS:
        for a, b in zip(hf["samples"][task], bg["samples"][task], strict=True):
            for ra, rb in zip(a["resps"], b["resps"], strict=True):
                if task == "bg_gen":
                    assert ra == rb
                elif task == "bg_mc":
                    (lpa, ga), (lpb, gb) = ra[0], rb[0]
                    assert lpb == pytest.approx(lpa, rel=1e-4) and ga == gb
                else:
                    assert rb[0] == pytest.approx(ra[0], rel=1e-4)
    texts = [s["resps"][0][0] for s in bg["samples"]["bg_gen"]]
    assert all(" " not in t and "\n" not in t for t in texts)  # `until` cut them


def test_rolling_documents_span_several_windows(lm) -> None:
    docs = [json.loads(t)["text"] for t in (TASKS_DIR / "ppl.jsonl").read_text().splitlines()]
    assert max(len(lm.tok_encode(d)) for d in docs) > 3 * MAX_LENGTH


def test_loglikelihood_is_one_call_and_greedy_flags_follow_ranks(lm, monkeypatch) -> None:
    llm: LLM = lm.llm
    ctx = [1, 40, 41, 42, 43]
    greedy = llm.generate({"prompt_token_ids": ctx}, SamplingParams(temperature=0, max_tokens=4),
                          use_tqdm=False)[0].outputs[0]
    other = [(greedy.token_ids[0] + 1) % 100 + 3] + greedy.token_ids[1:]
    calls = []
    real = llm.generate
    monkeypatch.setattr(llm, "generate", lambda p, *a, **k: calls.append(len(p)) or real(p, *a, **k))
    (lp, is_greedy), (lp2, is_greedy2), _ = lm._loglikelihood_tokens(
        [(None, ctx, greedy.token_ids), (None, ctx, other), (None, ctx, greedy.token_ids)])
    assert calls == [2]  # one call; the repeated request scored once
    assert is_greedy and not is_greedy2
    assert lp == pytest.approx(greedy.cumulative_logprob, rel=1e-4)
    assert lp2 < lp


def test_choices_share_their_context_through_the_prefix_cache(model_dir, lm) -> None:
    """Loglikelihoods equal (1e-5) with the prefix cache off; with it on, the choices of one
    question hit the blocks of the first one's context."""
    off = BatchgenLM(str(model_dir), max_length=MAX_LENGTH, device="cpu", block_size=4,
                     num_kv_blocks=512, max_num_seqs=16, enable_prefix_caching=False)
    runs = {}
    for name, model in (("on", lm), ("off", off)):
        with in_tasks_dir():
            runs[name] = lm_eval.simple_evaluate(
                model=model, tasks=["bg_mc"], log_samples=True,
                task_manager=local_tasks())
        runs[name + "_stats"] = model.llm.kv_stats()
    on, off_stats = runs["on_stats"], runs["off_stats"]
    assert on.prefix_hit_tokens > 0 and off_stats.prefix_hit_tokens == 0
    assert on.prompt_tokens_computed + on.prefix_hit_tokens == off_stats.prompt_tokens_computed
    pairs = zip(runs["on"]["samples"]["bg_mc"], runs["off"]["samples"]["bg_mc"], strict=True)
    for a, b in pairs:
        for (lpa, ga), (lpb, gb) in ((ra[0], rb[0]) for ra, rb in zip(a["resps"], b["resps"])):
            assert lpa == pytest.approx(lpb, abs=1e-5) and ga == gb


def test_generate_until_gen_kwargs(lm) -> None:
    req = [Instance("generate_until", {}, ("Q: the cat\nA:", {"until": ["\n"],
                                                                  "max_gen_toks": 3}), 0),
           Instance("generate_until", {}, ("Q: the cat\nA:", {"max_gen_toks": 5, "seed": 1,
                                                                  "do_sample": True,
                                                                  "temperature": 0.8}), 1)]
    greedy, sampled = lm.generate_until(req)
    ids = lm.tok_encode("Q: the cat\nA:")
    ref = lm.llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3),
                          use_tqdm=False)[0].outputs[0].text
    assert greedy == ref.split("\n")[0]
    ref2 = lm.llm.generate({"prompt_token_ids": ids},
                           SamplingParams(temperature=0.8, max_tokens=5, seed=1),
                           use_tqdm=False)[0].outputs[0].text
    assert sampled == ref2


@pytest.mark.parametrize("kwargs, message", [
    ({"max_length": 10**6}, "max_length must be <= max_model_len - 2"),
    ({"max_gen_toks": 0}, "max_gen_toks must be"),
    ({"add_bos_token": "yes"}, "add_bos_token must be"),
])
def test_bad_arguments(lm, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        BatchgenLM(lm.llm, **kwargs)


def test_unknown_gen_kwargs_are_refused(lm) -> None:
    req = Instance("generate_until", {}, ("x", {"num_beams": 4}), 0)
    with pytest.raises(ValueError, match="gen_kwargs must be keys among"):
        lm.generate_until([req])


def test_cli_runs_lm_eval_with_the_batchgen_backend(model_dir, tmp_path, capsys) -> None:
    with in_tasks_dir():
        code = main(["eval", "--model", str(model_dir), "--max-length", str(MAX_LENGTH),
                     "--num-kv-blocks", "512", "--tasks", "bg_mc", "--include_path",
                     str(TASKS_DIR), "--limit", "4", "--output_path", str(tmp_path / "res"),
                     "--model_args", "block_size=4", "--batch_size", "8", "--device", "cpu"])
    assert code == 0
    (result,) = tmp_path.glob("res/**/results_*.json")
    data = json.loads(result.read_text())
    assert data["config"]["model"] == "batchgen"
    assert data["config"]["model_args"]["block_size"] == 4
    assert "acc,none" in data["results"]["bg_mc"]


def test_other_commands_still_refuse_unknown_flags(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "x", "--input", "y", "--output", "z", "--tasks", "t"])
    assert e.value.code == 2
    assert "unrecognized arguments: --tasks t" in capsys.readouterr().err


def test_an_adapter_scores_as_the_hf_backend_with_peft(model_dir, tmp_path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                      target_modules=["q_proj", "down_proj"]))
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "adapter")
    folder = tmp_path / "adapter"
    hf = evaluate("hf", model_args=f"pretrained={model_dir},dtype=float32,peft={folder},"
                                   f"max_length={MAX_LENGTH}", device="cpu", batch_size=8,
                  limit=4)
    ours = evaluate(BatchgenLM(str(model_dir), max_length=MAX_LENGTH, device="cpu",
                               block_size=4, num_kv_blocks=512, lora_local_path=str(folder)),
                    limit=4)
    base_run = evaluate(BatchgenLM(str(model_dir), max_length=MAX_LENGTH, device="cpu",
                                   block_size=4, num_kv_blocks=512), limit=4)
    for task in ("bg_mc", "bg_ppl"):
        assert metrics(ours, task) == pytest.approx(metrics(hf, task), rel=1e-4)
    assert metrics(ours, "bg_ppl") != metrics(base_run, "bg_ppl")


def test_cli_lora_flag_is_lm_evals_lora_local_path() -> None:
    from batchgen.cli import build_parser
    from batchgen.cli.evaluate import lm_eval_argv

    for flag in ("--lora", "--lora-local-path"):
        args, extra = build_parser().parse_known_args(["eval", "--model", "m", flag, "/a",
                                                       "--tasks", "t"])
        argv = lm_eval_argv(args, extra)
        assert argv[:4] == ["run", "--model", "batchgen", "--model_args"]
        assert argv[4] == "pretrained=m,lora_local_path=/a" and argv[5:7] == ["--tasks", "t"]

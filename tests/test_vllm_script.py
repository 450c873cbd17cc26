"""A vLLM offline script runs on batchgen with only its imports changed, and agrees with HF.

`VLLM_SCRIPT` is written as a vLLM user writes one (`from vllm import ...`); the fixture swaps
the import lines for `from batchgen import ...`, changes nothing else, and runs it once. The
tests then check what it produced against HF on the same weights where HF is the oracle
(prompt logprobs, logit_bias, allowed_token_ids, bad_words, logits processors, chat templating,
beam logprobs) and against the documented vLLM behaviour elsewhere. The conventions that need
a process or a folder of their own (hub cache, `~`, logging) follow the script.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import EOS_ID, PAD_ID, load_hf_model

from batchgen import LLM, Logprob, SamplingParams
from batchgen.tools.make_tiny_model import make_tiny_model, save_tokenizer

ROOT = Path(__file__).resolve().parents[1]

# Sampling defaults a model ships in generation_config.json (vLLM applies them when
# sampling_params is None).
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                       "repetition_penalty": 1.05, "max_new_tokens": 9}

VLLM_SCRIPT = '''
import functools

import numpy as np
from tqdm.auto import tqdm
from vllm import LLM, SamplingParams, TextPrompt, TokensPrompt
from vllm.sampling_params import BeamSearchParams

llm = LLM(model=MODEL, tokenizer=TOKENIZER, tensor_parallel_size=1, seed=None,
          enforce_eager=True, kv_cache_memory_bytes=KV_BYTES, max_model_len=256,
          max_logprobs=-1)
tokenizer = llm.get_tokenizer()
bars = []

def bar(*args, **kwargs):
    bars.append(kwargs)
    return tqdm(*args, **{**kwargs, "disable": True})

R = {"repr": repr(llm), "defaults": llm.get_default_sampling_params()}
R["default_run"] = llm.generate(["Once upon a time", TextPrompt(prompt="The weather")],
                                use_tqdm=bar)
greedy = SamplingParams(temperature=0.0, max_tokens=8)
R["greedy"] = llm.generate({"prompt": "To make a simple bread"}, greedy, use_tqdm=False)
R["scored"] = llm.generate(
    TokensPrompt(prompt_token_ids=np.array(PROMPT_IDS)),
    SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2),
    use_tqdm=False)
R["sampled"] = llm.generate(TokensPrompt(prompt_token_ids=PROMPT_IDS), SamplingParams(
    temperature=1.5, max_tokens=12, logprobs=0, seed=7), use_tqdm=False)
R["everything"] = llm.generate("The weather",
                               SamplingParams(temperature=0, max_tokens=2, logprobs=-1),
                               use_tqdm=False)
R["sure"] = llm.generate("The weather",
                         SamplingParams(temperature=0, max_tokens=2, logprobs=True),
                         use_tqdm=False)
R["biased"] = llm.generate(TokensPrompt(prompt_token_ids=PROMPT_IDS), SamplingParams(
    temperature=0, max_tokens=8, logit_bias=BIAS), use_tqdm=False)
R["allowed"] = llm.generate(TokensPrompt(prompt_token_ids=PROMPT_IDS), SamplingParams(
    temperature=0, max_tokens=8, allowed_token_ids=ALLOWED), use_tqdm=False)
R["no_bad_words"] = llm.generate(TokensPrompt(prompt_token_ids=PROMPT_IDS), SamplingParams(
    temperature=0, max_tokens=8, bad_words=BAD_WORDS), use_tqdm=False)
seen = []

def ban_first_choice(token_ids, logits):
    logits[FORBIDDEN] = -float("inf")
    return logits

def watch(prompt_token_ids, token_ids, logits):
    seen.append((list(prompt_token_ids), list(token_ids)))
    return logits

R["processed"] = llm.generate(TokensPrompt(prompt_token_ids=PROMPT_IDS), SamplingParams(
    temperature=0, max_tokens=5, logits_processors=[ban_first_choice, watch]), use_tqdm=False)
R["seen"] = seen
R["ids_only"] = llm.generate(TokensPrompt(prompt_token_ids=PROMPT_IDS), SamplingParams(
    temperature=0, max_tokens=5, logprobs=1, detokenize=False), use_tqdm=False)
R["truncated"] = llm.generate(TokensPrompt(prompt_token_ids=PROMPT_IDS), SamplingParams(
    temperature=0, max_tokens=5, truncate_prompt_tokens=5), use_tqdm=False)
R["tail"] = llm.generate(TokensPrompt(prompt_token_ids=PROMPT_IDS[-5:]), SamplingParams(
    temperature=0, max_tokens=5), use_tqdm=False)
texts = ["Sphinx of black quartz", "Dear friend, thank you"]
R["from_generator"] = llm.generate((t for t in texts), greedy, use_tqdm=False)
R["from_array"] = llm.generate(np.array(texts), greedy, use_tqdm=False)
R["from_list"] = llm.generate(texts, greedy, use_tqdm=False)
conversation = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
R["chat"] = llm.chat(conversation, greedy, use_tqdm=False)
R["chats"] = llm.chat([conversation, conversation[1:]], greedy, use_tqdm=False)
R["continued"] = llm.chat(conversation + [{"role": "assistant", "content": "It is"}], greedy,
                          use_tqdm=False, add_generation_prompt=False,
                          continue_final_message=True)
R["templated"] = llm.chat(conversation, greedy, use_tqdm=False, chat_template=TEMPLATE,
                          chat_template_kwargs={"shout": True})
long_prompt = "Once upon a time, in a small village at the edge of a great forest, there lived"
R["cold"] = llm.generate(long_prompt, greedy, use_tqdm=False)
R["warm"] = llm.generate(long_prompt, greedy, use_tqdm=False)
R["warm_stats"] = llm.kv_stats()
R["reset"] = llm.reset_prefix_cache()
R["after_reset"] = llm.generate(long_prompt, greedy, use_tqdm=False)
R["beams"] = llm.beam_search([{"prompt": "The weather today"}],
                             BeamSearchParams(beam_width=3, max_tokens=6))
R["bars"] = bars
'''


def as_batchgen(script: str) -> str:
    """The one edit a user makes: vLLM's imports become batchgen's."""
    return re.sub(r"^from vllm(\.\w+)* import", "from batchgen import", script, flags=re.M)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A model folder without a tokenizer (its generation_config sets sampling defaults) and
    the tokenizer in a folder of its own."""
    root = tmp_path_factory.mktemp("vllm-script")
    model = make_tiny_model(root / "model", family="llama", with_tokenizer=False)
    cfg_path = model / "generation_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(GENERATION_DEFAULTS)
    cfg_path.write_text(json.dumps(cfg))
    save_tokenizer(512, root / "tokenizer")
    return model, root / "tokenizer"


@pytest.fixture(scope="module")
def tok(folders):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folders[1])


@pytest.fixture(scope="module")
def knobs(folders, tok):
    """The script's inputs: a prompt and controls chosen from HF's own greedy continuation, so
    that each control changes the output."""
    prompt = tok("The quick brown fox jumps over the lazy")["input_ids"]
    free = hf_generate(folders[0], prompt, 8)
    words = [tok.decode([t]).strip() for t in free]
    bad = next(w for w in words if w and w.isalpha())
    return {"PROMPT_IDS": prompt, "BIAS": {free[0]: -100.0, free[1]: 4.0},
            "ALLOWED": sorted({free[2], free[3], 7, 11, 200}), "BAD_WORDS": [bad],
            "FORBIDDEN": free[0],
            "TEMPLATE": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n"
                        "{% endfor %}{% if shout %}!{% endif %}",
            "FREE": free}


@pytest.fixture(scope="module")
def run(folders, knobs):
    model, tokenizer = folders
    namespace = {"MODEL": str(model), "TOKENIZER": str(tokenizer), "KV_BYTES": 2**20, **knobs}
    exec(compile(as_batchgen(VLLM_SCRIPT), "vllm_script.py", "exec"), namespace)
    return namespace["R"] | {"llm": namespace["llm"]}


@torch.no_grad()
def hf_generate(model_dir: Path, prompt: list[int], max_new_tokens: int, **kw) -> list[int]:
    """HF greedy `generate` (the oracle), generated ids only, cut after EOS; the folder's
    repetition_penalty default stays out, as explicit SamplingParams leave it out in vLLM."""
    hf = load_hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      do_sample=False, repetition_penalty=1.0, eos_token_id=EOS_ID,
                      pad_token_id=PAD_ID, **kw)
    gen = out[0, len(prompt):].tolist()
    return gen[:gen.index(EOS_ID) + 1] if EOS_ID in gen else gen


@torch.no_grad()
def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """HF's raw log-softmax at every position of `ids` (row i scores token i + 1)."""
    hf = load_hf_model(model_dir)
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def tokens(out) -> list[int]:
    return out[0].outputs[0].token_ids


def rank(row: torch.Tensor, token: int) -> int:
    return int((row > row[token]).sum()) + 1


def test_the_script_runs_with_only_its_imports_changed(run):
    assert "from vllm" not in as_batchgen(VLLM_SCRIPT)
    assert as_batchgen(VLLM_SCRIPT).count("from batchgen import") == 2
    assert run["repr"].startswith("LLM(model=") and "max_model_len=256" in run["repr"]


def test_kv_cache_memory_bytes_sizes_the_pool(run):
    c = run["llm"].cache_config
    assert c.num_blocks == 2**20 // (c.bytes_per_token * c.block_size)


def test_generation_config_defaults_apply_when_no_params_are_given(run):
    d = run["defaults"]
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty, d.max_tokens) == (
        0.7, 20, 0.8, 1.05, 9)
    assert all(1 <= len(o.outputs[0].token_ids) <= 9 for o in run["default_run"])


def test_use_tqdm_takes_a_callable(run):
    assert len(run["bars"]) == 1 and run["bars"][0]["total"] == 2


def test_text_prompt_forms_are_tokenized_with_the_separate_tokenizer(run, folders, tok):
    out = run["greedy"][0]
    ids = tok("To make a simple bread")["input_ids"]
    assert out.prompt == "To make a simple bread" and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_generate(folders[0], ids, 8)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    same = [tokens([o]) for o in run["from_list"]]
    assert [tokens([o]) for o in run["from_generator"]] == same
    assert [tokens([o]) for o in run["from_array"]] == same


def test_logprobs_are_logprob_objects_with_ranks_and_text(run, folders, knobs, tok):
    out = run["scored"][0]
    c = out.outputs[0]
    lp = hf_logprobs(folders[0], knobs["PROMPT_IDS"] + c.token_ids)[len(knobs["PROMPT_IDS"]) - 1:]
    for t, (chosen, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        top = lp[t].topk(3).indices.tolist()
        assert set(entry) == {chosen, *top}
        for tid, v in entry.items():
            assert isinstance(v, Logprob)
            assert v.logprob == pytest.approx(lp[t, tid].item(), abs=1e-4)
            assert v.rank == rank(lp[t], tid)
            text = tok.decode([tid])
            if not text.endswith("\ufffd"):
                assert v.decoded_token == text
            else:  # vLLM's: a split character completed by the chosen tokens before, or ""
                before = tok.decode(c.token_ids[max(0, t - 4):t] + [tid])
                assert not v.decoded_token.endswith("\ufffd")
                assert v.decoded_token == "" or before.endswith(v.decoded_token)
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t, x].item() for t, x in enumerate(c.token_ids)), abs=1e-3)


def test_sampled_tokens_outside_the_top_k_carry_their_true_rank(run, folders, knobs):
    c = run["sampled"][0].outputs[0]
    lp = hf_logprobs(folders[0], knobs["PROMPT_IDS"] + c.token_ids)[len(knobs["PROMPT_IDS"]) - 1:]
    ranks = []
    for t, (chosen, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert set(entry) == {chosen}  # logprobs=0: the sampled token only
        assert entry[chosen].logprob == pytest.approx(lp[t, chosen].item(), abs=1e-4)
        ranks.append(entry[chosen].rank)
        assert ranks[-1] == rank(lp[t], chosen)
    assert max(ranks) > 1  # the test means something: some draw was not the argmax


def test_prompt_logprobs_equal_hf_forward(run, folders, knobs):
    ids = knobs["PROMPT_IDS"]
    out = run["scored"][0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    lp = hf_logprobs(folders[0], ids)
    for i in range(1, len(ids)):
        entry, row = out.prompt_logprobs[i], lp[i - 1]
        assert set(entry) == {ids[i], *row.topk(2).indices.tolist()}
        for tid, v in entry.items():
            assert v.logprob == pytest.approx(row[tid].item(), abs=1e-4)
            assert v.rank == rank(row, tid)


def test_logprobs_minus_one_and_true_follow_vllm(run):
    everything = run["everything"][0].outputs[0].logprobs
    assert all(len(e) == run["llm"].vocab_size for e in everything)
    sure = run["sure"][0].outputs[0]
    assert all(len(e) == 1 and set(e) == {t} for e, t in zip(sure.logprobs, sure.token_ids))


def test_logit_bias_equals_hf_sequence_bias(run, folders, knobs):
    bias = {(t,): b for t, b in knobs["BIAS"].items()}
    expect = hf_generate(folders[0], knobs["PROMPT_IDS"], 8, sequence_bias=bias)
    assert tokens(run["biased"]) == expect != knobs["FREE"]


def test_allowed_token_ids_equal_hf_prefix_constraint(run, folders, knobs):
    allowed = knobs["ALLOWED"]
    expect = hf_generate(folders[0], knobs["PROMPT_IDS"], 8,
                         prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert tokens(run["allowed"]) == expect
    assert set(expect) <= set(allowed)


def test_bad_words_equal_hf_no_bad_words(run, folders, knobs, tok):
    """vLLM's rule: a word's ids and those of " word"; HF bans the same id sequences."""
    words = []
    for w in knobs["BAD_WORDS"]:
        plain, spaced = tok.encode(w, add_special_tokens=False), tok.encode(
            " " + w, add_special_tokens=False)
        words += [plain] + ([spaced] if len(spaced) == len(plain) and spaced != plain else [])
    expect = hf_generate(folders[0], knobs["PROMPT_IDS"], 8, bad_words_ids=words)
    assert tokens(run["no_bad_words"]) == expect != knobs["FREE"]


def test_logits_processors_run_on_each_step_in_order(run, folders, knobs):
    expect = hf_generate(folders[0], knobs["PROMPT_IDS"], 5,
                         bad_words_ids=[[knobs["FORBIDDEN"]]])
    got = tokens(run["processed"])
    assert got == expect and got[0] != knobs["FORBIDDEN"]
    assert [s for _, s in run["seen"]] == [got[:i] for i in range(len(got))]
    assert all(p == knobs["PROMPT_IDS"] for p, _ in run["seen"])


def test_detokenize_false_gives_ids_without_text(run, knobs):
    c = run["ids_only"][0].outputs[0]
    assert c.text == "" and c.token_ids == knobs["FREE"][:5]
    assert all(v.decoded_token is None for e in c.logprobs for v in e.values())


def test_truncate_prompt_tokens_keeps_the_last_ones(run, knobs):
    out = run["truncated"][0]
    assert out.prompt_token_ids == knobs["PROMPT_IDS"][-5:]
    assert tokens(run["truncated"]) == tokens(run["tail"])


def test_chat_equals_the_template_then_hf(run, folders, tok):
    conv = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    out = run["chat"][0]
    assert out.prompt_token_ids == list(ids) and out.prompt_token_ids[1] != out.prompt_token_ids[0]
    assert out.prompt == tok.apply_chat_template(conv, add_generation_prompt=True,
                                                 tokenize=False)
    assert tokens(run["chat"]) == hf_generate(folders[0], list(ids), 8)
    assert [o.prompt_token_ids for o in run["chats"]][0] == list(ids)
    assert len(run["chats"]) == 2
    cont = run["continued"][0].prompt
    assert cont.endswith("It is") and "<|assistant|>\nIt is" in cont
    templated = run["templated"][0].prompt
    assert templated.endswith("!") and "What is the capital of France?" in templated


def test_num_cached_tokens_reports_the_prefix_hit(run):
    bs = run["llm"].cache_config.block_size
    cold, warm = run["cold"][0], run["warm"][0]
    n = len(cold.prompt_token_ids)
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == (n - 1) // bs * bs > 0
    assert warm.num_cached_tokens == run["warm_stats"].prefix_hit_tokens
    assert run["reset"] is True and run["after_reset"][0].num_cached_tokens == 0
    assert tokens(run["warm"]) == tokens(run["cold"]) == tokens(run["after_reset"])


def test_beam_sequences_carry_hf_logprobs(run, folders, tok):
    out = run["beams"][0]
    prompt = tok("The weather today")["input_ids"]
    assert out.prompt_token_ids == prompt
    for s in out.sequences:
        assert s.tokens == prompt + s.token_ids and s.cum_logprob == s.cumulative_logprob
        lp = hf_logprobs(folders[0], prompt + s.token_ids)[len(prompt) - 1:]
        assert len(s.logprobs) == len(s.token_ids)
        for t, (tid, entry) in enumerate(zip(s.token_ids, s.logprobs)):
            assert entry[tid].logprob == pytest.approx(lp[t, tid].item(), abs=1e-4)
            assert entry[tid].rank == rank(lp[t], tid)
        assert sum(e[t].logprob for t, e in zip(s.token_ids, s.logprobs)) == pytest.approx(
            s.cumulative_logprob, abs=1e-4)


def test_pandas_series_of_prompts(run):
    pd = pytest.importorskip("pandas")
    texts = ["Sphinx of black quartz", "Dear friend, thank you"]
    out = run["llm"].generate(pd.Series(texts), SamplingParams(temperature=0, max_tokens=8),
                              use_tqdm=False)
    assert [tokens([o]) for o in out] == [tokens([o]) for o in run["from_list"]]


# ---- engine arguments and conventions --------------------------------------------------------
def test_a_tensor_parallel_size_that_is_no_rank_count_is_refused(folders):
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
            LLM(folders[0], tensor_parallel_size=bad)


def test_kv_cache_memory_and_its_vllm_name_are_exclusive(folders):
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLM(folders[0], kv_cache_memory=2**20, kv_cache_memory_bytes=2**20)


def test_a_model_object_is_generated_from_as_it_is(folders):
    # batchgen's extension (RL trainers): no copy; tests/test_shared_model.py covers it fully
    model = load_hf_model(folders[0])
    llm = LLM(model, tokenizer=str(folders[1]), num_kv_blocks=8)
    assert llm.model is model and model.config._attn_implementation == "eager"
    with pytest.raises(TypeError, match="save_pretrained"):  # a tokenizer is still a folder
        LLM(folders[0], tokenizer=model, num_kv_blocks=8)


def test_home_is_expanded(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(folders[0], tmp_path / "m")
    llm = LLM("~/m", tokenizer=str(folders[1]), num_kv_blocks=8)
    assert llm.model_path == tmp_path / "m"


def _fake_hub_cache(root: Path, repo_id: str, folder: Path) -> None:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)


def test_a_hub_id_resolves_through_the_local_cache(folders, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    _fake_hub_cache(tmp_path, "tiny-org/tiny-llama", folders[0])
    _fake_hub_cache(tmp_path, "tiny-org/tiny-tokenizer", folders[1])
    llm = LLM("tiny-org/tiny-llama", tokenizer="tiny-org/tiny-tokenizer", num_kv_blocks=8)
    assert llm.model_path.parent.parent.name == "models--tiny-org--tiny-llama"
    assert llm.get_tokenizer() is not None
    with pytest.raises(ValueError, match="hf download tiny-org/missing"):
        LLM("tiny-org/missing")
    _fake_hub_cache(tmp_path, "tinyllama", folders[0])  # an id without an org, as "gpt2" is
    bare = LLM("tinyllama", tokenizer="tiny-org/tiny-tokenizer", num_kv_blocks=8)
    assert bare.model_path.parent.parent.name == "models--tinyllama"
    with pytest.raises(ValueError, match="hf download missing-model"):
        LLM("missing-model")


LOGGING_SCRIPT = """
import logging, sys
if sys.argv[2] == "basicConfig":
    logging.basicConfig(level=logging.WARNING)
from batchgen import LLM
LLM(sys.argv[1], num_kv_blocks=8)
if sys.argv[2] == "after":
    logging.basicConfig()
    LLM(sys.argv[1], num_kv_blocks=8)
"""


@pytest.mark.parametrize("setup,env,expect", [
    ("none", {}, 1), ("basicConfig", {}, 1), ("after", {}, 2),
    ("none", {"BATCHGEN_LOG_LEVEL": "warning"}, 0)])
def test_the_capacity_line_prints_once_per_llm(folders, setup, env, expect):
    """Under logging.basicConfig (before or after the first LLM) each line prints once;
    BATCHGEN_LOG_LEVEL hides the start-up lines."""
    proc = subprocess.run(
        [sys.executable, "-c", LOGGING_SCRIPT, str(folders[0]), setup], capture_output=True,
        text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("KV cache:") == expect, proc.stderr
    if setup == "basicConfig":
        assert "INFO:batchgen:KV cache:" in proc.stderr and "[batchgen]" not in proc.stderr


def test_py_typed_ships():
    assert (ROOT / "batchgen" / "py.typed").is_file()
    assert '"batchgen" = ["py.typed", "vllm_api.json"]' in (ROOT / "pyproject.toml").read_text()

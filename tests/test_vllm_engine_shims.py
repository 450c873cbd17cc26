"""vllm_compat's shims of the vLLM engine objects scripts and vLLM's tests reach for:
`LogprobsProcessor._correct_decoded_token` (checked against the tokenizer's own decode of the
whole sequence), `InputProcessor._validate_params`, and beam search routed through
`LLM._render_and_run_requests` when that is replaced (checked against batchgen's in-engine
beam search, itself checked against HF's in tests/test_beam_search.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from batchgen import BeamSearchParams, SamplingParams
from batchgen.checks import ValidationError
from batchgen.token_texts import REPLACEMENT
from batchgen.tools.make_tiny_model import build_tokenizer
from batchgen.vllm_compat import CompatLLM
from batchgen.vllm_compat.engine_shims import InputProcessor, LogprobsProcessor

PROMPTS = [{"prompt_token_ids": [5, 17, 40, 9]}, {"prompt_token_ids": [6, 3, 43]}]


def _processor(tokenizer):
    return LogprobsProcessor(tokenizer=tokenizer, logprobs=[], prompt_logprobs=None,
                             cumulative_logprob=0.0, num_logprobs=1, num_prompt_logprobs=None)


def test_correct_decoded_token_joins_into_the_tokenizers_text():
    """Split multi-byte characters: each token's corrected text, given the tokens before it,
    joins into exactly what the tokenizer decodes for the whole sequence; a token that ends
    an unfinished character alone (no context) gives ""."""
    tok = build_tokenizer(300)
    text = "ab \u201cquoted\u201d \u2014 \u4f60\u597d \U0001f600!"
    ids = tok(text, add_special_tokens=False).input_ids
    proc = _processor(tok)
    pieces = []
    for i, t in enumerate(ids):
        alone = tok.decode([t])
        pieces.append(alone if not alone.endswith(REPLACEMENT)
                      else proc._correct_decoded_token(t, ids[:i]))
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any(p.endswith(REPLACEMENT) for p in pieces)
    split = next(t for t in ids if tok.decode([t]).endswith(REPLACEMENT))
    assert proc._correct_decoded_token(split, []) == ""


def test_correct_decoded_token_keeps_text_of_byte_fallback_context():
    """A context token that completed nothing itself (it ends in U+FFFD) hands its text to
    the token that completes the character: the space it carried is kept."""
    table = {(1385,): " term", (44,): " \ufffd", (1385, 44): " term \ufffd",
             (1385, 44, 48): " term \u201c", (44, 48): " \u201c"}
    proc = _processor(SimpleNamespace(decode=lambda ids: table.get(tuple(ids), "\ufffd")))
    assert proc._correct_decoded_token(44, [1385]) == ""
    assert proc._correct_decoded_token(48, [1385, 44]) == " \u201c"
    # alternatives at one position are corrected independently, against the same context
    assert proc._verify_tokens(["\ufffd", "ok"], [48, 7], [1385, 44]) == [" \u201c", "ok"]


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return CompatLLM(str(tiny_model_factory("llama", vocab_size=300, seed=44)),
                     max_model_len=64, num_kv_blocks=64, block_size=4, max_logprobs=8)


def test_validate_params_refuses_what_the_engine_cannot_run(llm):
    """The engine's input processor: max_logprobs and the vocabulary bound (batchgen's
    SamplingParams.verify), a model without a generation task, and prompt_logprob_token_ids
    under KV-sharing fast prefill, each a ValidationError naming the argument."""
    proc = llm.llm_engine.input_processor
    assert proc._validate_params(SamplingParams(logprobs=8), ("generate",)) is False
    with pytest.raises(ValidationError, match="logprobs") as err:
        proc._validate_params(SamplingParams(logprobs=9), ("generate",))
    assert err.value.parameter == "logprobs"
    with pytest.raises(ValidationError, match="does not support generation"):
        proc._validate_params(SamplingParams(), ("embed",))
    scored = SamplingParams(prompt_logprob_token_ids=[[1, 2]])
    assert proc._validate_params(scored, ("generate",)) is False
    fast = InputProcessor(proc.model_config, SimpleNamespace(
        cache_config=SimpleNamespace(kv_sharing_fast_prefill=True)), None)
    with pytest.raises(ValidationError, match="fast-prefill") as err:
        fast._validate_params(scored, ("generate",))
    assert err.value.parameter == "prompt_logprob_token_ids"


def _observe(llm, monkeypatch, abort_prompt=None, abort_step=None):
    """Replace llm._render_and_run_requests by a wrapper of the real one that records each
    step's batch and marks one prompt's results aborted at one step."""
    real, calls = llm._render_and_run_requests, []

    def run(prompts, **kw):
        prompts = list(prompts)
        calls.append([p["prompt_token_ids"][:3] for p in prompts])  # the prompt's head
        outs = real(prompts, **kw)
        if len(calls) - 1 == abort_step:
            head = PROMPTS[abort_prompt]["prompt_token_ids"]
            outs = [dataclasses.replace(o, outputs=[dataclasses.replace(
                o.outputs[0], token_ids=[], logprobs=None, finish_reason="abort")])
                if p["prompt_token_ids"][:len(head)] == head else o
                for p, o in zip(prompts, outs)]
        return outs

    monkeypatch.setattr(llm, "_render_and_run_requests", run)
    return calls


def test_beam_search_steps_through_a_replaced_render_and_run_requests(llm, monkeypatch):
    """With `_render_and_run_requests` wrapped (the real one underneath), beam search runs
    vLLM's loop through it: one call per token, every live beam in it (beam_width per
    prompt); without EOS its beams are the in-engine search's, same ids, same scores;
    concurrency_limit=1 shows the wrapper one prompt's beams at a time."""
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    native = llm.beam_search(PROMPTS, params, use_tqdm=False)
    calls = _observe(llm, monkeypatch)
    steps = llm.beam_search(PROMPTS, params)
    assert [len(c) for c in calls] == [2] + [6] * 4
    for a, b in zip(native, steps):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cumulative_logprob for s in a.sequences] == pytest.approx(
            [s.cum_logprob for s in b.sequences], abs=1e-4)
        assert all(len(s.logprobs) == 5 and s.finish_reason == "length" for s in b.sequences)
    calls.clear()
    again = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    assert [len(c) for c in calls] == [1, 3, 3, 3, 3] * 2
    assert all(len({tuple(p) for p in c}) == 1 for c in calls)
    assert [[s.tokens for s in o.sequences] for o in again] == \
        [[s.tokens for s in o.sequences] for o in steps]


def test_an_aborted_step_ends_its_prompt_and_the_others_go_on(llm, monkeypatch):
    """A prompt whose step comes back aborted returns its beams as they were before that
    step (finish_reason "abort"); the other prompt's beams are those of a full search."""
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    full = llm.beam_search(PROMPTS, params, use_tqdm=False)
    _observe(llm, monkeypatch, abort_prompt=0, abort_step=2)
    aborted, normal = llm.beam_search(PROMPTS, params)
    assert all(s.finish_reason == "abort" and len(s.token_ids) == 2 and len(s.logprobs) == 2
               for s in aborted.sequences)
    assert [s.tokens for s in normal.sequences] == [s.tokens for s in full[1].sequences]
    tok = llm.get_tokenizer()
    assert aborted.sequences[0].text == tok.decode(aborted.sequences[0].tokens,
                                                   skip_special_tokens=True)


def test_a_tensor_image_is_refused_as_embeddings_before_any_work(llm):
    """vLLM reads a torch.Tensor image as image embeddings (only with enable_mm_embeds):
    vllm_compat's LLM refuses it naming --enable-mm-embeds, before any request is queued;
    the same call with no tensor runs."""
    bad = [{"prompt_token_ids": [5, 6]},
           {"prompt": "<image>", "multi_modal_data": {"image": [torch.empty(1, 1, 1)]}}]
    with pytest.raises(ValidationError, match="--enable-mm-embeds") as err:
        llm.generate(bad, SamplingParams(max_tokens=1), use_tqdm=False)
    assert "prompts[1]" in str(err.value)
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    assert len(llm.generate(bad[:1], SamplingParams(max_tokens=1), use_tqdm=False)) == 1


def test_installed_stand_in_has_package_metadata():
    """While installed, importlib.metadata finds a `vllm` distribution at VERSION (what
    lm-eval's and TRL's version checks read); after uninstall it is gone again."""
    import importlib.metadata

    import batchgen.vllm_compat as compat

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    compat.install()
    try:
        assert importlib.metadata.version("vllm") == compat.VERSION
        assert importlib.metadata.metadata("vllm")["Name"] == "vllm"
    finally:
        compat.uninstall()
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")

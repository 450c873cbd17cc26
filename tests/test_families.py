"""The family matrix: every causal-LM family of the installed transformers (tests/families.py)
either equals HF greedy with chunked prefill on, or is refused from its config alone with one
ValueError naming the family, before any weights are read. A family the expectations (MATRIX)
do not know yet is judged the same way and reported (NewFamilyWarning, and a line in the
terminal summary); an expected family the installed transformers lacks is skipped. Plus the
per-layer facts (windows read right, K/V widths checked against the pool) and MLA models end
to end."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.attention.spec import check_pool_geometry, probe_specs
from batchgen.model import loader
from batchgen.model.families import check_served, classify
from tests.families import (
    ADDED_IN,
    MATRIX,
    NOT_SHRUNK,
    WINDOW,
    NewFamilyWarning,
    families,
    matrix_families,
    new_families,
    newer_than_installed,
    not_installed,
    save_family_config,
    save_family_model,
    tiny_config,
    transformers_version,
)
from tests.helpers import hf_greedy, load_hf_model, make_prompt_token_ids

MAX_TOKENS = 8
# prompts longer than the families' windows (WINDOW), in chunks of 16 tokens
PROMPTS = make_prompt_token_ids(3, 12, 30, vocab_size=512, seed=3)
LONGEST = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))


def _model_type(family: str) -> str:
    return tiny_config(family).get_text_config().model_type


def _batchgen_model(path):
    """The model at `path` with batchgen's attention (as LLM loads it)."""
    config = loader.load_config(path)
    return loader.load_model(path, config, torch.float32, torch.device("cpu"))


def _far_context_changed(prompt: list[int]) -> list[int]:
    """`prompt` with every token but BOS and the last WINDOW replaced by another id."""
    assert len(prompt) > 2 * WINDOW
    return prompt[:1] + [t + 1 if t < 500 else 3 for t in prompt[1:-WINDOW]] + prompt[-WINDOW:]


def _no_weights(*args, **kwargs):
    raise AssertionError("weights were loaded for a model that must be refused")


class _WouldLoadWeights(Exception):
    """Raised by a stand-in load_model: planning from the config let the model through."""


def _would_load(*args, **kwargs):
    raise _WouldLoadWeights


def config_verdict(family: str, path, monkeypatch) -> str:
    """"refused" when batchgen refuses `family` from its config alone (a folder of config.json
    and a weights file holding no tensor; load_model never runs) with one ValueError naming the
    family, "parity" when it would go on to load the weights. Any other error fails."""
    from safetensors.torch import save_file

    save_family_config(family, path)
    save_file({}, str(path / "model.safetensors"))  # headers read, not one weight in it
    model_type = _model_type(family)
    with monkeypatch.context() as m:
        m.setattr(loader, "load_model", _would_load)
        try:
            LLM(path)
        except _WouldLoadWeights:
            return "parity"
        except ValueError as e:
            assert f"model family '{model_type}' is not supported" in str(e), (
                f"{family}: refused from its config without naming the family: {e}")
            return "refused"
    raise AssertionError(f"{family}: LLM started without loading the weights")


def check_parity(family: str, path) -> None:
    """`family`'s tiny model: batchgen's greedy tokens (chunked prefill, 4-token blocks) equal
    HF's, and HF's change with the tokens outside the window (parity is not vacuous)."""
    save_family_model(family, path)
    want = hf_greedy(path, PROMPTS, MAX_TOKENS)
    assert hf_greedy(path, [_far_context_changed(PROMPTS[LONGEST])], MAX_TOKENS) != [
        want[LONGEST]], f"{family}: HF's output is blind to the context past the window"
    try:
        llm = LLM(path, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
                  max_num_seqs=4)
    except ValueError as e:
        if "is not supported" in str(e):
            raise AssertionError(f"{family}: refused only after its weights loaded: {e}") from e
        raise
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want, f"{family}: batchgen's greedy tokens differ from HF's: {got} != {want}"


def judge_family(family: str, tmp_path, monkeypatch, expected: str | None) -> str:
    """The matrix's verdict on `family`, "parity" or "refused", checked: refused from the
    config before any weight is read, or served and equal to HF greedy. `expected` (MATRIX's
    entry; None for a family it does not know yet) must be the verdict."""
    verdict = config_verdict(family, tmp_path / "config", monkeypatch)
    assert expected in (None, verdict), (
        f"{family}: expected {expected}, but batchgen "
        + ("refuses it from its config" if verdict == "refused"
           else "goes on to load its weights"))
    if verdict == "parity":
        check_parity(family, tmp_path / "model")
    return verdict


def report_new_family(family: str, outcome: str, request) -> None:
    """A family with no expectation, judged: a NewFamilyWarning and a line in the terminal
    summary (tests/conftest.py), so the expectations can be updated."""
    msg = (f"family matrix: {family!r} of transformers {transformers_version()} has no "
           f"expectation in tests/families.py; {outcome}")
    request.node.user_properties.append(("new_family", msg))
    warnings.warn(NewFamilyWarning(msg), stacklevel=2)


@pytest.mark.parametrize("family", matrix_families())
def test_family_equals_hf_greedy_or_is_refused_before_weights(family, tmp_path, monkeypatch,
                                                              request):
    """Each family is judged (judge_family) against its expectation; an expected family the
    installed transformers lacks is skipped; one without an expectation is judged all the
    same and reported (report_new_family), whatever the verdict."""
    absent = not_installed(family)
    if absent:
        pytest.skip(absent)
    if family in MATRIX:
        judge_family(family, tmp_path, monkeypatch, MATRIX[family])
        return
    try:
        tiny_config(family)
    except Exception as e:  # the family's config class wants what TINY does not give
        why = (f"not judged: tests/families.py cannot build its tiny config "
               f"({type(e).__name__}: {' '.join(str(e).split())}); give it a "
               "FAMILY_OVERRIDES entry")
        report_new_family(family, why, request)
        pytest.skip(f"{family}: {why}")
    verdict = "failed (a mismatch or a crash)"
    try:
        verdict = judge_family(family, tmp_path, monkeypatch, None)
    finally:
        report_new_family(family, f"judged: {verdict}", request)


def test_the_matrix_covers_every_family():
    """Every expectation is one of the two verdicts and names a family of the installed
    transformers, or one newer than it (ADDED_IN), never a left-out one: an expectation for a
    family transformers no longer has (or a misspelt one) fails. An installed family without
    an expectation does not fail here: the matrix judges it and reports it."""
    assert set(MATRIX.values()) == {"parity", "refused"}
    assert not set(MATRIX) & set(NOT_SHRUNK)
    stale = [f for f in sorted(set(MATRIX) - set(families())) if not newer_than_installed(f)]
    assert not stale, f"expectations for families transformers does not have: {stale}"
    assert all(f in MATRIX for f in ADDED_IN)
    if new_families():
        warnings.warn(NewFamilyWarning(
            f"family matrix: no expectation for {new_families()} (transformers "
            f"{transformers_version()}): judged by test_family_equals_hf_greedy_or_is_refused_"
            "before_weights"), stacklevel=1)


STAND_IN = "matrix_stand_in"


def _register_stand_in(monkeypatch, layer_window: int | None,
                       layer_type: str = "full_attention") -> None:
    """A family transformers does not have, seen by the matrix as installed and new: a Llama
    whose attention layers pass `layer_window` as their sliding window (what batchgen's
    attention reads) while HF's eager attention keeps its full causal mask, every layer of
    type `layer_type` by default. Undone with `monkeypatch`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )
    from transformers.models.llama.modeling_llama import LlamaAttention

    class StandInConfig(LlamaConfig):
        model_type = STAND_IN

        def __init__(self, **kw):
            kw.setdefault("layer_types", [layer_type] * kw.get("num_hidden_layers", 32))
            super().__init__(**kw)

    class StandInAttention(LlamaAttention):
        def forward(self, *args, **kwargs):
            if layer_window is not None:
                kwargs["sliding_window"] = layer_window
            return super().forward(*args, **kwargs)

    class StandInForCausalLM(LlamaForCausalLM):
        config_class = StandInConfig

        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                layer.self_attn.__class__ = StandInAttention

    monkeypatch.setitem(CONFIG_MAPPING._extra_content, STAND_IN, StandInConfig)
    monkeypatch.setitem(MODEL_FOR_CAUSAL_LM_MAPPING._extra_content, StandInConfig,
                        StandInForCausalLM)
    monkeypatch.setitem(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, STAND_IN, "StandInForCausalLM")


@pytest.mark.parametrize("layer_window, outcome", [(None, "judged: parity"),
                                                   (WINDOW // 2, "judged: failed")])
def test_a_new_family_is_judged_not_waved_through(layer_window, outcome, tmp_path,
                                                   monkeypatch, request):
    """The new-family path is no free pass: the matrix's test, run on a stand-in family whose
    layers tell batchgen a window HF does not apply, fails on the mismatch (and reports the
    family); the same stand-in without it is judged equal to HF."""
    _register_stand_in(monkeypatch, layer_window)
    assert STAND_IN in new_families() and STAND_IN in matrix_families()
    mismatch = (pytest.raises(AssertionError, match="batchgen's greedy tokens differ from HF's")
                if layer_window else contextlib.nullcontext())
    with pytest.warns(NewFamilyWarning, match=f"'{STAND_IN}' .*; {outcome}"), mismatch:
        test_family_equals_hf_greedy_or_is_refused_before_weights(
            STAND_IN, tmp_path, monkeypatch, request)
    assert [k for k, _ in request.node.user_properties] == ["new_family"]
    request.node.user_properties.clear()  # a stand-in, not a family to list in the summary


def test_a_new_family_refused_from_its_config_passes_and_is_reported(
        tmp_path, monkeypatch, request):
    """A new family batchgen refuses from its config (here chunked attention) passes without
    its weights ever loading, and is reported: a NewFamilyWarning and a terminal-summary
    line naming it."""
    _register_stand_in(monkeypatch, None, "chunked_attention")
    monkeypatch.setattr(loader, "load_model", _no_weights)
    with pytest.warns(NewFamilyWarning, match=f"'{STAND_IN}' .*; judged: refused"):
        test_family_equals_hf_greedy_or_is_refused_before_weights(
            STAND_IN, tmp_path, monkeypatch, request)
    assert [k for k, _ in request.node.user_properties] == ["new_family"]
    request.node.user_properties.clear()  # a stand-in, not a family to list in the summary
    # and an expectation the verdict contradicts fails
    with pytest.raises(AssertionError, match="expected parity, but batchgen refuses it"):
        judge_family(STAND_IN, tmp_path / "again", monkeypatch, "parity")


def test_hf_output_depends_on_context_past_the_window(tmp_path):
    """exaone4's full layers pass sliding_window=None: they see the whole prompt, so the
    greedy output changes when only tokens outside the window change (the parity above then
    says the full layers are read as full)."""
    path = save_family_model("exaone4", tmp_path)
    long = PROMPTS[LONGEST]
    assert hf_greedy(path, [long], MAX_TOKENS) != hf_greedy(path, [_far_context_changed(long)],
                                                            MAX_TOKENS)
    specs = probe_specs(_batchgen_model(path), 4, torch.device("cpu"))
    types = tiny_config("exaone4").layer_types
    assert [s.window for s in specs] == [WINDOW if t == "sliding_attention" else None
                                         for t in types]


def test_a_bad_mla_cache_mode_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_MLA_CACHE", "compressed")
    save_family_model("deepseek_v3", tmp_path)
    monkeypatch.setattr(loader, "load_model", _no_weights)
    with pytest.raises(ValueError, match=r"BATCHGEN_MLA_CACHE must be one of \['latent', "
                                         r"'decompressed'\], got 'compressed'"):
        LLM(tmp_path)


def test_classification_from_the_config_alone():
    ds = classify(tiny_config("deepseek_v3"))
    assert ds.attention_layouts == {"mla"} and ds.attention_layers == [0, 1, 2, 3]
    falcon = classify(tiny_config("falcon_h1"))
    assert all(c.attention == "standard" and c.mixer == "mamba" for c in falcon.layers)
    nemo = classify(tiny_config("nemotron_h"))
    assert [(c.attention, c.mixer) for c in nemo.layers] == [
        (None, "mamba"), (None, None), ("standard", None), (None, None)]
    qwen = classify(tiny_config("qwen3_next"))
    assert qwen.mixer_kinds == {"linear_attention"} and qwen.attention_layers == [3]
    assert classify(tiny_config("lfm3")).mixer_kinds == {"conv"}
    assert classify(tiny_config("minimax")).mixer_kinds == {"lightning_attention"}
    llama4 = classify(tiny_config("llama4_text"))
    assert llama4.layers[0].unsupported and llama4.layers[3].attention == "standard"


@pytest.mark.parametrize("family, kind", [
    ("rwkv", "'rwkv' state mixer"), ("recurrent_gemma", "'rg_lru' state mixer"),
    ("zamba2", "a transformer block shared between layers"),
    ("llama4_text", "'chunked_attention'"), ("bloom", "AttentionInterface"),
    ("bart", "encoder-decoder")])
def test_refusals_name_the_family_and_the_layer_kind(family, kind, tmp_path):
    save_family_config(family, tmp_path)
    with pytest.raises(ValueError) as e:
        LLM(tmp_path)
    assert f"model family '{_model_type(family)}'" in str(e.value) and kind in str(e.value)


def test_served_mixers_let_a_hybrid_through():
    layout = classify(tiny_config("qwen3_next"))
    with pytest.raises(ValueError, match="state mixers are not served yet"):
        check_served(layout, served=frozenset({"mamba"}))
    check_served(layout)  # batchgen/state/ serves it
    with pytest.raises(ValueError, match="no layer attends or mixes tokens"):
        check_served(classify(tiny_config("llama", num_hidden_layers=0)))


def test_a_layer_that_does_not_fit_the_pool_is_refused_before_the_first_step(
        tmp_path, monkeypatch):
    path = save_family_model("llama", tmp_path)
    real = loader.kv_geometry
    monkeypatch.setattr(loader, "kv_geometry",
                        lambda config, latent=None: real(config).__class__(4, 2, 8, 1024))
    with pytest.raises(ValueError, match="attention layer 0 passes 2 KV heads of keys 16 and "
                                         "values 16 wide, but the KV pool .* 2 heads of 8/8"):
        LLM(path, num_kv_blocks=16)
    spec = probe_specs(_batchgen_model(path), 4, torch.device("cpu"))
    check_pool_geometry(spec, 2, 16, 16)


def _hf_beams(path, prompt, width):
    model = load_hf_model(path)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                         num_return_sequences=width, max_new_tokens=MAX_TOKENS,
                         do_sample=False, output_scores=True, return_dict_in_generate=True,
                         eos_token_id=2, pad_token_id=0, early_stopping=False)
    seqs = [row[:row.index(2) + 1] if 2 in row else row
            for row in out.sequences[:, len(prompt):].tolist()]
    return seqs, out.sequences_scores.tolist()


# the pool's (KV heads, key width, value width, bytes per token) of the tiny MLA models: the
# latent (kv_lora_rank 32 + rope 8, one head; values its first 32) or decompressed (4 heads of
# 16 + 8 wide keys and 16 wide values); 4 layers, float32
MLA_POOLS = {"latent": (1, 40, 32, 4 * 40 * 4), "decompressed": (4, 24, 16, 4 * 4 * 40 * 4)}


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2"])
@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("mode", ["latent", "decompressed"])
def test_mla_models_equal_hf_greedy_and_beams(family, backend, mode, tmp_path, monkeypatch):
    """The latent cache and the decompressed one (K and V of different widths): greedy and
    beams equal HF with chunked prefill, prefix hits (a shared prompt head) and preemption."""
    monkeypatch.setenv("BATCHGEN_MLA_CACHE", mode)
    path = save_family_model(family, tmp_path)
    heads, k_width, v_width, beta = MLA_POOLS[mode]
    geo = loader.kv_geometry(tiny_config(family))
    assert (geo.num_kv_heads, geo.head_dim, geo.head_dim_v or geo.head_dim) == (
        heads, k_width, v_width)
    head = PROMPTS[2][:17]
    prompts = [head + p[1:9] for p in PROMPTS] + PROMPTS
    llm = LLM(path, block_size=4, num_kv_blocks=16, max_num_batched_tokens=16,
              max_num_seqs=6, attention_backend=backend)
    assert llm.cache.k_blocks[0].shape[-2:] == (heads, k_width)
    assert llm.cache.v_blocks[0].shape[-2:] == (heads, v_width)
    assert llm.cache.bytes_per_token == beta
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(path, prompts, MAX_TOKENS)
    stats = llm.kv_stats()
    assert stats.prefix_hit_tokens > 0 and stats.preemptions > 0
    beams = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                            BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
    for p, o in zip(PROMPTS, beams):
        seqs, scores = _hf_beams(str(path), p, 3)
        assert [s.token_ids for s in o.sequences] == seqs
        assert all(math.isclose(s.score, w, rel_tol=1e-5, abs_tol=1e-4)
                   for s, w in zip(o.sequences, scores))

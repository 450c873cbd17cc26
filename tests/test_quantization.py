"""Quantized checkpoints (batchgen/quantization): tiny random models quantized by each library's
own API and saved as real folders (tests/quant_models.py), loaded by batchgen through
transformers' quantizer for the method; the oracle is HF `generate` on the same folder loaded
by transformers itself. One LLM per method runs chunked prefill in a pool that preempts, n
greedy samples (each must equal HF greedy) and beams (HF beam search)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests import quant_models
from tests.helpers import make_prompt_token_ids, strip_after_eos

NEW = 8  # tokens generated per prompt
PROMPTS = make_prompt_token_ids(4, 3, 36, vocab_size=512, seed=41)


def _needs(*packages: str) -> list:
    """Marks skipping a case whose library is not installed."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return [pytest.mark.skip(reason=f"{', '.join(missing)} not installed")] if missing else []


# name → (how it is made from the tiny llama folder, what LLM gets instead of the folder)
CASES = {
    "ct-int8": ("compressed_tensors",),
    "ct-int4": ("compressed_tensors",),
    "ct-fp8": ("compressed_tensors",),
    "fp8-block-deepseek_v3": (),
    "bnb-8bit": ("bitsandbytes",),
    "bnb-4bit": ("bitsandbytes",),
    "torchao-int8": ("torchao",),
    "gguf-q8_0-folder": ("gguf",),
    "gguf-q4_0-file": ("gguf",),
    "mxfp4-gpt_oss": (),
    "gptq-int4": ("gptqmodel", "optimum"),  # gptqmodel is not in the CPU test set (docs)
    "awq-int4": ("gptqmodel", "optimum"),
}


def _build(name: str, sources: tuple, out: Path) -> tuple[Path, Path]:
    """(what LLM is given, the folder HF loads) for a case."""
    src, deepseek, _, gpt_oss = sources
    if name == "mxfp4-gpt_oss":
        return (quant_models.mxfp4_gpt_oss(gpt_oss, out),) * 2
    if name.startswith("ct-"):
        return (quant_models.compressed_tensors(src, out, name[3:]),) * 2
    if name == "fp8-block-deepseek_v3":
        return (quant_models.block_fp8(deepseek, out, (8, 8)),) * 2
    if name.startswith("bnb-"):
        return (quant_models.bitsandbytes(src, out, int(name[4])),) * 2
    if name.endswith("-int4"):
        return (quant_models.int4_checkpoint(src, out, name.split("-")[0]),) * 2
    if name == "torchao-int8":
        return (quant_models.torchao_int8(src, out),) * 2
    qtype = name.split("-")[1].upper()
    folder = quant_models.gguf_folder(src, out, qtype)
    gguf = next(folder.glob("*.gguf"))
    return (gguf if name.endswith("file") else folder), folder


@pytest.fixture(scope="module")
def sources(tiny_model_factory, tmp_path_factory):
    from tests.families import save_family_model

    src = tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST)
    deepseek = save_family_model("deepseek_v3", tmp_path_factory.mktemp("ds") / "bf16",
                                 vocab_size=512)
    gpt_oss = tiny_model_factory("gpt_oss", eos_boost=RECOMMENDED_EOS_BOOST)
    return src, deepseek, tmp_path_factory.mktemp("quantized"), gpt_oss


def _hf(folder: Path):
    """The same checkpoint loaded by transformers alone (its quantizer), on the CPU."""
    from transformers import AutoModelForCausalLM

    gguf = sorted(folder.glob("*.gguf"))
    kw = {"gguf_file": gguf[0].name} if gguf else {}
    if folder.name.startswith("mxfp4"):
        from transformers import Mxfp4Config  # its CPU kernel comes from the hub: dequantized

        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", **kw).eval()


@torch.no_grad()
def _hf_runs(model, prompt: list[int], beams: int) -> list[list[int]]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         num_beams=beams, num_return_sequences=beams, do_sample=False,
                         length_penalty=1.0, early_stopping=False, eos_token_id=2,
                         pad_token_id=0)
    return [strip_after_eos(row[len(prompt):].tolist()) for row in out]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_needs(*p)) for n, p in CASES.items()])
def test_quantized_checkpoint_equals_hf(sources, name):
    src, root = sources[0], sources[2]
    given, folder = _build(name, sources, root / name)
    tok = {"tokenizer": src} if given.suffix == ".gguf" else {}
    llm = LLM(given, block_size=4, num_kv_blocks=12, max_num_batched_tokens=16,
              max_num_seqs=4, **tok)
    assert llm.quantization is not None and llm.quantization.method == _method(name)
    hf = _hf(folder)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(n=2, temperature=0, max_tokens=NEW), use_tqdm=False)
    assert llm.kv_stats().preemptions > 0  # a pool of 48 tokens cannot hold them all
    for p, o in zip(PROMPTS, outs):
        want = _hf_runs(hf, p, 1)[0]
        assert [c.token_ids for c in o.outputs] == [want, want], (name, len(p))
    beams = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                            BeamSearchParams(beam_width=2, max_tokens=NEW), use_tqdm=False)
    for p, o in zip(PROMPTS[:2], beams):
        assert [s.token_ids for s in o.sequences] == _hf_runs(hf, p, 2), (name, len(p))


def _method(case: str) -> str:
    prefix = case.split("-")[0]
    return {"ct": "compressed-tensors", "bnb": "bitsandbytes", "torchao": "torchao",
            "gguf": "gguf", "fp8": "fp8", "mxfp4": "mxfp4", "gptq": "gptq", "awq": "awq"}[prefix]


# ---- refusals: before any weight is read ------------------------------------------------------
def _poison_weights(folder: Path) -> None:
    """Make every weight file unreadable past its header: a refusal that read weights fails."""
    for f in folder.glob("*.safetensors"):
        data = f.read_bytes()
        f.write_bytes(data[: 8 + int.from_bytes(data[:8], "little")])


@pytest.fixture(scope="module")
def ct_folder(sources, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    return quant_models.compressed_tensors(sources[0], tmp_path_factory.mktemp("ct") / "m",
                                           "int8")


@pytest.mark.parametrize(("asked", "match"), [
    ("awq", "quantization='awq' disagrees with the checkpoint, which is quantized with "
            "'compressed-tensors'"),
    ("hqq", r"quantization must be one of \(None, 'fp8', 'compressed-tensors'"),
    ("fp8", "quantization='fp8' disagrees"),
])
def test_wrong_names_are_refused_before_weights(ct_folder, tmp_path, asked, match):
    import shutil

    poisoned = shutil.copytree(ct_folder, tmp_path / "m")
    _poison_weights(poisoned)
    with pytest.raises(ValueError, match=match):
        LLM(poisoned, quantization=asked, num_kv_blocks=8)


def test_matching_and_alias_names_load(ct_folder):
    assert LLM(ct_folder, quantization="compressed-tensors",
               num_kv_blocks=8).quantization.method == "compressed-tensors"


@pytest.mark.parametrize(("asked", "match"), [
    ("fp8", r"'fp8' cannot run on cpu: .*compute capability >= 8\.9"),
    ("modelopt_fp4", r"'modelopt_fp4' cannot run on cpu: NVFP4 .*>= 10\.0"),
    ("gptq", "needs a checkpoint quantized with it"),
    ("gguf", "needs a checkpoint quantized with it"),
])
def test_online_methods_that_cannot_run_here_are_refused(sources, tmp_path, asked, match):
    import shutil

    folder = shutil.copytree(sources[0], tmp_path / "m")
    _poison_weights(folder)
    with pytest.raises(ValueError, match=match):
        LLM(folder, quantization=asked, num_kv_blocks=8)
    if asked == "fp8":  # and quantized weights under tensor parallelism, from the config
        with pytest.raises(ValueError, match="'torchao' with tensor_parallel_size=2: .*not "
                                             "verified under tensor parallelism"):
            LLM(folder, quantization="torchao", tensor_parallel_size=2, num_kv_blocks=8)


def test_an_unserved_checkpoint_method_is_refused(sources, tmp_path):
    import shutil

    folder = shutil.copytree(sources[0], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "hqq"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized with 'hqq', which batchgen does not serve"):
        LLM(folder, num_kv_blocks=8)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_online_torchao_int8_equals_hf(sources):
    """quantization='torchao' on a full-precision folder: int8 weight-only at load, as HF's
    own TorchAoConfig(Int8WeightOnlyConfig()) gives."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    src = sources[0]
    llm = LLM(src, quantization="torchao", num_kv_blocks=64, block_size=4)
    assert llm.quantization.online
    hf = AutoModelForCausalLM.from_pretrained(
        src, device_map="cpu", quantization_config=TorchAoConfig(Int8WeightOnlyConfig())).eval()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_runs(hf, p, 1)[0] for p in PROMPTS]


def test_a_folder_with_two_gguf_files_is_refused(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        LLM(tmp_path, num_kv_blocks=8)


# ---- memory truth -------------------------------------------------------------------------------
def test_kv_plan_reads_the_quantization_and_the_packed_weights(ct_folder, sources):
    from batchgen.kv_plan import plan_kv
    from batchgen.model.loader import load_config
    from batchgen.quantization import checkpoint_bytes

    plans = {}
    for name, folder in (("full", sources[0]), ("ct", ct_folder)):
        plans[name] = plan_kv(load_config(folder), block_size=4, device_memory=2**20,
                              weight_bytes=checkpoint_bytes(folder))
    full, ct = plans["full"], plans["ct"]
    assert full.quantization is None and ct.quantization == "compressed-tensors"
    assert ct.weight_bytes < 0.7 * full.weight_bytes  # int8 projections beside fp32 embeddings
    assert ct.num_tokens > full.num_tokens  # what the smaller weights leave goes to KV
    llm = LLM(ct_folder, block_size=4, kv_cache_memory=ct.memory_bytes)
    assert llm.cache_config.capacity_line(llm.max_model_len) == ct.capacity_line()
    assert ct.capacity_line().endswith("; weights quantized: compressed-tensors")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                    reason="bitsandbytes not installed")
def test_loaded_weight_bytes_are_the_packed_ones(sources, caplog):
    from batchgen.quantization import weight_bytes

    full = LLM(sources[0], num_kv_blocks=8)
    with caplog.at_level("INFO", logger="batchgen"):
        nf4 = LLM(sources[0], quantization="bitsandbytes", num_kv_blocks=8)
    assert nf4.quantization.online and nf4.quantization.method == "bitsandbytes"
    # 4-bit projections (a byte per two weights, absmax per 64) beside fp32 embeddings and head
    assert weight_bytes(nf4.model) < 0.6 * weight_bytes(full.model)
    line = f"weights: {weight_bytes(nf4.model) / 2**20:.1f} MiB as loaded (bitsandbytes"
    assert any(line in r.getMessage() for r in caplog.records)


# ---- an fp8 KV pool with the checkpoint's k/v scales -------------------------------------------
def _fp8_rounded(scales: dict[int, tuple[float, float]]):
    """HF's SDPA attention over K/V stored as fp8 with per-layer scales (K / k_scale,
    saturated, cast; read back times k_scale), as an fp8 pool holds them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def r(x, s):
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s)

    def attend(module, query, key, value, attention_mask, **kw):
        k, v = scales[module.layer_idx]
        return sdpa_attention_forward(module, query, r(key, k), r(value, v), attention_mask,
                                      **kw)
    return attend


@pytest.fixture(scope="module")
def kv_folder(sources, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    return quant_models.compressed_tensors(sources[0], tmp_path_factory.mktemp("kv") / "m",
                                           "int8", kv_scales=True)


def _prefill_logits(llm, prompts):
    """batchgen's logits for every prompt token, prompts packed in one step."""
    from batchgen.attention.interface import StepContext
    from batchgen.attention.metadata import SeqChunk, StepRows

    runner, bm = llm.engine.runner, llm.engine.kv.block_manager
    chunks = []
    for i, p in enumerate(prompts):
        bm.allocate(("p", i), len(p))
        chunks.append(SeqChunk(p, bm.table(("p", i)), 0, 1))
    step = runner.inputs.prepare(StepRows.from_chunks(chunks))
    runner.backend.plan(step.meta)
    with torch.inference_mode():
        got = runner.model(input_ids=step.input_ids[None], position_ids=step.positions[None],
                           use_cache=False, batchgen_step=StepContext(
                               runner.cache, runner.backend, step.slot_mapping)).logits[0]
    qo = step.meta.qo_indptr.tolist()
    return [got[qo[i]:qo[i + 1]] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["cpu_kernel", "torch"])
def test_fp8_pool_uses_the_checkpoint_scales(kv_folder, backend):
    from transformers import AttentionInterface, AutoModelForCausalLM

    from batchgen.quantization import checkpoint_kv_scales

    llm = LLM(kv_folder, kv_cache_dtype="fp8", block_size=4, num_kv_blocks=64,
              attention_backend=backend)
    scales = checkpoint_kv_scales(kv_folder, 2)
    assert llm.cache.k_scales == list(scales.k) and llm.cache.v_scales == list(scales.v)
    assert all(s != 1.0 for s in scales.k + scales.v)
    prompts = sorted(PROMPTS, key=len)  # the step's row order
    got = _prefill_logits(llm, prompts)
    for name, layers in (("scaled", dict(enumerate(zip(scales.k, scales.v)))),
                         ("unscaled", {0: (1.0, 1.0), 1: (1.0, 1.0)})):
        AttentionInterface.register(f"fp8_{name}", _fp8_rounded(layers))
        ref = AutoModelForCausalLM.from_pretrained(kv_folder, device_map="cpu",
                                                   attn_implementation=f"fp8_{name}").eval()
        with torch.no_grad():
            diffs = [float((g - ref(input_ids=torch.tensor([p])).logits[0]).abs().max())
                     for g, p in zip(got, prompts)]
        if name == "scaled":  # equal to HF with the checkpoint's scales (decode steps too) ...
            assert max(diffs) < 2e-5, diffs
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == [_hf_runs(ref, p, 1)[0]
                                                              for p in PROMPTS]
        else:  # ... and not to HF with scales left at 1.0 (the test can fail)
            assert max(diffs) > 1e-3, diffs


def test_fp8_pool_without_scales_warns_and_doubles_capacity(sources, caplog):
    with caplog.at_level("WARNING", logger="batchgen"):
        fp8 = LLM(sources[0], kv_cache_dtype="fp8", kv_cache_memory=2**16)
    assert fp8.cache.k_scales == [1.0, 1.0]
    assert sum("has no k/v scales" in r.getMessage() for r in caplog.records) == 1
    bf16 = LLM(sources[0], kv_cache_dtype="bfloat16", kv_cache_memory=2**16)
    assert fp8.kv_stats().num_blocks == 2 * bf16.kv_stats().num_blocks


def test_a_loaded_model_is_not_quantized_online(sources):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sources[0])
    with pytest.raises(ValueError, match="a loaded model is used as it is"):
        LLM(model, quantization="torchao", num_kv_blocks=8)


def test_kv_plan_reads_a_gguf_file(sources, capsys):
    """`batchgen kv-plan --model x.gguf`: the file's config, its weights as loaded (dequantized:
    every tensor's elements x the model dtype), and the capacity LLM logs for the same file."""
    pytest.importorskip("gguf")
    from batchgen.cli import main
    from batchgen.quantization import weight_bytes

    src, root = sources[0], sources[2]
    folder = quant_models.gguf_folder(src, root / "kvplan-gguf", "Q8_0")
    file = next(folder.glob("*.gguf"))
    assert main(["kv-plan", "--model", str(file), "--block-size", "4",
                 "--device-memory", "64MiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    llm = LLM(file, tokenizer=src, block_size=4, kv_cache_memory=plan["memory_bytes"])
    # fp32 as loaded, not the file's bytes (LLM also counts the rotary buffers)
    assert plan["weight_bytes"] == pytest.approx(weight_bytes(llm.model), rel=1e-3)
    assert plan["weight_bytes"] > file.stat().st_size
    assert llm.cache_config.capacity_line(llm.max_model_len) == plan["capacity_line"]
    assert main(["kv-plan", "--model", str(file)]) == 0
    assert "as loaded: dequantized from the" in capsys.readouterr().out

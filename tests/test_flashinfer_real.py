"""batchgen's FlashInfer backend driven through the installed FlashInfer's own wrapper code on
the CPU, its kernels replaced by recorders (tests/flashinfer_recorder.py): every value we pass
(sinks, scales, window, soft-cap, sm_scale) must reach a kernel binding, the plans get the
tensors FlashInfer expects, a machine that cannot build the kernels falls back with one line,
and the stand-in (tests/flashinfer_standin.py) keeps FlashInfer's signatures. This checks our
use of FlashInfer's API, not its kernels: only scripts/gpu_check.sh on a GPU can."""

from __future__ import annotations

import inspect
import logging
from functools import partial
from importlib import metadata

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.attention import flashinfer_backend, registry
from batchgen.attention.backend import BackendUnavailable, KernelBuildFailed
from batchgen.attention.flashinfer_backend import FlashInferBackend
from batchgen.attention.metadata import StepMetadata
from batchgen.attention.spec import AttentionSpec
from batchgen.kv import KVCache
from tests import flashinfer_standin
from tests.flashinfer_recorder import reaches, real_flashinfer

HQ, HKV, D, PAGE = 4, 2, 64, 16
SCALE, K_SCALE, V_SCALE = 0.37, 2.0, 0.5  # distinctive, so a match is no accident
NO_NVCC = RuntimeError("Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't "
                       "exist")


@pytest.fixture
def fi(monkeypatch):
    with real_flashinfer(monkeypatch) as (module, recorder):
        yield module, recorder


def _spec(window=None, softcap=None, sinks=False, seed=0):
    s = torch.Generator().manual_seed(seed)
    return AttentionSpec(HQ, HKV, D, D, SCALE, window, softcap, torch.bfloat16,
                         torch.randn(HQ, generator=s).bfloat16() if sinks else None)


CASES = {  # layers as the families have them
    "llama": [_spec(), _spec()],
    "gemma2": [_spec(window=24, softcap=30.0), _spec(softcap=30.0)],
    "gpt_oss": [_spec(window=24, sinks=True), _spec(sinks=True, seed=1)],
    "fp8": [_spec()],
}


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def _steps(scratch):
    """A prefill step (5 new tokens; 3 after 16 cached), a decode step, and a decode step
    padded to a captured batch of 4 with two scratch rows."""
    pages = dict(kv_indptr=_i32([0, 1, 3]), kv_indices=_i32([3, 4, 5]),
                 kv_last_page_len=_i32([5, 3]), block_size=PAGE)
    padded = dict(kv_indptr=_i32([0, 1, 3, 4, 5]), kv_indices=_i32([3, 4, 5, scratch, scratch]),
                  kv_last_page_len=_i32([5, 3, 1, 1]), block_size=PAGE)
    return [("prefill", StepMetadata(_i32([0, 5, 8]), **pages), None),
            ("decode", StepMetadata(_i32([0, 1, 2]), **pages), None),
            ("graph", StepMetadata(_i32([0, 1, 2, 3, 4]), **padded), 4)]


def _backend(fi_module, specs, kv_dtype=torch.bfloat16):
    cache = KVCache(len(specs), 8, PAGE, HKV, D, kv_dtype, "cpu")
    cache.k_scales = [K_SCALE] * len(specs)
    cache.v_scales = [V_SCALE] * len(specs)
    return FlashInferBackend(specs, cache, 64, fi=fi_module)


def _check_run(backend, recorder, layer, step):
    """One layer's run: its kernel call gets the sinks (sink layers), sm_scale with k_scale
    folded in, the soft-cap and window; v_scale is applied to the output."""
    spec = backend.specs[layer]
    q = torch.randn(int(step.qo_indptr[-1]), HQ, D).bfloat16()
    recorder.out = backend.out
    out = backend.run(layer, q)
    call = recorder.last("run")
    want = {"sm_scale * k_scale": SCALE * K_SCALE}
    if spec.sinks is not None:
        want["sinks"] = backend.sinks[layer]
        assert backend.sinks[layer].dtype == torch.float32 and backend.sinks[layer].shape == (HQ,)
    if spec.softcap:
        want["soft-cap"] = spec.softcap
    if spec.window:
        want["window_left"] = spec.window - 1
    missing = [name for name, value in want.items() if not reaches(call, value)]
    assert not missing, f"{missing} never reach the kernel ({call.module}.{call.fn})"
    assert torch.all(out == V_SCALE), "v_scale was not applied to the output"


def _check_plan(recorder, step):
    """The plan binding got int32 index tensors only, the planned batch's host indptrs."""
    call = recorder.last("plan")
    ints = [a for a in call.args if torch.is_tensor(a) and not a.is_floating_point()
            and a.dtype != torch.uint8]
    assert ints and all(a.dtype == torch.int32 for a in ints)
    assert any(torch.equal(a, step.kv_indptr) for a in ints)
    assert step.qo_indptr.device.type == step.kv_indptr.device.type == "cpu"


@pytest.mark.parametrize("case", list(CASES))
def test_every_value_we_pass_reaches_flashinfers_kernels(fi, case):
    fi_module, recorder = fi
    specs = CASES[case]
    kv_dtype = torch.float8_e4m3fn if case == "fp8" else torch.bfloat16
    if case == "gpt_oss" and not hasattr(fi_module, "BatchDecodeWithAttentionSinkWrapper"):
        with pytest.raises(BackendUnavailable, match="no attention-sink decode wrapper"):
            _backend(fi_module, specs, kv_dtype)  # before 0.7.4: refused, never wrong
        return
    backend = _backend(fi_module, specs, kv_dtype)
    built = {c.module for c in recorder.calls}
    assert built, "no kernel module was built when the backend was made"
    backend.reserve_graph_buffers(4, 16)
    for kind, step, graph_size in _steps(backend.cache.scratch_block):
        if graph_size:
            backend.graph_plan(step, graph_size)
        else:
            backend.plan(step)
        for layer in range(len(specs)):
            _check_run(backend, recorder, layer, step)
            _check_plan(recorder, step)
        sink_kernels = {c.module for c in recorder.calls[-2 * len(specs):]}
        assert all(("sink" in m) == (specs[0].sinks is not None) for m in sink_kernels), kind
    assert {c.module for c in recorder.calls} == built, "a kernel module was built mid-run"


def test_the_check_fails_when_a_value_is_dropped(fi):
    """The plain fa2 prefill wrapper takes `sinks=` and never hands it to its kernel: the
    check above catches exactly that."""
    fi_module, recorder = fi
    w = fi_module.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8),
                                                      "NHD", backend="fa2")
    w.plan(_i32([0, 5]), _i32([0, 1]), _i32([3]), _i32([5]), HQ, HKV, D, PAGE, causal=True,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=SCALE)
    pool = torch.zeros(2, 8, PAGE, HKV, D, dtype=torch.bfloat16)
    sinks = torch.ones(HQ)
    w.run(torch.zeros(5, HQ, D, dtype=torch.bfloat16), (pool[0], pool[1]), sinks=sinks)
    call = recorder.last("run")
    assert reaches(call, SCALE) and not reaches(call, sinks)


def test_kernels_that_cannot_be_built_are_a_clear_refusal(fi):
    fi_module, recorder = fi
    recorder.fail = NO_NVCC
    with pytest.raises(KernelBuildFailed, match="nvcc.*install one, or pass "
                                                "attention_backend='torch'"):
        _backend(fi_module, CASES["llama"])


@pytest.fixture
def flashinfer_on_cpu(fi, monkeypatch):
    """The registry's "flashinfer" entry on the CPU, loading the real (recorded) module."""
    fi_module, recorder = fi
    entry = registry.BackendEntry("flashinfer", ("cpu",), flashinfer_backend.Q_DTYPES,
                                  flashinfer_backend.KV_DTYPES, flashinfer_backend.HEAD_DIMS,
                                  lambda: partial(FlashInferBackend, fi=fi_module))
    monkeypatch.setitem(registry.BACKENDS, "flashinfer", entry)
    return recorder


def test_a_machine_without_nvcc_falls_back_with_one_line(flashinfer_on_cpu, tiny_model_factory,
                                                         caplog):
    """What a CUDA machine without a toolkit sees: the default falls back to the next
    backend with one warning naming the cause and the fix; asking for flashinfer refuses."""
    flashinfer_on_cpu.fail = NO_NVCC
    path = tiny_model_factory("llama", head_dim=64)
    kw = dict(dtype="bfloat16", num_kv_blocks=64, block_size=16)
    with caplog.at_level(logging.INFO, logger="batchgen"):
        llm = LLM(path, **kw)
    assert llm.attention_backend != "flashinfer"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    line = warnings[0].getMessage()
    assert "Could not find nvcc" in line and "attention_backend='torch'" in line
    assert "\n" not in line
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="attention_backend='flashinfer' cannot run this "
                                         "model: FlashInfer's attention kernels could not"):
        LLM(path, attention_backend="flashinfer", **kw)


# ---- the stand-in keeps FlashInfer's signatures ---------------------------------------------
WRAPPERS = ["BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper",
            "BatchAttentionWithAttentionSinkWrapper", "BatchDecodeWithAttentionSinkWrapper"]


def _accepted(cls, method):
    """The parameters a real method accepts: its own, and where it forwards **kwargs, those
    of what it forwards to (decode's `plan` goes to `_plan_impl`, a subclass to its parent)."""
    fn = getattr(cls, method)
    params = dict(inspect.signature(fn).parameters)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        target = "_plan_impl" if method == "plan" and hasattr(cls, "_plan_impl") else method
        parent = cls if target != method else cls.__mro__[1]
        for name, p in _accepted(parent, target).items():
            params.setdefault(name, p)
    return params


@pytest.mark.parametrize("name", WRAPPERS)
@pytest.mark.parametrize("method", ["__init__", "plan", "run"])
def test_the_standins_signatures_are_flashinfers(fi, name, method):
    """Every stand-in parameter exists in the real method with the same default; its
    positional parameters come in the real order; nothing the real one requires is missing."""
    if not hasattr(fi[0], name):
        pytest.skip(f"flashinfer {fi[0].__version__} has no {name} (batchgen refuses sinks there)")
    real = _accepted(getattr(fi[0], name), method)
    ours = inspect.signature(getattr(getattr(flashinfer_standin, name), method)).parameters
    real_pos = [n for n, p in real.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    our_pos = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in real.values())
    extra_pos = our_pos[len(real_pos):]
    assert our_pos[:len(real_pos)] == real_pos[:len(our_pos)], (our_pos, real_pos)
    assert not extra_pos or varargs, f"{extra_pos} have no place in the real signature"
    for n, p in ours.items():
        if n in extra_pos:
            continue  # taken by the real *args (the sink wrappers' sinks, sm_scale)
        assert n in real, f"{name}.{method} has no parameter {n!r}"
        if p.default is not p.empty and real[n].default is not p.empty:
            assert p.default == real[n].default, (n, p.default, real[n].default)
    required = [n for n, p in real.items() if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    assert set(required) <= set(ours), set(required) - set(ours)


def test_the_test_install_brings_no_cuda_wheel():
    """flashinfer-python goes into the test venv without its dependencies: no CUDA runtime,
    cuDNN or CUTLASS wheels (a CPU install stays lean)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may have CUDA wheels of its own")
    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    cuda = sorted(n for n in names if n.startswith(("nvidia-cuda", "nvidia-cudnn",
                                                    "nvidia-cublas", "nvidia-cutlass",
                                                    "cuda-python", "cuda-tile", "nccl")))
    assert not cuda, cuda


def test_the_gpu_warmup_builds_one_distinct_module_per_variant(fi):
    """scripts/gpu_warmup.py's variants go through FlashInfer's wrapper code (our backends'
    constructors) and each asks for a kernel module of its own: none is a duplicate, so the
    parallel warm-up covers as many modules as it runs processes for."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_warmup.py"
    spec = importlib.util.spec_from_file_location("gpu_warmup", path)
    warmup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(warmup)
    _, recorder = fi
    modules = []
    for variant in warmup.VARIANTS:
        seen = len(recorder.calls)
        warmup.build(variant, device="cpu")
        modules.append({c.module for c in recorder.calls[seen:]})
    assert all(len(m) == 1 for m in modules), modules
    assert len(set().union(*modules)) == len(warmup.VARIANTS)


def test_a_step_with_bidirectional_images_hands_flashinfer_its_custom_mask(fi):
    """Gemma 3's image spans: the prefill plan gets the step's custom mask (causal, widened
    to the whole image for queries inside it; FlashInfer's own window stays on top), packed
    by FlashInfer's segment_packbits per sequence; a step without images plans causal."""
    fi_module, recorder = fi
    backend = _backend(fi_module, [_spec(window=24), _spec()])
    pages = dict(kv_indptr=_i32([0, 1, 3]), kv_indices=_i32([3, 4, 5]),
                 kv_last_page_len=_i32([5, 3]), block_size=PAGE)
    step = StepMetadata(_i32([0, 5, 8]), **pages, spans={1: [(PAGE - 2, PAGE + 3)]})
    mask = step.span_mask()
    q1 = torch.arange(PAGE, PAGE + 3)[:, None]  # the second sequence's queries
    k1 = torch.arange(PAGE + 3)[None, :]
    widened = (k1 <= q1) | (k1 >= PAGE - 2)
    assert torch.equal(mask[25:], widened.reshape(-1)) and mask[:25].sum() == 15  # causal 5x5
    backend.plan(step)
    backend.run(0, torch.randn(8, HQ, D).bfloat16())
    packed = recorder.last("segment_packbits")
    assert torch.equal(packed.args[0], mask), "the custom mask never reached FlashInfer"
    assert packed.args[1].tolist() == [0, 25, 25 + 3 * (PAGE + 3)]  # bits per sequence
    calls = len(recorder.calls)
    backend.plan(StepMetadata(_i32([0, 5, 8]), **pages))
    backend.run(0, torch.randn(8, HQ, D).bfloat16())
    assert not [c for c in recorder.calls[calls:] if "packbits" in c.fn]

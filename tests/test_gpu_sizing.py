"""Sizing the GPU pool: the budget arithmetic, the memory kept for the attention backend and
CUDA graphs (and that LLM sizing passes it on), and the profiling forward it measures (run here
on the CPU, where it must equal HF's own forward since it attends causally over the tokens)."""

import pytest
import torch

from batchgen.attention import flashinfer_backend, registry
from batchgen.attention.spec import AttentionSpec
from batchgen.config import EngineConfig, pool_blocks
from batchgen.model.cuda_graphs import GRAPH_POOL_BYTES, capture_sizes
from batchgen.model.profile import ProfileContext, gpu_kv_budget
from tests.helpers import load_hf_model

GiB = 1 << 30
MiB = 1 << 20


def _spec(window=None, sinks=False, heads=64, head_dim=64):
    return AttentionSpec(heads, 8, head_dim, head_dim, head_dim ** -0.5, window, None,
                         torch.bfloat16, torch.zeros(heads) if sinks else None)


def test_budget_is_utilization_minus_weights_activations_and_memory_outside_torch():
    # 80 GiB card, 2 GiB used by another process and the CUDA context, torch holds 16 GiB of
    # weights (reserved 17), the largest step peaks 3 GiB, FlashInfer will take 0.5 GiB
    budget = gpu_kv_budget(total=80 * GiB, free=80 * GiB - 19 * GiB, allocated=16 * GiB,
                           reserved=17 * GiB, activation_peak=3 * GiB, utilization=0.9,
                           other=GiB // 2)
    assert budget == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB - 2 * GiB - GiB // 2


def test_a_colocated_trainers_memory_is_not_counted_as_batchgens_own():
    # the same card, but 30 GiB of the 46 GiB torch holds belonged to a trainer before batchgen
    # loaded its 16 GiB: utilization is batchgen's share (vLLM's meaning), capped by what is free
    kw = dict(total=80 * GiB, reserved=47 * GiB, activation_peak=3 * GiB, other=GiB // 2)
    budget = gpu_kv_budget(free=80 * GiB - 49 * GiB, allocated=46 * GiB, utilization=0.3,
                           foreign=30 * GiB, **kw)
    assert budget == int(80 * GiB * 0.3) - 16 * GiB - 3 * GiB - 2 * GiB - GiB // 2
    capped = gpu_kv_budget(free=80 * GiB - 49 * GiB, allocated=46 * GiB, utilization=0.9,
                           foreign=30 * GiB, **kw)
    assert capped == (31 * GiB + GiB) - 3 * GiB - GiB // 2  # free + cached-unused, less the rest
    assert gpu_kv_budget(free=80 * GiB - 49 * GiB, allocated=46 * GiB, utilization=0.9, **kw) \
        == int(80 * GiB * 0.9) - 46 * GiB - 3 * GiB - 2 * GiB - GiB // 2  # no trainer: as before


def test_a_pool_that_cannot_hold_one_sequence_says_what_it_needs():
    cfg = EngineConfig(block_size=16, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"max_model_len=4096 tokens needs 134217728 bytes.*"
                                         r"raise gpu_memory_utilization, lower max_model_len, "
                                         r"or pass kv_cache_memory"):
        pool_blocks(cfg, 32768, torch.device("cuda"), 1 << 20, 4096)
    assert pool_blocks(cfg, 32768, torch.device("cuda"), 16 * GiB, 4096) == \
        16 * GiB // (16 * 32768)


def test_the_profiling_forward_is_a_real_forward(tiny_model_factory):
    """The profile attends every token causally as one sequence: HF's logits exactly."""
    from batchgen import LLM

    path = tiny_model_factory("llama")
    llm = LLM(path, num_kv_blocks=16)
    ids = torch.tensor([[1, 5, 9, 33, 7, 100, 42]])
    with torch.inference_mode():
        got = llm.model(input_ids=ids, position_ids=torch.arange(7)[None], use_cache=False,
                        batchgen_step=ProfileContext()).logits[0]
        want = load_hf_model(path)(input_ids=ids, use_cache=False).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_flashinfer_reserve_counts_wrappers_per_plan_key_and_captured_size():
    """GPT-OSS-shaped: alternating sliding / full layers, all with sinks: two plan keys. Eager:
    a prefill and a decode wrapper per key; graphs add one decode wrapper per captured size per
    key (35 sizes at max_num_seqs=256). Plus the workspace and the output buffer."""
    specs = [_spec(128 if i % 2 == 0 else None, sinks=True) for i in range(24)]
    out = 8192 * 64 * 64 * 2  # max_num_tokens x heads x head_dim x bf16
    assert out == 64 * MiB
    eager = flashinfer_backend.reserved_bytes(specs, 8192, None)
    assert eager == 256 * MiB + out + 2 * 2 * 8 * MiB
    sizes = capture_sizes(256)
    assert len(sizes) == 35
    graphs = flashinfer_backend.reserved_bytes(specs, 8192, sizes)
    assert graphs == 256 * MiB + out + 2 * (2 + 35) * 8 * MiB  # 592 MiB of wrappers
    # sinks are part of the key: one window with and without sinks is two keys
    assert flashinfer_backend.reserved_bytes([_spec(), _spec(sinks=True)], 8192, None) == eager
    assert flashinfer_backend.reserved_bytes([_spec()] * 4, 8192, None) == \
        256 * MiB + out + 2 * 8 * MiB


def test_the_reserve_is_the_most_any_candidate_takes():
    """Graph sizes reach only the entries that run graphs; backends without a reserve take 0."""
    seen = []

    def reserve(specs, max_num_tokens, graph_sizes):
        seen.append(graph_sizes)
        return 7 * MiB

    def entry(name, graphs):
        return registry.BackendEntry(name, ("cpu",), None, None, None, lambda: None,
                                     graphs=graphs, reserve=reserve)

    torch_entry = registry.BACKENDS["torch"]
    cands = [(entry("a", True), None), (entry("b", False), None), (torch_entry, None)]
    assert registry.reserved_bytes(cands, [_spec()], 64, [1, 2]) == 7 * MiB
    assert seen == [[1, 2], None]
    assert registry.reserved_bytes([(torch_entry, None)], [_spec()], 64, [1, 2]) == 0


@pytest.mark.parametrize("eager", [True, False])
def test_llm_keeps_the_backend_reserve_out_of_the_gpu_budget(tiny_model_factory, monkeypatch,
                                                             caplog, eager):
    """The pool sized from free GPU memory (simulated: the budget is recorded, not measured)
    leaves the backend's declared reserve for the probed specs, plus the graph pool's allowance
    when graphs are on; both are logged after the capacity line."""
    from batchgen import LLM, factory

    asked = []

    def budget(model, num_tokens, num_logits, device, utilization, other, foreign=0):
        asked.append(other)
        return 64 * MiB

    monkeypatch.setattr(factory, "pool_from_gpu_memory", lambda device, cfg: True)
    monkeypatch.setattr(factory, "device_kv_budget", budget)
    entry = registry.BACKENDS["torch"]
    monkeypatch.setitem(registry.BACKENDS, "torch", registry.BackendEntry(
        "torch", entry.devices, None, None, None, entry.load, graphs=True,
        reserve=flashinfer_backend.reserved_bytes))
    path = tiny_model_factory("gemma2", head_dim=64)  # sliding and full layers: two plan keys
    with caplog.at_level("INFO", logger="batchgen"):
        llm = LLM(path, attention_backend="torch", max_num_seqs=4, max_num_batched_tokens=64,
                  enforce_eager=eager)
    specs = llm.engine.runner.backend.specs
    assert len({s.plan_key for s in specs}) == 2
    backend = flashinfer_backend.reserved_bytes(specs, 64, None if eager else [1, 2, 4])
    graphs = 0 if eager else GRAPH_POOL_BYTES
    assert asked == [backend + graphs]
    lines = [r.getMessage() for r in caplog.records]
    kept = [m for m in lines if m.startswith("GPU memory kept")]
    assert kept == [(f"GPU memory kept beyond the pool when sizing it: "
                             f"{backend / MiB:.1f} MiB for the attention backend, "
                             f"{graphs / MiB:.1f} MiB for the CUDA graph pool")]


def test_a_bare_cuda_device_resolves_to_the_current_gpu_by_index(monkeypatch):
    """'cuda' (or no device on a GPU machine) becomes cuda:<current>, so per-thread
    set_device calls and device comparisons work; an index past the GPUs is refused.
    torch.cuda's answers are stand-ins here (no GPU on this machine)."""
    from batchgen.factory import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(None) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="2 CUDA device"):
        resolve_device("cuda:2")

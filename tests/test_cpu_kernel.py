"""The compiled CPU decode kernel vs a dense float64 reference, and its batch invariance: a
sequence's output is bit-identical alone or in any batch, in any physical blocks, on any
thread count."""

import random

import pytest
import torch

from batchgen.attention import cpu_kernel
from tests.helpers import cpu_kernel_or_skip
from tests.test_attention_backend import _dense_reference


def _pool(num_blocks, block_size, hkv, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    return k.to(dtype), v.to(dtype)


def _tables(lens, block_size, num_blocks, rng):
    """Scattered page tables: kv_indptr, kv_indices (int32) and the Python lists."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for n in lens:
        need = -(-n // block_size)
        tables.append([free.pop() for _ in range(need)])
    indptr = [0]
    for t in tables:
        indptr.append(indptr[-1] + len(t))
    i32 = torch.int32
    return (torch.tensor(indptr, dtype=i32), torch.tensor([p for t in tables for p in t], dtype=i32),
            torch.tensor(lens, dtype=i32), tables)


def _run(q, k, v, indptr, indices, lens, scale, window=None, softcap=None, sinks=None):
    out = torch.empty_like(q)
    cpu_kernel_or_skip()(q, k, v, out, indptr, indices, lens, scale, window, softcap, sinks)
    return out


@pytest.mark.parametrize("hq,hkv,d,block_size", [
    (8, 2, 32, 16), (4, 4, 64, 4), (6, 1, 24, 3), (12, 4, 80, 1), (2, 2, 8, 5), (16, 2, 128, 16)])
@pytest.mark.parametrize("window,softcap,sinks", [
    (None, None, False), (7, None, False), (None, 12.0, False), (None, None, True),
    (20, 8.0, True)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_kernel_matches_dense(hq, hkv, d, block_size, window, softcap, sinks, kv_dtype):
    """float32 math either way; bfloat16 and fp8 pools are compared on their (widened) stored
    values."""
    rng = random.Random(hq * 100 + d)
    lens = [1, 2, block_size, block_size + 1, 3 * block_size, 17, 40, 129, 300]
    num_blocks = sum(-(-n // block_size) for n in lens) + 7
    k, v = _pool(num_blocks, block_size, hkv, d, seed=d, dtype=kv_dtype)
    indptr, indices, kv_len, tables = _tables(lens, block_size, num_blocks, rng)
    q = torch.randn(len(lens), hq, d)
    sink_t = torch.randn(hq) if sinks else None
    out = _run(q, k, v, indptr, indices, kv_len, d ** -0.5, window, softcap, sink_t)
    for i, (n, table) in enumerate(zip(lens, tables)):
        ks = k[table].reshape(-1, hkv, d)[:n].float()
        vs = v[table].reshape(-1, hkv, d)[:n].float()
        ref = _dense_reference(q[i:i + 1], ks, vs, d ** -0.5, window, softcap, sink_t)
        torch.testing.assert_close(out[i:i + 1], ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("hq,hkv,d,bs,kv_dtype", [(8, 2, 32, 16, torch.float32),
                                                 (6, 2, 24, 5, torch.float32),
                                                 (8, 2, 32, 16, torch.bfloat16),
                                                 (8, 2, 32, 16, torch.float8_e4m3fn)])
def test_kernel_is_batch_invariant(hq, hkv, d, bs, kv_dtype):
    """Same sequence, same bits: alone, among others, relocated to other blocks, 1 or 2 threads
    (which also changes how heads are split into tasks and grouped for the 4-way dot)."""
    k, v = _pool(600, bs, hkv, d, dtype=kv_dtype)
    rng = random.Random(3)
    lens = [5, 300, 16, 77, 1000, 33] if bs == 16 else [5, 300, 16, 77, 1000 // bs, 33]
    indptr, indices, kv_len, tables = _tables(lens, bs, 600, rng)
    q = torch.randn(len(lens), hq, d)
    together = _run(q, k, v, indptr, indices, kv_len, 0.2)
    threads = torch.get_num_threads()
    try:
        for target in range(len(lens)):
            # move the target's blocks elsewhere (copy them into unused blocks)
            used = {p for t in tables for p in t}
            spare = [b for b in range(600) if b not in used][:len(tables[target])]
            k2, v2 = k.clone(), v.clone()
            k2[spare], v2[spare] = k[tables[target]], v[tables[target]]
            one = (torch.tensor([0, len(spare)], dtype=torch.int32),
                   torch.tensor(spare, dtype=torch.int32),
                   torch.tensor([lens[target]], dtype=torch.int32))
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                alone = _run(q[target:target + 1].clone(), k2, v2, *one, 0.2)
                assert torch.equal(alone[0], together[target]), (target, n_threads)
    finally:
        torch.set_num_threads(threads)


def test_kernel_rejects_wrong_inputs():
    k, v = _pool(4, 4, 2, 8)
    q = torch.randn(1, 4, 8)
    good = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="q must be a contiguous float32"):
        _run(q.double(), k, v, *good, 1.0)
    with pytest.raises(ValueError, match="v must be a contiguous CPU tensor of one of"):
        _run(q, k, v.bfloat16(), *good, 1.0)
    with pytest.raises(ValueError, match="k must be a contiguous CPU tensor of one of"):
        _run(q, k.half(), v.half(), *good, 1.0)
    with pytest.raises(ValueError, match="kv_indices must be a contiguous int32"):
        _run(q, k, v, good[0], good[1].long(), good[2], 1.0)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        _run(torch.randn(1, 3, 8), k, v, *good, 1.0)
    with pytest.raises(ValueError, match=r"kv_indices must lie in \[0, 4\)"):
        _run(q, k, v, good[0], torch.tensor([4], dtype=torch.int32), good[2], 1.0)
    with pytest.raises(ValueError, match="fit its pages"):
        _run(q, k, v, good[0], good[1], torch.tensor([5], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="end at len"):
        _run(q, k, v, torch.tensor([0, 2], dtype=torch.int32), good[1], good[2], 1.0)
    with pytest.raises(ValueError, match="one value per query head"):
        _run(q, k, v, *good, 1.0, sinks=torch.zeros(3))


def test_kernel_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    first = cpu_kernel.build()
    assert first.parent == tmp_path / "batchgen" / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_kernel.build() == first and first.stat().st_mtime_ns == stamp


def test_switch_off_falls_back_to_pytorch(monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    assert cpu_kernel.try_load() is None
    with pytest.raises(cpu_kernel.KernelUnavailable, match="disabled"):
        cpu_kernel.load()


def test_llm_attention_backend_choices(tiny_model_factory):
    """The registry's choice, by name or by default, and why a named backend cannot run."""
    from batchgen import LLM
    from batchgen.attention.kernel_backend import CpuKernelBackend
    from batchgen.attention.torch_backend import TorchBackend

    path = tiny_model_factory("llama")

    def backend(**kw):
        llm = LLM(path, num_kv_blocks=64, **kw)
        return llm.attention_backend, type(llm.engine.runner.backend)

    assert backend() == ("cpu_kernel", CpuKernelBackend)
    assert backend(attention_backend="cpu_kernel") == ("cpu_kernel", CpuKernelBackend)
    assert backend(attention_backend="torch") == ("torch", TorchBackend)
    assert backend(kv_cache_dtype="bfloat16") == ("cpu_kernel", CpuKernelBackend)
    # a float16 pool: the default quietly uses PyTorch, insisting on the kernel is an error
    assert backend(kv_cache_dtype="float16") == ("torch", TorchBackend)
    with pytest.raises(ValueError, match="attention_backend='cpu_kernel' cannot run here: "
                                         "needs a KV cache of"):
        LLM(path, num_kv_blocks=64, kv_cache_dtype="float16", attention_backend="cpu_kernel")


def test_an_unbuildable_kernel_is_a_clear_error_before_loading(tiny_model_factory, monkeypatch):
    """attention_backend='cpu_kernel' where the kernel cannot be built: ValueError with the
    reason, raised before the weights load; the default falls back to PyTorch."""
    from batchgen import LLM
    from batchgen.model import loader

    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    loads = []
    monkeypatch.setattr(loader, "load_model", lambda *a: loads.append(a))
    with pytest.raises(ValueError, match="attention_backend='cpu_kernel' cannot run here: "
                                         "disabled"):
        LLM(tiny_model_factory("llama"), num_kv_blocks=64, attention_backend="cpu_kernel")
    assert loads == []
    monkeypatch.undo()
    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    assert LLM(tiny_model_factory("llama"), num_kv_blocks=64).attention_backend == "torch"


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float32"])
def test_kernel_and_pytorch_paths_agree_end_to_end(tiny_model_factory, kv_cache_dtype):
    """Same model, same pool dtype: the kernel and the PyTorch path give the same greedy tokens
    and logprobs to float noise. With a bfloat16 pool that noise is larger: a K/V value whose
    float32 attention input differs in the last bit can round to the neighbouring bfloat16
    (2^-8 apart), so a logprob may move by ~1e-4."""
    from batchgen import LLM, SamplingParams
    from tests.helpers import make_prompt_token_ids

    path = tiny_model_factory("qwen2")  # GQA with qkv bias
    prompts = [{"prompt_token_ids": p}
               for p in make_prompt_token_ids(8, 3, 70, vocab_size=512, seed=4)]
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    outs = [LLM(path, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype, attention_backend=b
                ).generate(prompts, sp, use_tqdm=False) for b in ("cpu_kernel", "torch")]
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        tol = 1e-3 if kv_cache_dtype == "bfloat16" else 1e-4
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob,
                                                                abs=tol)

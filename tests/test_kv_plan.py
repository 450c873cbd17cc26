"""`batchgen kv-plan` and `batchgen.kv_plan`: the chapter's worked example from a config.json
without weights, exact agreement with the capacity line LLM logs, windowed layers, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen import LLM
from batchgen.attention.spec import probe_specs
from batchgen.cli import main
from batchgen.cli.kv_plan import parse_memory
from batchgen.config import DEFAULT_CPU_KV_BYTES
from batchgen.kv_plan import SlidingWindows, plan_kv, sliding_windows
from batchgen.model import loader
from batchgen.tools.make_tiny_model import make_config

ROOT = Path(__file__).resolve().parents[1]

# meta-llama/Llama-2-13b-hf's config.json (the chapter's worked example), no weights.
LLAMA2_13B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120,
    "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 40,
    "intermediate_size": 13824, "vocab_size": 32000, "max_position_embeddings": 4096,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "torch_dtype": "float16",
}


@pytest.fixture
def llama2_13b(tmp_path: Path) -> Path:
    """A folder holding only Llama-2-13B's config.json."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_13B))
    return tmp_path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(argv) with its exit code, stdout and stderr."""
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ---- (a) the worked example ---------------------------------------------------------------
def test_llama2_13b_worked_example_plan(llama2_13b: Path) -> None:
    plan = plan_kv(loader.load_config(llama2_13b), max_model_len=2048, memory=80 << 30)
    assert (plan.num_layers, plan.num_kv_heads, plan.head_dim, plan.dtype_bytes) == (
        40, 40, 128, 2)
    assert plan.bytes_per_token == 819_200
    assert round(plan.bytes_per_token / 2**20, 3) == 0.781
    assert plan.seq_bytes == 2048 * 819_200
    assert round(plan.seq_bytes / 2**30, 2) == 1.56
    assert plan.num_blocks == (80 << 30) // (16 * 819_200) == 6553
    assert plan.max_concurrency == pytest.approx(6553 / 128)
    assert plan.sliding is None


def test_llama2_13b_worked_example_cli(llama2_13b: Path, capsys) -> None:
    code, out, err = run_cli(["kv-plan", "--model", str(llama2_13b), "--max-model-len", "2048",
                              "--memory", "80GiB"], capsys)
    assert code == 0, err
    assert "L=40 layers, H_kv=40 KV heads, d_h=128, KV dtype float16 (b=2 bytes)" in out
    assert "819,200 bytes/token = 0.781 MiB/token" in out
    assert "max_model_len=2048 tokens: 1.56 GiB (1,677,721,600 bytes), 128 blocks" in out
    assert "6,553 blocks = 104,848 tokens" in out
    assert "max concurrency at max_model_len=2048: 51.20x" in out
    assert ("LLM logs: KV cache: 6553 blocks x 16 tokens = 104848 tokens, 819200 bytes/token "
            "(beta)") in out
    assert "sliding" not in out


def test_swap_space_in_the_worked_example(llama2_13b: Path, capsys) -> None:
    """4 GiB of swap for Llama-2-13B: 2^32 / (16 x 819,200) = 327.68 -> 327 whole blocks."""
    code, out, err = run_cli(["kv-plan", "--model", str(llama2_13b), "--max-model-len", "2048",
                              "--memory", "80GiB", "--swap-space", "4"], capsys)
    assert code == 0, err
    assert ("swap pool: 4 GiB of CPU RAM / 13,107,200 bytes per block = 327 blocks = 5,232 "
            "tokens (2.55 max_model_len sequences swapped out at once)") in out
    assert "; host swap pool: 327 blocks = 5232 tokens, 4087.5 MiB of CPU RAM" in out
    code, _, err = run_cli(["kv-plan", "--model", str(llama2_13b), "--swap-space", "-1"],
                           capsys)
    assert code != 0 and "swap_space must be a number of GiB >= 0, got -1" in err


def test_default_memory_is_the_cpu_default_and_said(llama2_13b: Path, capsys) -> None:
    code, out, _ = run_cli(["kv-plan", "--model", str(llama2_13b)], capsys)
    assert code == 0
    assert "the CPU default: no --memory given" in out
    plan = plan_kv(loader.load_config(llama2_13b))
    assert plan.memory_bytes == DEFAULT_CPU_KV_BYTES and plan.memory_is_default
    assert plan.num_blocks == DEFAULT_CPU_KV_BYTES // (16 * 819_200)
    assert plan.max_model_len == 4096


def test_fp8_halves_beta_and_json(llama2_13b: Path, capsys) -> None:
    code, out, _ = run_cli(["kv-plan", "--model", str(llama2_13b), "--kv-cache-dtype", "fp8",
                            "--memory", "1.5GB", "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["bytes_per_token"] == 409_600 and d["dtype_bytes"] == 1
    assert d["memory_bytes"] == 1_500_000_000
    assert d["num_blocks"] == 1_500_000_000 // (16 * 409_600)
    # the pool holds fewer than 4096 tokens: the default max_model_len is capped, as in LLM
    assert d["max_model_len"] == d["num_tokens"] < d["model_max_len"] == 4096
    assert d["capacity_line"].startswith(f"KV cache: {d['num_blocks']} blocks x 16 tokens")


@pytest.mark.parametrize("text, expected", [
    ("1073741824", 2**30), ("512MiB", 512 * 2**20), ("80GiB", 80 * 2**30),
    ("1.5GB", 1_500_000_000), ("2 kib", 2048), ("10B", 10), ("0.5KB", 500)])
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


# ---- (b) exactly LLM's capacity line ------------------------------------------------------
@pytest.mark.parametrize("family, kw", [
    ("llama", {}),  # the CPU default budget, capped at what max_num_seqs sequences use
    ("llama", {"kv_cache_memory": 300_000, "block_size": 8, "max_model_len": 200}),
    ("llama", {"kv_cache_memory": 40_000, "block_size": 16, "max_num_seqs": 4}),  # len capped
    ("qwen3", {"kv_cache_memory": 300_000, "block_size": 8, "swap_space": 0.001}),
    ("gemma2", {"kv_cache_memory": 1 << 20, "block_size": 32, "kv_cache_dtype": "bfloat16"}),
    ("mistral", {"block_size": 4, "max_num_seqs": 3, "max_model_len": 100,
                 "kv_cache_dtype": "fp8"}),
])
def test_plan_matches_llm_capacity_line(tiny_model_factory, family: str, kw: dict) -> None:
    path = tiny_model_factory(family)
    llm = LLM(str(path), device="cpu", **kw)
    logged = llm.cache_config.capacity_line(llm.max_model_len)
    plan = plan_kv(loader.load_config(path), memory=kw.get("kv_cache_memory"),
                   block_size=kw.get("block_size", 16), max_model_len=kw.get("max_model_len"),
                   kv_cache_dtype=kw.get("kv_cache_dtype", "auto"),
                   max_num_seqs=kw.get("max_num_seqs", 256),
                   swap_space=kw.get("swap_space", 0))
    assert plan.capacity_line() == logged
    assert plan.host_bytes == (llm.engine.runner.host.nbytes if llm.engine.runner.host else 0)
    assert (plan.num_blocks, plan.max_model_len) == (llm.cache.num_blocks, llm.max_model_len)
    assert plan.bytes_per_token == llm.cache.bytes_per_token
    assert plan.pool_bytes == llm.cache.pool[:, :, :-1].nbytes  # scratch block aside


def test_cli_prints_llm_capacity_line(tiny_model_factory, capsys) -> None:
    path = tiny_model_factory("llama")
    llm = LLM(str(path), device="cpu", kv_cache_memory=3 << 20, block_size=16,
              max_model_len=512)
    code, out, _ = run_cli(["kv-plan", "--model", str(path), "--memory", "3MiB",
                            "--block-size", "16", "--max-model-len", "512"], capsys)
    assert code == 0
    assert f"LLM logs: {llm.cache_config.capacity_line(llm.max_model_len)}\n" in out


# ---- (c) sliding-window layers ------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "mistral", "gpt_oss", "llama", "qwen2"])
def test_sliding_windows_match_the_probed_specs(tiny_model_factory, family: str) -> None:
    """The config conventions give the windows HF passes each layer (probed at load)."""
    path = tiny_model_factory(family)
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    specs = probe_specs(llm.model, len(llm.cache.k_flat), llm.device)
    windows = [s.window for s in specs if s.window is not None]
    sw = sliding_windows(loader.load_config(path))
    if not windows:
        assert sw is None
    else:
        assert sw == SlidingWindows(windows[0], len(windows), len(specs))
        assert set(windows) == {sw.window}


def test_sliding_conventions_without_layer_types() -> None:
    qwen2 = make_config("qwen2", use_sliding_window=True, sliding_window=100,
                        max_window_layers=3, num_hidden_layers=8)
    assert sliding_windows(qwen2) == SlidingWindows(100, 5, 8)
    qwen2_off = make_config("qwen2", use_sliding_window=False, sliding_window=100)
    assert sliding_windows(qwen2_off) is None
    assert sliding_windows(make_config("mistral", num_hidden_layers=3)) == SlidingWindows(
        24, 3, 3)
    assert sliding_windows(make_config("phi3")) is None


def test_windowed_line(tiny_model_factory, capsys) -> None:
    path = tiny_model_factory("gemma2")  # 2 layers, layer 0 slides over 24 tokens
    code, out, _ = run_cli(["kv-plan", "--model", str(path), "--max-model-len", "1000",
                            "--memory", "1MiB"], capsys)
    assert code == 0
    plan = plan_kv(loader.load_config(path), memory=1 << 20, max_model_len=1000)
    beta = plan.bytes_per_token
    assert plan.windowed_seq_bytes == (1000 + 24) * beta // 2
    assert plan.seq_bytes == 1000 * beta
    line = next(x for x in out.splitlines() if x.startswith("sliding windows:"))
    assert "1 of 2 layers slide over 24 tokens" in line
    assert f"({plan.windowed_seq_bytes:,} bytes) per 1000-token sequence" in line
    assert "batchgen does NOT save this yet" in line
    # the pool itself ignores windows: every layer keeps every token
    assert plan.capacity_line() == plan_kv(
        loader.load_config(tiny_model_factory("llama")), memory=1 << 20,
        max_model_len=1000).capacity_line()


# ---- (d) errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("memory", ["12X", "-5", "0", "GiB", "1.5.2GB", "0.1"])
def test_bad_memory(llama2_13b: Path, memory: str, capsys) -> None:
    code, out, err = run_cli(["kv-plan", "--model", str(llama2_13b), f"--memory={memory}"],
                             capsys)
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith("batchgen: error: --memory must be")
    assert "80GiB" in err and "1.5GB" in err


def test_missing_folder_and_folder_without_config(tmp_path: Path, capsys) -> None:
    for model in (tmp_path / "missing", tmp_path):
        code, out, err = run_cli(["kv-plan", "--model", str(model)], capsys)
        assert code == 2 and not out
        assert err.count("\n") == 1 and err.startswith("batchgen: error: --model must be")


def test_too_small_memory_and_bad_values(llama2_13b: Path, capsys) -> None:
    for argv in (["--memory", "1MiB"],  # less than one block
                 ["--memory", "100MiB", "--max-model-len", "2048"],  # the sequence won't fit
                 ["--max-model-len", "8192"],  # beyond max_position_embeddings
                 ["--block-size", "0"]):
        code, out, err = run_cli(["kv-plan", "--model", str(llama2_13b), *argv], capsys)
        assert code == 2 and not out and err.count("\n") == 1, argv
    with pytest.raises(SystemExit) as e:
        main(["kv-plan", "--model", str(llama2_13b), "--kv-cache-dtype", "int4"])
    assert e.value.code == 2


def test_module_entry_point(llama2_13b: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "batchgen", "kv-plan", "--model", str(llama2_13b),
         "--max-model-len", "2048", "--memory", "80GiB", "--json"],
        capture_output=True, text=True, cwd=llama2_13b,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["bytes_per_token"] == 819_200 and d["num_blocks"] == 6553


# ---- (d) keys and values of different widths (MLA, decompressed) ---------------------------
def test_deepseek_v3_plan_is_the_latent(tmp_path: Path, capsys) -> None:
    """DeepSeek-V3's pool holds the latent: kv_lora_rank 512 + rope 64 = 576 values per token
    and layer (61 layers, bfloat16)."""
    from transformers import DeepseekV3Config

    DeepseekV3Config(dtype="bfloat16").save_pretrained(tmp_path)
    plan = plan_kv(loader.load_config(tmp_path), memory=64 << 30)
    assert (plan.num_kv_heads, plan.head_dim, plan.latent) == (1, 576, True)
    assert plan.bytes_per_token == 61 * 576 * 2 == 70_272
    code, out, _ = run_cli(["kv-plan", "--model", str(tmp_path), "--memory", "64GiB"], capsys)
    assert code == 0 and "latent d_h=576 (kv_lora_rank 512 + rope 64" in out
    assert "L * H_kv * d_h * b = 70,272 bytes/token" in out


def test_deepseek_v3_plan_counts_192_wide_keys_and_128_wide_values(tmp_path: Path, capsys,
                                                                     monkeypatch) -> None:
    """Decompressed (BATCHGEN_MLA_CACHE=decompressed): DeepSeek-V3's config says head_dim 64
    (the rope part); attention gets 128 heads of 192-wide keys and 128-wide values per layer,
    and the pool holds exactly those."""
    from transformers import DeepseekV3Config

    monkeypatch.setenv("BATCHGEN_MLA_CACHE", "decompressed")
    DeepseekV3Config(dtype="bfloat16").save_pretrained(tmp_path)
    plan = plan_kv(loader.load_config(tmp_path), memory=64 << 30)
    assert (plan.num_layers, plan.num_kv_heads, plan.head_dim, plan.head_dim_v) == (
        61, 128, 192, 128)
    assert plan.bytes_per_token == 61 * 128 * (192 + 128) * 2
    code, out, _ = run_cli(["kv-plan", "--model", str(tmp_path), "--memory", "64GiB"], capsys)
    assert code == 0 and "d_k=192, d_v=128" in out
    assert f"L * H_kv * (d_k + d_v) * b = {61 * 128 * 320 * 2:,} bytes/token" in out


def test_mla_plan_matches_the_llm_pool(tmp_path: Path) -> None:
    from tests.families import save_family_model

    path = save_family_model("deepseek_v3", tmp_path)
    llm = LLM(str(path), device="cpu", kv_cache_memory=1 << 20, block_size=8)
    plan = plan_kv(loader.load_config(path), memory=1 << 20, block_size=8)
    assert plan.capacity_line() == llm.cache_config.capacity_line(llm.max_model_len)
    assert plan.bytes_per_token == llm.cache.bytes_per_token == 4 * (32 + 8) * 4  # latent
    assert plan.pool_bytes == llm.cache.nbytes * llm.cache.num_blocks // (
        llm.cache.num_blocks + 1)  # scratch block aside

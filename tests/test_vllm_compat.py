"""batchgen.vllm_compat: an explicit switch that makes `import vllm` resolve to batchgen (what
TRL's colocated generator imports and calls), refusing to shadow a real vLLM."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

import batchgen.vllm_compat as compat
from batchgen import SamplingParams
from batchgen.params import StructuredOutputsParams


@pytest.fixture
def installed():
    assert importlib.util.find_spec("vllm") is None, "a real vLLM is installed here"
    compat.install()
    yield
    compat.uninstall()
    assert importlib.util.find_spec("vllm") is None and "vllm" not in sys.modules


def test_install_makes_vllms_offline_names_batchgens(installed) -> None:
    import vllm
    from vllm import LLM, RequestOutput
    from vllm import SamplingParams as VSamplingParams
    from vllm.distributed.weight_transfer.nccl_common import trainer_init
    from vllm.sampling_params import StructuredOutputsParams as VStructured
    from vllm.utils.network_utils import get_ip, get_open_port

    assert importlib.util.find_spec("vllm") is not None and compat.installed()
    assert vllm.__version__ == compat.VERSION and LLM is compat.CompatLLM
    assert VSamplingParams is SamplingParams and VStructured is StructuredOutputsParams
    assert RequestOutput.__module__ == "batchgen.outputs"
    assert isinstance(get_ip(), str) and 0 < get_open_port() < 65536
    with pytest.raises(NotImplementedError, match="server mode"):
        trainer_init()
    compat.install()  # idempotent
    assert sys.modules["vllm"] is vllm


def test_trl_sees_a_vllm_it_accepts(installed) -> None:
    pytest.importorskip("trl")
    from trl.import_utils import is_vllm_available

    assert is_vllm_available() and is_vllm_available(min_version="0.28.0")


def test_install_refuses_over_a_real_vllm(tmp_path, monkeypatch) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("__version__ = '0.11.0'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(RuntimeError, match="a real vLLM is installed .*does not shadow it"):
        compat.install()
    assert not compat.installed() and "vllm" not in sys.modules


def test_the_compat_llm_has_the_engine_paths_trl_uses(installed, tiny_model_factory) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    folder = tiny_model_factory("llama", vocab_size=300, seed=21)
    llm = LLM(model=str(folder), model_impl="vllm", distributed_executor_backend="external_launcher",
              logprobs_mode="processed_logprobs", max_model_len=64, max_num_seqs=4,
              enable_sleep_mode=True, gpu_memory_utilization=0.3, max_num_batched_tokens=4096,
              quantization=None, seed=0)
    assert llm.llm_engine.model_config.max_model_len == 64
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(2)
    assert model.load_weights([("lm_head.weight", trainer.lm_head.weight)]) == {"lm_head.weight"}
    assert torch.equal(llm.model.lm_head.weight, trainer.lm_head.weight)
    compat.share(trainer)  # LLM(model=<its folder>) now generates from the trainer's module
    shared = LLM(model=str(folder), max_model_len=64, max_num_seqs=4)
    assert shared.model is trainer
    compat.unshare(trainer)
    assert LLM(model=str(folder), max_model_len=64, max_num_seqs=4).model is not trainer
    with pytest.raises(ValueError, match="^model must be a loaded transformers model"):
        compat.share(torch.nn.Linear(1, 1))

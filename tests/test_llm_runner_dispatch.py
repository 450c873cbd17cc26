"""`batchgen.LLM(model, runner=...)` (issue 42): a reward model's, a process reward model's or
an embedding model's folder, or runner="pooling", builds a PoolingLLM whose calls equal HF's own
head on the same tiny random weights; a generator stays an LLM (GPT-2's `*LMHeadModel` too);
runner="generate" on a pooling folder and `batchgen generate --model RM` are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import head_folder

PROMPTS = ["Q: 2+2? A: 4", "Hello there, how are you doing today?", "x"]


@pytest.fixture(scope="module")
def folders(tiny_model_factory, tmp_path_factory) -> dict[str, Path]:
    src = tiny_model_factory("qwen3")
    return {"causal": src,
            "rm": head_folder(src, tmp_path_factory.mktemp("rm"), "SequenceClassification", 1, 3),
            "prm": head_folder(src, tmp_path_factory.mktemp("prm"), "TokenClassification", 2, 3)}


def _hf(folder: Path, auto: str, prompts: list[str]) -> list[torch.Tensor]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = getattr(transformers, auto).from_pretrained(folder, dtype="float32").eval()
    with torch.no_grad():
        outs = [hf(**tok(p, return_tensors="pt")) for p in prompts]
    if auto == "AutoModel":
        return [o.last_hidden_state[0] for o in outs]
    return [o.logits[0] for o in outs]


@pytest.mark.parametrize("runner", ["auto", "pooling"])
def test_llm_on_a_reward_model_is_a_pooling_llm(folders, runner):
    from batchgen import LLM
    from batchgen.pooling.llm import PoolingLLM

    llm = LLM(folders["rm"], runner=runner, seed=0, block_size=4)
    assert isinstance(llm, PoolingLLM) and isinstance(llm, LLM)
    got = torch.tensor([o.outputs.probs for o in llm.reward(PROMPTS)])
    want = torch.stack(_hf(folders["rm"], "AutoModelForSequenceClassification", PROMPTS))
    assert torch.allclose(got, want, atol=1e-5)


def test_llm_on_a_prm_and_on_a_causal_lm_under_pooling(folders):
    """A PRM folder under "auto": per-token scores equal HF's token-classification head; a
    causal LM under runner="pooling": an embedding model over its backbone (last token)."""
    from batchgen import LLM
    from batchgen.pooling.llm import PoolingLLM

    prm = LLM(folders["prm"], seed=0, block_size=1, max_num_batched_tokens=4)
    assert isinstance(prm, PoolingLLM)
    want = _hf(folders["prm"], "AutoModelForTokenClassification", PROMPTS)
    for out, ref in zip(prm.encode(PROMPTS, pooling_task="token_classify"), want):
        assert torch.allclose(out.outputs.data, ref, atol=1e-5)
    emb = LLM(folders["causal"], runner="pooling", seed=0)
    assert isinstance(emb, PoolingLLM) and emb.embedder is not None
    states = _hf(folders["causal"], "AutoModel", PROMPTS[:1])[0]
    got = torch.tensor(emb.embed(PROMPTS[:1])[0].outputs.embedding)
    assert torch.allclose(got, torch.nn.functional.normalize(states[-1], dim=-1), atol=1e-5)


def test_generators_stay_llms_and_generate_on_a_pooling_folder_is_refused(folders, tmp_path):
    from batchgen import LLM
    from batchgen.pooling.llm import PoolingLLM
    from batchgen.runners import resolve_runner, wants_pooling

    assert type(LLM(folders["causal"], seed=0, num_kv_blocks=8)) is LLM
    for arch in ("GPT2LMHeadModel", "GPT2DoubleHeadsModel", "LlamaForCausalLM"):
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "config.json").write_text(json.dumps({"architectures": [arch]}))
        assert resolve_runner("auto", [arch]) == "generate"
        assert not wants_pooling(tmp_path / arch)
    assert resolve_runner("auto", ["Qwen3Model"]) == "pooling"
    with pytest.raises(ValueError, match="runner='generate' cannot serve"):
        LLM(folders["rm"], runner="generate")
    with pytest.raises(ValueError, match="runner must be 'auto' or 'generate'.*PoolingLLM"):
        LLM(folders["rm"], runner="scoring")
    assert type(PoolingLLM(folders["rm"], seed=0)) is PoolingLLM  # built as asked


def test_cli_generate_refuses_a_reward_model(folders, tmp_path, capsys):
    from batchgen.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    code = main(["generate", "--model", str(folders["rm"]), "--input", str(src), "--output",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "is a pooling model" in err and "batchgen score" in err
    assert not (tmp_path / "out").exists()

"""LoRA under tensor parallelism (batchgen/lora/tp.py): 2 ranks over gloo (rank 0 here, one
spawned worker), a tiny llama, two PEFT adapters on column-parallel (q, k, v, gate, up) and
row-parallel (o, down) layers in one batch with the base model: greedy tokens equal PEFT's
unmerged models, with one device slot (every call swaps the adapters through it: the loads
reach the worker with the next step) and after `load_weights` pushes an adapter's tensors;
a layout the adapters cannot be cut along is refused, naming the adapter and the layer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import fresh_hf_model, make_prompt_token_ids, model_greedy, save_lora_adapter

peft = pytest.importorskip("peft")

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.lora import LoRARequest  # noqa: E402
from batchgen.lora.tp import layer_splits  # noqa: E402

ADAPTERS = {  # name: (r, targets)
    "col": (4, ["q_proj", "v_proj", "up_proj"]),
    "row": (8, ["o_proj", "down_proj", "k_proj", "gate_proj"]),
    "col2": (4, ["q_proj", "v_proj", "up_proj"]),  # col's shape, other values: load_weights
}
NEW = 6


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory("llama", num_hidden_layers=2)
    root = tmp_path_factory.mktemp("tp-loras")
    reqs, oracles = {}, {None: fresh_hf_model(model_dir)}
    for i, (name, (r, targets)) in enumerate(ADAPTERS.items(), 1):
        save_lora_adapter(model_dir, root / name, r, targets, 10 + i)
        reqs[name] = LoRARequest(name, i, str(root / name))
        oracles[name] = peft.PeftModel.from_pretrained(fresh_hf_model(model_dir), root / name).eval()
    llm = LLM(str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4,
              tensor_parallel_size=2)
    yield llm, reqs, oracles
    llm._executor.shutdown()


def _peft_greedy(model, prompt: list[int]) -> list[int]:
    return model_greedy(model, [prompt], NEW)[0]


def _run(llm, reqs, names, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW),
                        lora_request=[reqs.get(n) for n in names], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_two_ranks_with_two_adapters_equal_peft(setup):
    llm, reqs, oracles = setup
    prompts = make_prompt_token_ids(6, 8, 14, 512, seed=4)
    names = [None, "col", "row", "col", "row", None]
    got = _run(llm, reqs, names, prompts)
    assert got == [_peft_greedy(oracles[n], p) for n, p in zip(names, prompts)]
    assert got[1] != _peft_greedy(oracles[None], prompts[1])  # the adapters change tokens
    assert llm.kv_stats().lora_loads >= 2  # one slot: the two adapters took turns
    # verl's sync: col2's tensors pushed into col's slot reach the worker too
    pushed = {k: v for k, v in oracles["col2"].state_dict().items() if "lora_" in k}
    llm.load_weights(pushed.items(), lora_request=reqs["col"])
    got = _run(llm, reqs, ["col", None], prompts[:2])
    assert got == [_peft_greedy(oracles[n], p) for n, p in zip(["col2", None], prompts[:2])]


def test_a_layout_lora_cannot_follow_is_refused(setup):
    """A layer whose plan is neither colwise nor rowwise split along the tp dimension (a packed
    layout, a mesh with no "tp" dimension) is refused for the adapters that target it, before
    any work."""
    from torch.distributed.tensor import Shard

    def layer(ndim: int):
        return SimpleNamespace(weight=SimpleNamespace(placements=(Shard(0),),
                                                      device_mesh=SimpleNamespace(ndim=ndim)))

    model = SimpleNamespace(tp_plan={"layers.*.qkv": "packed_colwise",
                                     "layers.*.q": "colwise", "layers.*.o": "rowwise"})
    splits = layer_splits(model, {"layers.0.qkv": layer(1), "layers.0.q": layer(1),
                                  "layers.0.o": layer(1), "layers.1.q": layer(2)})
    assert [n for n, s in splits.items() if s.refusal] == ["layers.0.qkv", "layers.0.o",
                                                           "layers.1.q"]
    assert not splits["layers.0.q"].refusal and "packed_colwise" in splits["layers.0.qkv"].refusal
    llm, reqs, _ = setup
    layers = llm._lora.layers
    name = "model.layers.0.self_attn.q_proj"
    kept = layers.splits[name]
    layers.splits[name] = splits["layers.0.qkv"]
    try:
        req = LoRARequest("col_new", 9, reqs["col"].lora_path)
        with pytest.raises(ValueError, match=f"'col_new'.*{name}.*packed_colwise"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2),
                         lora_request=req, use_tqdm=False)
    finally:
        layers.splits[name] = kept

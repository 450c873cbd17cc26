"""sleep / wake_up (vLLM's sleep mode): the KV pool's memory really goes and comes back; level 2
discards the weights batchgen loaded (never a shared model's); what is asleep cannot run."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.test_shared_model import GREEDY, PROMPTS, trainer_model


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama", vocab_size=300, seed=21)


def tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def pool_bytes(llm: LLM) -> int:
    return llm.cache.pool.untyped_storage().nbytes()


def weight_elements(llm: LLM) -> int:
    return sum(p.numel() for p in llm.model.parameters())


def test_sleep_frees_the_pool_and_level_2_the_weights_until_wake_up_and_load(model_dir) -> None:
    llm = LLM(model_dir, enable_sleep_mode=True, num_kv_blocks=32, max_num_seqs=4)
    want, full, elements = tokens(llm), pool_bytes(llm), weight_elements(llm)
    state = {n: p.detach().clone() for n, p in llm.model.named_parameters()}
    llm.sleep(level=1)  # CPU: the weights stay (offloading to RAM from RAM frees nothing)
    assert llm.is_sleeping() and pool_bytes(llm) == 0 and weight_elements(llm) == elements
    with pytest.raises(RuntimeError, match=r"kv_cache are asleep: call wake_up\("):
        tokens(llm)
    llm.wake_up()
    assert not llm.is_sleeping() and pool_bytes(llm) == full
    assert tokens(llm) == want
    llm.sleep(level=2)
    assert pool_bytes(llm) == 0 and weight_elements(llm) == 0
    with pytest.raises(RuntimeError, match="weights are asleep"):
        llm.load_weights(state.items())
    llm.wake_up(tags=["weights"])  # TRL's order: weights, load, then the cache
    assert weight_elements(llm) == elements
    assert all(p.abs().sum() == 0 for p in llm.model.parameters())  # discarded, not kept
    llm.load_weights(state.items())
    with pytest.raises(RuntimeError, match="kv_cache are asleep"):
        tokens(llm)
    llm.wake_up(tags=["kv_cache"])
    assert tokens(llm) == want


def test_a_shared_models_weights_are_never_freed(model_dir) -> None:
    model = trainer_model(model_dir)
    ptrs = [p.data_ptr() for p in model.parameters()]
    llm = LLM(model, enable_sleep_mode=True, num_kv_blocks=32, max_num_seqs=4)
    want = tokens(llm)
    llm.sleep(level=2)
    assert pool_bytes(llm) == 0 and [p.data_ptr() for p in model.parameters()] == ptrs
    loss = model(input_ids=torch.tensor([PROMPTS[1]]), labels=torch.tensor([PROMPTS[1]])).loss
    loss.backward()  # the trainer runs while batchgen sleeps
    llm.wake_up()
    assert tokens(llm) == want


def test_sleep_arguments_are_checked(model_dir) -> None:
    llm = LLM(model_dir, num_kv_blocks=32, max_num_seqs=4)
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.sleep()
    llm = LLM(model_dir, enable_sleep_mode=True, num_kv_blocks=32, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"^level must be one of \(1, 2\), got 3"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match=r"^tags must be None or a list of \('weights', "):
        llm.wake_up(tags=["kv"])
    with pytest.raises(ValueError, match=r"got 'weights'$"):  # a list, not a string
        llm.wake_up(tags="weights")
    assert not llm.is_sleeping()
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2),
                        use_tqdm=False)

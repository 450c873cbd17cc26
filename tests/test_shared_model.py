"""LLM(model=<loaded PreTrainedModel>): generation from the caller's very module (no copy), the
paged attention active only inside batchgen's forwards; load_weights; sleep / wake_up."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen import LLM, SamplingParams
from batchgen.model.weights import hf_name

PROMPTS = [[1, 14, 55, 23, 9], [1, 71, 30, 8, 42, 17, 5] + list(range(100, 130))]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama", vocab_size=300, seed=21)


def trainer_model(model_dir, attn: str = "sdpa") -> torch.nn.Module:
    """A model as a trainer holds it: fp32, train mode, its own attention."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attn)
    return model.train()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One loss and backward on fixed ids (and an optimizer step when given); the loss and
    every gradient."""
    ids = torch.tensor([[1, 5, 9, 33, 71, 8, 12, 40], [1, 77, 3, 9, 90, 14, 2, 60]])
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if opt is not None:
        opt.step()
    return loss.detach(), grads


def fresh_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each generated token's log-probability from a plain HF forward of the module."""
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    model.train()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)


def generate(llm: LLM, params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def test_training_is_bit_identical_with_an_llm_attached_and_generation_follows_the_weights(
        model_dir) -> None:
    alone, attached = trainer_model(model_dir), trainer_model(model_dir)
    opt_a = torch.optim.SGD(alone.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(attached.parameters(), lr=0.5)
    params_before = [p.data_ptr() for p in attached.parameters()]
    llm = LLM(attached, num_kv_blocks=32, max_num_seqs=4)
    assert llm.model is attached and attached.training
    assert attached.config._attn_implementation == "sdpa"
    assert [p.data_ptr() for p in attached.parameters()] == params_before  # no copy
    for step in range(2):
        outs = generate(llm)
        assert attached.training and attached.config._attn_implementation == "sdpa"
        for p, out in zip(PROMPTS, outs):  # the module's current weights, no load_weights
            c = out.outputs[0]
            got = [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]
            assert got == pytest.approx(fresh_logprobs(attached, p, list(c.token_ids)),
                                        abs=1e-5)
        loss_a, grads_a = train_step(alone, opt_a)
        loss_b, grads_b = train_step(attached, opt_b)
        assert torch.equal(loss_a, loss_b), step
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert all(torch.equal(a, b) for a, b in zip(alone.parameters(), attached.parameters()))


def test_a_shared_module_is_refused_on_another_device_dtype_or_tp(model_dir) -> None:
    model = trainer_model(model_dir)
    with pytest.raises(ValueError, match="^dtype must be 'auto' or the model's own dtype"):
        LLM(model, dtype="bfloat16")
    with pytest.raises(ValueError, match="^tensor_parallel_size must be 1 for a loaded model"):
        LLM(model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="^model must be a model folder, a hub id, or a loaded"):
        LLM(torch.nn.Linear(2, 2))


def test_load_weights_strips_trainer_prefixes_casts_and_resets_the_prefix_cache(model_dir) -> None:
    llm = LLM(model_dir, num_kv_blocks=32, max_num_seqs=4, dtype="float32")
    before = generate(llm)
    assert llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False)
    assert llm.kv_stats().prefix_hit_tokens > 0
    new = trainer_model(model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.5)
    wrapped = {"model.embed_tokens.weight": "base_model.model.model.embed_tokens.weight",
               "model.layers.0.self_attn.q_proj.weight":
                   "_fsdp_wrapped_module.model.layers.0.self_attn.q_proj.base_layer.weight",
               "lm_head.weight": "module.lm_head.weight"}
    sent = [(wrapped.get(n, n), p.detach().to(torch.bfloat16).to(torch.float32) if i % 2 else
             p.detach().double()) for i, (n, p) in enumerate(new.named_parameters())]
    assert {hf_name(n) for n, _ in sent} == {n for n, _ in new.named_parameters()}
    loaded = llm.load_weights(sent)
    assert loaded == {n for n, _ in new.named_parameters()}
    for (name, p), (_, t) in zip(llm.model.named_parameters(), sent):
        assert p.dtype == torch.float32 and torch.equal(p, t.float()), name
    after = generate(llm)
    assert llm.kv_stats().prefix_hit_tokens == 0  # reset: the old K/V is never reused
    ref = trainer_model(model_dir)
    ref.load_state_dict({hf_name(n): t.float() for n, t in sent}, strict=False)
    for p, out in zip(PROMPTS, after):
        c = out.outputs[0]
        want = fresh_logprobs(ref, p, list(c.token_ids))
        assert [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)] == pytest.approx(
            want, abs=5e-5)  # weights x 1.5: larger logits, paged vs eager rounding
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]
    with pytest.raises(ValueError, match="^weights must name the model's parameters"):
        llm.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="must have shape"):
        llm.load_weights([("lm_head.weight", torch.zeros(3, 3))])

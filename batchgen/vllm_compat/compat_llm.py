"""The `vllm.LLM` that `batchgen.vllm_compat.install()` registers: batchgen's LLM plus the
engine paths vLLM scripts reach into (`llm_engine.model_executor.driver_worker.model_runner
.model.load_weights`, `llm_engine.model_config.max_model_len`, `llm_engine.vllm_config`'s
cache and scheduler fields)."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from batchgen.checks import ValidationError, check, is_int
from batchgen.llm import LLM
from batchgen.outputs import BeamSearchOutput
from batchgen.params import BeamSearchParams
from batchgen.pooling.llm import PoolingLLM  # noqa: F401  (registers the pooling runner)
from batchgen.prompts import TokensPrompt
from batchgen.vllm_compat.beam_steps import stepwise_beam_search
from batchgen.vllm_compat.engine_shims import InputProcessor

# name_or_path -> the module vllm.LLM(model=name_or_path) generates from (vllm_compat.share)
SHARED: dict[str, torch.nn.Module] = {}
VLLM_SEEDS = 2**32  # vLLM's ModelConfig.seed: 0 <= seed <= 2**32 - 1 (numpy's seed range)


class CompatLLM(LLM):
    """`vllm.LLM` for code written against vLLM. `model_impl="vllm"` (TRL's default) means
    the engine's own model code, which for batchgen is transformers'. The engine's `seed`
    is in vLLM's range, [0, 2**32) (batchgen's own LLM takes any torch seed); a sample's
    `cumulative_logprob` is None when its request asked for no logprobs, as vLLM gives it.
    `runner="pooling"` (or "auto" on a reward model's folder) builds a PoolingLLM, through
    `LLM`'s runner dispatch (batchgen/runners.py)."""

    def __init__(self, model: str | os.PathLike | torch.nn.Module, **kwargs: Any) -> None:
        seed = kwargs.get("seed", 0)
        check(seed is None or (is_int(seed) and 0 <= seed < VLLM_SEEDS), "seed",
              f"an integer in [0, {VLLM_SEEDS - 1}] (vLLM's range for the engine's seed)", seed)
        if kwargs.get("model_impl") == "vllm":
            kwargs["model_impl"] = "auto"
        if not isinstance(model, torch.nn.Module):
            model = SHARED.get(str(model), model)
        super().__init__(model, **kwargs)
        self.llm_engine = _engine_paths(self)
        self.model_config = self.llm_engine.model_config
        self.renderer = SimpleNamespace(get_tokenizer=self.get_tokenizer)
        self.results.cumulative_without_logprobs = False

    @functools.wraps(LLM.generate)
    def generate(self, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_image_embeds(prompts)
        return super().generate(prompts, *args, **kwargs)

    def beam_search(self, prompts: Any, params: BeamSearchParams | Any,
                    use_tqdm: Any = True, *, lora_request: Any = None,
                    concurrency_limit: int | None = None, priority: Any = None
                    ) -> list[BeamSearchOutput]:
        """batchgen's beam search in the engine; when `_render_and_run_requests` was replaced
        (on the instance or the class), vLLM's step-by-step search over it
        (vllm_compat/beam_steps.py), so the replacement sees and answers every step."""
        if not self._steps_replaced():
            return super().beam_search(prompts, params, use_tqdm, lora_request=lora_request,
                                       concurrency_limit=concurrency_limit, priority=priority)
        return stepwise_beam_search(self, prompts, params, lora_request, concurrency_limit,
                                    priority)

    def _steps_replaced(self) -> bool:
        return ("_render_and_run_requests" in vars(self) or type(self)._render_and_run_requests
                is not CompatLLM._render_and_run_requests)

    def _preprocess_cmpl(self, prompts: Any) -> list[dict[str, Any]]:
        """vLLM's engine inputs of the step-by-step beam search: each prompt as token ids."""
        tokenizer = self.get_tokenizer()
        out = []
        for p in [prompts] if isinstance(prompts, (str, dict)) else prompts:
            p = {"prompt": p} if isinstance(p, str) else dict(p)
            ids = p.get("prompt_token_ids")
            if ids is None:
                ids = tokenizer.encode(p["prompt"])
            out.append({**p, "type": "token", "prompt_token_ids": list(ids)})
        return out

    def _render_and_run_requests(self, prompts: Any, params: Any, output_type: Any = None,
                                 lora_requests: Any = None, priorities: Any = None,
                                 use_tqdm: Any = False) -> list[Any]:
        """vLLM's primitive that beam search steps through: these token prompts with these
        params (one each), through `generate`."""
        batch = [TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in prompts]
        loras = list(lora_requests) if lora_requests is not None else None
        return self.generate(batch, list(params), use_tqdm,
                             lora_request=loras if loras and any(loras) else None,
                             priority=list(priorities) if priorities is not None else None)


def refuse_image_embeds(prompts: Any) -> None:
    """vLLM reads a torch.Tensor in `multi_modal_data["image"]` as image embeddings, taken
    only with `enable_mm_embeds=True` (batchgen's own LLM reads it as pixels): a
    ValidationError before any work (batchgen takes no image embeddings)."""
    items = [prompts] if isinstance(prompts, (str, Mapping)) else prompts
    for i, p in enumerate(items if isinstance(items, (list, tuple)) else []):
        data = p.get("multi_modal_data") if isinstance(p, Mapping) else None
        images = data.get("image") if isinstance(data, Mapping) else None
        images = images if isinstance(images, (list, tuple)) else [images]
        if any(isinstance(x, torch.Tensor) for x in images):
            raise ValidationError(
                f"prompts[{i}]['multi_modal_data']['image'] holds a torch.Tensor, which vLLM "
                "reads as image embeddings: they need --enable-mm-embeds "
                "(LLM(enable_mm_embeds=True)), which batchgen does not implement; pass the "
                "image itself (a PIL image, a numpy array, a path or a URL)",
                parameter="prompts")


class _Model:
    """vLLM's `model_runner.model`: only `load_weights` (LLM.load_weights: it also resets the
    prefix cache, which vLLM's callers do next anyway)."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self._llm.load_weights(weights)


def _engine_paths(llm: LLM) -> SimpleNamespace:
    """The attribute chains vLLM scripts use, over this LLM."""
    runner = SimpleNamespace(model=_Model(llm))
    model_config = SimpleNamespace(max_model_len=llm.max_model_len, model=str(llm.model_path),
                                   get_vocab_size=lambda: llm.vocab_size,
                                   max_logprobs=llm.requests.limits.max_logprobs)
    config = _vllm_config(llm, model_config)
    return SimpleNamespace(
        model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
        model_config=model_config, vllm_config=config,
        input_processor=InputProcessor(model_config, config, llm.get_tokenizer()),
        get_tokenizer=llm.get_tokenizer,
        get_num_unfinished_requests=lambda: _unfinished(llm))


def _vllm_config(llm: LLM, model_config: SimpleNamespace) -> SimpleNamespace:
    """vLLM's `llm_engine.vllm_config`: the fields of its cache and scheduler configs that
    batchgen's engine has, as the engine runs them (prefix caching as in effect: off for
    mixers that cannot resume from a snapshot)."""
    s, c = llm.engine.scheduler, llm.cache_config
    cache = SimpleNamespace(block_size=c.block_size, num_gpu_blocks=c.num_blocks,
                            enable_prefix_caching=s.kv.block_manager.enable_prefix_caching,
                            kv_sharing_fast_prefill=False)  # refused at LLM(...)
    sched = SimpleNamespace(max_num_seqs=s.max_num_seqs,
                            max_num_batched_tokens=s.max_num_batched_tokens,
                            max_model_len=llm.max_model_len)
    return SimpleNamespace(model_config=model_config, cache_config=cache,
                           scheduler_config=sched)


def _unfinished(llm: LLM) -> int:
    """Requests queued, running or swapped out (0 between calls: a call that fails frees
    every one)."""
    s = llm.engine.scheduler
    return len(s.waiting) + len(s.running) + len(s.swapped)

"""batchgen's fixture layer for vLLM's offline test files (laid as tests/conftest.py of the
acceptance run by scripts/vllm_acceptance.py; vLLM's own conftest is not used).

- Hub ids the files name are mapped to tiny random models of the same family, written once
  into a throwaway Hugging Face cache (HF_HUB_CACHE), so `vllm.LLM("distilbert/distilgpt2")`
  and `transformers.AutoTokenizer.from_pretrained("distilbert/distilgpt2")` both find them
  offline.
- `import vllm` is batchgen (batchgen.vllm_compat.install()), plus stand-ins for the engine
  internals the files import (vllm_stand_ins.py).
- `torch.accelerator.empty_cache()`, which the files call to clean up after an LLM, does nothing
  on a machine without an accelerator (torch raises there; there is no cache to empty).
- `vllm_runner` / `VllmRunner` run batchgen's LLM, `hf_runner` / `HfRunner` transformers'
  generate, with the result shapes vLLM's test helpers return; `example_prompts` reads vLLM's
  tests/prompts/example.txt.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

HUB = Path(tempfile.mkdtemp(prefix="batchgen-vllm-hub-"))
os.environ["HF_HUB_CACHE"] = str(HUB)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import vllm_stand_ins  # noqa: E402

import batchgen.vllm_compat  # noqa: E402
from batchgen.tools.make_tiny_model import make_tiny_model  # noqa: E402
from batchgen.tools.make_tiny_vlm import make_tiny_vlm  # noqa: E402

# hub id -> the tiny family standing for it
MODELS = {
    "distilbert/distilgpt2": "gpt2", "openai-community/gpt2": "gpt2", "gpt2": "gpt2",
    "meta-llama/Llama-3.2-1B": "llama", "meta-llama/Llama-3.2-1B-Instruct": "llama",
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": "llama",
    "vllm-project/tiny-random-LlamaForCausalLM": "llama", "vllm-project/llama-7b": "llama",
    "Qwen/Qwen3-0.6B": "qwen3", "facebook/opt-125m": "opt",
    "llava-hf/llava-1.5-7b-hf": "llava",  # a vision-language model: batchgen/tools/make_tiny_vlm
}
REV = "0" * 40
# stand-ins whose tests name token ids past 512: Qwen3's prompt_logprob_token_ids tests score
# ids up to 10031 (its real vocabulary has 151936; the rest of the stand-in is as tiny)
VOCAB = {"Qwen/Qwen3-0.6B": 16384}


# vllm-project/tiny-random-LlamaForCausalLM is itself a random model, with Llama's 32000-id
# vocabulary of word pieces: its stand-in has as many ids, the ones past the tiny BPE's as
# plain word tokens, each word mid-text (" w<i>") and opening a text ("w<i>", as
# SentencePiece's pieces tokenize a word alone), so its random text is words, as the real
# one's is
WORD_VOCAB = {"vllm-project/tiny-random-LlamaForCausalLM": 32000}
BPE = 512
# GPT-2's tokenizer adds no BOS (the tiny one adds <s>): an empty prompt stays empty
NO_BOS = {"distilbert/distilgpt2", "openai-community/gpt2", "gpt2"}
# Qwen3's thinking tokens and its template's `enable_thinking` (False: an empty think block
# opens the assistant turn), written here, for chat_template_kwargs
THINKING = {"Qwen/Qwen3-0.6B"}
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _tokenizer(repo_id: str, vocab: int, folder: Path) -> None:
    """The stand-in's tokenizer, where the checkpoint's differs from the tiny BPE's."""
    from tokenizers import AddedToken, processors

    from batchgen.tools.make_tiny_model import build_tokenizer

    if repo_id in WORD_VOCAB:
        tok = copy.deepcopy(build_tokenizer(BPE))
        half = (vocab - BPE) // 2  # each word mid-text (" w<i>") and opening a text
        tok.add_tokens([AddedToken(f"{sp}w{i}", normalized=False)
                        for i in range(half) for sp in (" ", "")])
    elif repo_id in THINKING:
        tok = copy.deepcopy(build_tokenizer(vocab - 2))
        tok.add_tokens(["<think>", "</think>"])
        tok.chat_template = QWEN3_TEMPLATE
    elif repo_id in NO_BOS:
        tok = copy.deepcopy(build_tokenizer(vocab))
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A",
                                                                            pair="$A $B")
    else:
        return
    tok.save_pretrained(folder)
    path = folder / "tokenizer_config.json"  # as make_tiny_model saves it (no unk token)
    cfg = json.loads(path.read_text())
    cfg.setdefault("unk_token", None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _hub_entry(repo_id: str, family: str, seed: int) -> None:
    """A tiny model under `repo_id` in the HF cache's layout (refs/main -> snapshots/REV)."""
    repo = HUB / ("models--" + repo_id.replace("/", "--"))
    # rotary families get a real checkpoint's context (scripts ask for max_model_len=4096)
    longer = {"max_position_embeddings": 8192} if family in ("llama", "qwen3") else {}
    vocab = WORD_VOCAB.get(repo_id) or VOCAB.get(repo_id, BPE)
    if family == "llava":
        made = make_tiny_vlm(HUB / "_made" / repo.name, family=family, seed=seed)
    else:
        made = make_tiny_model(HUB / "_made" / repo.name, family=family, vocab_size=vocab,
                               seed=seed, with_tokenizer=repo_id not in WORD_VOCAB, **longer)
        _tokenizer(repo_id, vocab, made)
    shutil.copytree(made, repo / "snapshots" / REV)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REV)


for _i, (_repo, _family) in enumerate(MODELS.items()):
    _hub_entry(_repo, _family, _i)
if not torch.accelerator.is_available():  # the files' cleanup empties the GPU's cache: this
    torch.accelerator.empty_cache = lambda: None  # CPU run has none (torch raises there)
batchgen.vllm_compat.install()
vllm_stand_ins.install()

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.sampling_params import BeamSearchParams  # noqa: E402

_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float": torch.float32, "float32": torch.float32}


def _dtype(dtype: Any) -> Any:
    return _DTYPES.get(dtype, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype


class VllmRunner:
    """`with VllmRunner(model, **engine_args) as r:` r.llm is batchgen's vllm.LLM; the
    helpers return what vLLM's test runner returns (prompt + output ids and text)."""

    def __init__(self, model_name: str, *, tokenizer_name: str | None = None,
                 max_model_len: int | None = 1024, dtype: Any = "auto", seed: int = 0,
                 trust_remote_code: bool = True, **kwargs: Any) -> None:
        kwargs.pop("swap_space", None)  # vLLM 0.34 has none; its runner may pass one
        self.model = model_name
        self.llm = LLM(model_name, tokenizer=tokenizer_name, max_model_len=max_model_len,
                       dtype=_dtype(dtype), seed=seed, trust_remote_code=trust_remote_code,
                       **kwargs)

    def __enter__(self) -> VllmRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.llm

    def generate(self, prompts: list, sampling_params: Any, return_logprobs: bool = False,
                 **kwargs: Any) -> Any:
        outs = self.llm.generate(prompts, sampling_params=sampling_params, **kwargs)
        pairs, logprobs = [], []
        for o in outs:
            ids = [o.prompt_token_ids + list(s.token_ids) for s in o.outputs]
            pairs.append((ids, [(o.prompt or "") + s.text for s in o.outputs]))
            logprobs.append([*(o.prompt_logprobs or []),
                             *(lp for s in o.outputs for lp in (s.logprobs or []))])
        return (pairs, logprobs) if return_logprobs else pairs

    def generate_w_logprobs(self, prompts: list, sampling_params: Any,
                            include_prompt_token_ids: bool = False, **kwargs: Any) -> list:
        rows = []
        for o in self.llm.generate(prompts, sampling_params=sampling_params, **kwargs):
            s = o.outputs[-1]
            row = (list(s.token_ids), s.text, s.logprobs)
            row += (o.prompt_token_ids,) if include_prompt_token_ids else ()
            if sampling_params.prompt_logprobs is not None:
                row += (o.prompt_logprobs,)
            rows.append(row)
        return rows

    def generate_greedy(self, prompts: list, max_tokens: int, **kwargs: Any) -> list:
        pairs = self.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                              **kwargs)
        return [(ids[0], text[0]) for ids, text in pairs]

    def generate_greedy_logprobs(self, prompts: list, max_tokens: int,
                                 num_logprobs: int | None,
                                 num_prompt_logprobs: int | None = None,
                                 stop_token_ids: list[int] | None = None,
                                 stop: list[str] | None = None, **kwargs: Any) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=num_logprobs,
                                prompt_logprobs=num_prompt_logprobs,
                                stop_token_ids=stop_token_ids, stop=stop)
        return self.generate_w_logprobs(prompts, params, **kwargs)

    def generate_beam_search(self, prompts: list, beam_width: int, max_tokens: int,
                             concurrency_limit: int | None = None) -> list:
        outs = self.llm.beam_search(
            [p if isinstance(p, dict) else {"prompt": p} for p in prompts],
            BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens),
            concurrency_limit=concurrency_limit)
        return [([s.tokens for s in o.sequences],
                 [(p if isinstance(p, str) else "") + s.text for s in o.sequences])
                for p, o in zip(prompts, outs)]


class HfRunner:
    """transformers' model and generate, with vLLM's test-runner result shapes."""

    def __init__(self, model_name: str, dtype: Any = "auto", **kwargs: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_name)
        self.model = AutoModelForCausalLM.from_pretrained(model_name, dtype=_dtype(dtype))
        self.model.eval()

    def __enter__(self) -> HfRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.model

    def _ids(self, prompt: Any) -> torch.Tensor:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, return_tensors="pt").input_ids
        return torch.tensor([list(prompt)])

    def _run(self, prompt: Any, **kw: Any) -> Any:
        with torch.no_grad():
            return self.model.generate(self._ids(prompt), use_cache=True, **kw)

    def generate_greedy(self, prompts: list, max_tokens: int, **kwargs: Any) -> list:
        out = []
        for p in prompts:
            ids = self._run(p, do_sample=False, max_new_tokens=max_tokens)[0].tolist()
            out.append((ids, self.tokenizer.decode(ids, skip_special_tokens=True)))
        return out

    def generate_greedy_logprobs(self, prompts: list, max_tokens: int, **kw: Any) -> list:
        """Per prompt, per generation step, float32 log-probs shaped as vLLM's helper returns
        them: the first step's at every prompt position [prompt_len, V], later ones [1, V]."""
        out = []
        for p in prompts:
            res = self._run(p, do_sample=False, max_new_tokens=max_tokens,
                            return_dict_in_generate=True, output_logits=True)
            with torch.no_grad():
                first = self.model(self._ids(p)).logits[0]
            out.append([torch.log_softmax(x.float(), dim=-1)
                        for x in (first, *res.logits[1:])])
        return out

    def generate_greedy_logprobs_limit(self, prompts: list, max_tokens: int,
                                       num_logprobs: int, **kw: Any) -> list:
        out = []
        for p in prompts:
            n = self._ids(p).shape[1]
            res = self._run(p, do_sample=False, max_new_tokens=max_tokens,
                            return_dict_in_generate=True, output_logits=True)
            ids = res.sequences[0].tolist()
            steps = []
            for x in res.logits:
                lp = torch.log_softmax(x[0].float(), dim=-1)
                top = torch.topk(lp, num_logprobs)
                steps.append(dict(zip(top.indices.tolist(), top.values.tolist())))
            out.append((ids[n:], self.tokenizer.decode(ids[n:]), steps))
        return out

    def generate_beam_search(self, prompts: list, beam_width: int, max_tokens: int) -> list:
        out = []
        pad = self.tokenizer.pad_token_id
        for p in prompts:
            seqs = self._run(p, do_sample=False, max_new_tokens=max_tokens,
                             num_beams=beam_width, num_return_sequences=beam_width).tolist()
            seqs = [[t for t in s if t != pad] for s in seqs]
            out.append((seqs, [self.tokenizer.decode(s, skip_special_tokens=True)
                               for s in seqs]))
        return out


@pytest.fixture(scope="session")
def vllm_runner() -> type[VllmRunner]:
    return VllmRunner


@pytest.fixture(scope="session")
def hf_runner() -> type[HfRunner]:
    return HfRunner


@pytest.fixture
def example_prompts() -> list[str]:
    text = (Path(__file__).parent / "prompts" / "example.txt").read_text()
    return [line for line in text.splitlines() if line]

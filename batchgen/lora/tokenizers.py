"""An adapter's own tokenizer (vLLM's `get_tokenizer(lora_request)`): a PEFT folder that ships
tokenizer files is read with `AutoTokenizer` once; text prompts of a request under it are
tokenized with it (into token ids with the text kept, so nothing tokenizes them again), and its
output side (`TextSide`: output text, stop strings, each `Logprob.decoded_token`) is built
once per folder and given to each of its requests' groups at entry."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.lora.request import LoRARequest
from batchgen.prompts import TokensPrompt
from batchgen.sampling.stop import StopFactory
from batchgen.token_texts import TokenTexts

# any of these in an adapter folder: it ships its own tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class TextSide:
    """How a request's tokens become text under one tokenizer: its stop checkers and output
    decode (`stops`), its logprobs' token texts (`texts`)."""

    tokenizer: Any
    stops: StopFactory
    texts: TokenTexts


class AdapterTokenizers:
    """Adapters' own tokenizers by folder (None: the folder has none), and their text sides."""

    def __init__(self) -> None:
        self.by_path: dict[str, Any] = {}
        self.sides: dict[str, TextSide] = {}

    def side(self, req: Any, eos_token_ids: list[int]) -> TextSide | None:
        """The text side of `req`'s own tokenizer (built once per folder; the base model's
        EOS ids), None when its folder ships no tokenizer (the LLM's side then)."""
        tok = self.of(req, None)
        if tok is None:
            return None
        side = self.sides.get(req.lora_path)
        if side is None or side.tokenizer is not tok:
            side = TextSide(tok, StopFactory(tok, eos_token_ids), TokenTexts(tok))
            self.sides[req.lora_path] = side
        return side

    def of(self, req: Any, base: Any) -> Any:
        """`req`'s adapter tokenizer, else `base` (no request, or no tokenizer files)."""
        if not isinstance(req, LoRARequest) or not req.lora_path:
            return base
        path = req.lora_path
        if path not in self.by_path:
            folder = Path(path)
            own = any((folder / f).is_file() for f in TOKENIZER_FILES)
            if own:
                from transformers import AutoTokenizer

                self.by_path[path] = AutoTokenizer.from_pretrained(folder)
            else:
                self.by_path[path] = None
        return self.by_path[path] or base

    def encode(self, prompts: Any, lora_request: Any) -> Any:
        """`prompts` (one, a list, or any iterable: mapped lazily) with each text prompt whose
        request's adapter has its own tokenizer tokenized by it; everything else as given."""
        each = isinstance(lora_request, (list, tuple))
        if lora_request is None or not each and self.of(lora_request, None) is None:
            return prompts
        if isinstance(prompts, (str, dict)):
            return self._one(prompts, lora_request[0] if each and lora_request else
                             None if each else lora_request)
        mapped = self._map(prompts, lora_request, each)
        return list(mapped) if isinstance(prompts, (list, tuple)) else mapped

    def _map(self, prompts: Iterable[Any], lora_request: Any, each: bool) -> Iterator[Any]:
        for i, p in enumerate(prompts):  # a list by input index (a stream's may grow)
            yield self._one(p, (lora_request[i] if i < len(lora_request) else None)
                            if each else lora_request)

    def _one(self, prompt: Any, req: Any) -> Any:
        tok = self.of(req, None)
        text = prompt.get("prompt") if isinstance(prompt, dict) and set(prompt) == {
            "prompt"} else prompt
        if tok is None or not isinstance(text, str):
            return prompt
        return TokensPrompt(prompt_token_ids=list(tok(text)["input_ids"]), prompt=text)

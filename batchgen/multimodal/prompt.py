"""A prompt with images, processed at request build (before anything is queued): the model's
own HF processor expands the placeholders into token ids; each image's placeholder positions,
its share of the processor's tensors and its key are recorded (`MMPrompt`); an M-RoPE family
gets its prompt positions and decode delta from the model's own `get_rope_index`, once per
request. Every check names the prompt and the key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from batchgen.multimodal.families import VisionFamily, served_names
from batchgen.multimodal.inputs import MODALITIES, as_list, load_image
from batchgen.multimodal.items import ImageItem, MMPrompt

# rope_index(input_ids [1, L], processor outputs) -> (positions [3, 1, L], delta [1, 1])
RopeIndex = Callable[[torch.Tensor, Mapping[str, Any]], tuple[torch.Tensor, torch.Tensor]]


class NoImages:
    """The image side of a model that takes no images: every prompt with images is refused,
    naming the family and why."""

    def __init__(self, family: str, reason: str | None = None) -> None:
        self.family = family
        self.reason = reason  # None: a text-only model

    def process(self, prompt: Mapping[str, Any], name: str
                ) -> tuple[str, list[int], MMPrompt]:
        if self.reason is None:
            raise ValueError(f"{name}['multi_modal_data']: model family {self.family!r} is a "
                             "text-only model; it takes no images")
        raise ValueError(f"{name}['multi_modal_data']: model family {self.family!r} is served "
                         f"for text only; its images are refused: {self.reason}. Served "
                         f"with images: {served_names()}")


class ImagePrompts:
    """Turns prompts with `multi_modal_data` into token ids and their `MMPrompt`, for one
    served family."""

    def __init__(self, processor: Any, family: VisionFamily, image_token_id: int,
                 limit: int, processor_kwargs: Mapping[str, Any] | None = None,
                 rope_index: RopeIndex | None = None, max_chunk: int | None = None,
                 model_key: str = "") -> None:
        self.processor = processor
        self.family = family
        self.image_token_id = image_token_id
        self.limit = limit  # limit_mm_per_prompt["image"]
        self.kwargs = dict(processor_kwargs or {})
        self.rope_index = rope_index
        self.max_chunk = max_chunk  # a bidirectional image must fit one step
        self.model_key = model_key.encode()
        tok = getattr(processor, "tokenizer", None)
        end = family.item_end_token
        self.item_end_id = tok.convert_tokens_to_ids(end) if end and tok is not None else None

    def process(self, prompt: Mapping[str, Any], name: str
                ) -> tuple[str, list[int], MMPrompt]:
        """The prompt's text, its token ids with placeholders expanded, and its images
        (`mm_processor_kwargs` may set add_special_tokens: False for a chat-templated
        text, whose template wrote its own BOS)."""
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError(f"{name}['multi_modal_data'] needs a text 'prompt' (the "
                             "processor expands its image placeholders), got "
                             f"{type(text).__name__}")
        images = self._images(prompt.get("multi_modal_data"), name)
        uuids = self._uuids(prompt.get("multi_modal_uuids"), len(images), name)
        kwargs = {**self.kwargs, **_kwargs(prompt.get("mm_processor_kwargs"), name)}
        try:
            out = self.processor(text=[text], images=[images], return_tensors="pt", **kwargs)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
            raise ValueError(f"{name}: the model's processor refused it ({e})") from e
        ids = out["input_ids"][0]
        runs = self._item_runs(ids, len(images), name)
        tensors = split_tensors(out, self.family.split, [len(r) for r in runs])
        salt = json.dumps(kwargs, sort_keys=True, default=repr).encode() + self.model_key
        items = tuple(ImageItem(_key(t, u, salt), np.concatenate(r), t)
                      for t, u, r in zip(tensors, uuids, runs))
        mm = MMPrompt(items, bidirectional=self.family.bidirectional)
        if self.family.bidirectional and self.max_chunk is not None:
            if mm.longest_image > self.max_chunk:
                raise ValueError(f"{name} has an image of {mm.longest_image} tokens; "
                                 f"{self.family.name} computes each image in one step, so "
                                 f"max_num_batched_tokens ({self.max_chunk}) must hold it")
        if self.family.mrope and self.rope_index is not None:
            pos, delta = self.rope_index(out["input_ids"], out)
            mm = MMPrompt(items, pos[:, 0].cpu().numpy().astype(np.int64),
                          int(delta.reshape(-1)[0]), mm.bidirectional)
        return text, ids.tolist(), mm

    def _images(self, data: Any, name: str) -> list[Any]:
        """The prompt's images, read and checked against the limit."""
        where = f"{name}['multi_modal_data']"
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a dict such as {{'image': image}}, got "
                             f"{type(data).__name__}")
        bad = [k for k in data if k not in MODALITIES]
        if bad:
            raise ValueError(f"{where} has key {bad[0]!r}, which batchgen does not act on; "
                             f"allowed: {', '.join(MODALITIES)}")
        raw = as_list(data.get("image", []))
        if not raw:
            raise ValueError(f"{where}['image'] holds no image")
        if len(raw) > self.limit:
            raise ValueError(f"{where}['image'] has {len(raw)} images; limit_mm_per_prompt "
                             f"allows {self.limit} (raise LLM(limit_mm_per_prompt="
                             f"{{'image': {len(raw)}}}))")
        many = isinstance(data["image"], (list, tuple))
        return [load_image(x, f"{where}['image']" + (f"[{i}]" if many else ""))
                for i, x in enumerate(raw)]

    @staticmethod
    def _uuids(value: Any, n: int, name: str) -> list[str | None]:
        """The user's cache keys of the images (None: hash the pixels)."""
        if value is None:
            return [None] * n
        where = f"{name}['multi_modal_uuids']"
        if not isinstance(value, Mapping) or set(value) - set(MODALITIES):
            raise ValueError(f"{where} must be a dict {{'image': uuid | [uuids]}}, got "
                             f"{value!r}")
        uuids = as_list(value.get("image", [None] * n))
        if len(uuids) != n or not all(u is None or isinstance(u, str) for u in uuids):
            raise ValueError(f"{where}['image'] must be {n} str (or None) keys, one per "
                             f"image, got {uuids!r}")
        return uuids

    def _item_runs(self, ids: torch.Tensor, n: int, name: str) -> list[list[np.ndarray]]:
        """Each image's placeholder runs (arrays of positions); ValueError when they do not
        make exactly `n` images."""
        arr = ids.numpy()
        pos = np.flatnonzero(arr == self.image_token_id)
        runs = np.split(pos, np.flatnonzero(np.diff(pos) > 1) + 1) if len(pos) else []
        items: list[list[np.ndarray]] = []
        current: list[np.ndarray] = []
        for run in runs:
            current.append(run)
            ends = self.item_end_id is None or arr[max(int(run[0]) - 1, 0)] == self.item_end_id
            if ends:
                items.append(current)
                current = []
        if current or len(items) != n:
            raise ValueError(f"{name}: the processor made {len(items)} image placeholder "
                             f"group(s) for {n} image(s); write one image placeholder per "
                             "image in the prompt (or leave it to the chat template)")
        return items


def split_tensors(out: Mapping[str, Any], split: Mapping[str, str], runs: list[int]
                  ) -> list[dict[str, torch.Tensor]]:
    """Each image's share of the processor outputs named in `split` (families.SPLITS):
    leading rows per image, dim-1 tiles per image (one per placeholder run), or Qwen-VL's
    flattened patches (prod(image_grid_thw[i]) rows per image)."""
    n = len(runs)
    per: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for key, how in split.items():
        t = out.get(key)
        if t is None:
            continue
        if how == "images":
            parts = [t[i:i + 1] for i in range(n)]
        elif how == "tiles":
            parts = list(torch.split(t, runs, dim=1))
        else:  # patches
            counts = out["image_grid_thw"].prod(-1).tolist()
            parts = list(torch.split(t, counts, dim=0))
        for item, part in zip(per, parts):
            item[key] = part.contiguous()
    return per


def _key(tensors: Mapping[str, torch.Tensor], uuid: str | None, salt: bytes) -> bytes:
    """An image's key: the user's uuid, else a hash of its processed tensors; with the
    processor kwargs and the model folded in."""
    h = hashlib.blake2b(salt, digest_size=16)
    if uuid is not None:
        h.update(b"uuid:" + uuid.encode())
        return h.digest()
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def _kwargs(value: Any, name: str) -> dict[str, Any]:
    """A prompt's mm_processor_kwargs (a dict, or None)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name}['mm_processor_kwargs'] must be a dict of keyword "
                         f"arguments, got {type(value).__name__}")
    return dict(value)

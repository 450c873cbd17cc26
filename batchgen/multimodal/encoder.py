"""Image features from the model's own `get_image_features`, each image encoded once: the
images a step needs and the cache lacks are encoded together (batched across requests,
one call per step), and kept in an LRU cache by image key within a byte budget. The
entries a step uses are held until it is done, so one step's images are always all there
(an image larger than the budget is used and dropped). Preemption by recompute, a prefix
miss or another request with the same image read the cache before encoding again; features
of other weights are never read (the cache empties when the weights change)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from batchgen.model.shared import weights_version
from batchgen.multimodal.families import VisionFamily
from batchgen.multimodal.items import ImageItem

# The encoder cache's default budget (features of many images; a real 7B VLM's image of
# 1280 tokens x 3584 bf16 is 9 MiB).
ENCODER_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Features:
    """One image's feature rows ([k, hidden], one per placeholder) and, for DeepStack
    families, the rows added at each of the decoder's first layers."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


class EncoderCache:
    """Features by image key, least recently used first out once over `budget` bytes;
    `hold` keys are never dropped (the step's own)."""

    def __init__(self, budget: int = ENCODER_CACHE_BYTES) -> None:
        self.budget = budget
        self.entries: OrderedDict[bytes, Features] = OrderedDict()
        self.nbytes = 0
        self.encoded = 0  # images encoded (a miss each)
        self.hits = 0

    def get(self, key: bytes) -> Features | None:
        feats = self.entries.get(key)
        if feats is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        return feats

    def put(self, key: bytes, feats: Features, hold: set[bytes]) -> None:
        """Keep `feats`, dropping the least recently used others while over budget."""
        self.entries[key] = feats
        self.nbytes += feats.nbytes
        self.encoded += 1
        for old in list(self.entries):
            if self.nbytes <= self.budget:
                break
            if old not in hold:
                self.nbytes -= self.entries.pop(old).nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


class VisionEncoder:
    """Runs the model's `get_image_features` on the images a step needs."""

    def __init__(self, model: torch.nn.Module, family: VisionFamily, device: torch.device,
                 dtype: torch.dtype, budget: int = ENCODER_CACHE_BYTES) -> None:
        self.model = model
        self.family = family
        self.device = device
        self.dtype = dtype
        self.cache = EncoderCache(budget)
        self.version = weights_version(model)

    def features(self, items: Iterable[ImageItem]) -> dict[bytes, Features]:
        """Every item's features; those the cache lacks are encoded in one call. New weights
        (load_weights, a trainer's step) empty the cache first."""
        if (version := weights_version(self.model)) != self.version:
            self.cache.clear()
            self.version = version
        wanted = {item.key: item for item in items}
        out = {k: f for k in wanted if (f := self.cache.get(k)) is not None}
        missing = [item for key, item in wanted.items() if key not in out]
        if missing:
            for item, feats in zip(missing, self.encode(missing)):
                self.cache.put(item.key, feats, set(wanted))
                out[item.key] = feats
        return out

    @torch.inference_mode()
    def encode(self, items: list[ImageItem]) -> list[Features]:
        """The model's own image features of these items, split per item."""
        batch = {k: self._to_device(torch.cat(_padded([it.tensors[k] for it in items])))
                 for k in items[0].tensors}
        tower = getattr(self.model, "model", self.model)
        result = tower.get_image_features(**batch, return_dict=True)
        counts = [it.num_tokens for it in items]
        embeds = _rows(result.pooler_output)
        if embeds.shape[0] != sum(counts):
            raise RuntimeError(f"model family {self.family.name!r}: get_image_features gave "
                               f"{embeds.shape[0]} feature rows for {sum(counts)} "
                               "placeholder tokens")
        deep = [torch.split(_rows(layer), counts)
                for layer in (getattr(result, "deepstack_features", None) or ())]
        return [Features(e, tuple(layer[i] for layer in deep))
                for i, e in enumerate(torch.split(embeds, counts))]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """On the model's device; pixel values in the model's dtype."""
        return t.to(self.device, self.dtype if t.is_floating_point() else t.dtype)


def _padded(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors zero-padded to one shape past dim 0 (tiles or patches a processor pads
    per batch: the models drop all-zero ones)."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    out = []
    for t in tensors:
        pad = [p for d in reversed(range(1, t.dim())) for p in (0, shape[d - 1] - t.shape[d])]
        out.append(F.pad(t, pad) if any(pad) else t)
    return out


def _rows(value: Any) -> torch.Tensor:
    """Feature rows [N, hidden] from a list/tuple of per-image tensors or one tensor."""
    if isinstance(value, (list, tuple)):
        value = torch.cat([v.reshape(-1, v.shape[-1]) for v in value])
    return value.reshape(-1, value.shape[-1])

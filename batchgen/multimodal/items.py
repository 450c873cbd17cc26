"""A request's image side once its prompt is processed: each image's placeholder positions,
its own share of the processor's tensors and a key naming it (for the encoder cache and the
prefix cache), plus what the decoder needs per request (M-RoPE positions and delta; whether
attention inside an image is bidirectional). Made by the request builder, read by the engine
(prefix hashes, chunk cuts, the rope delta column) and the runner (features, positions)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a prompt: its key (a hash of its processed pixels, or the user's uuid,
    with the processor kwargs), its placeholder token positions in the prompt (sorted) and
    the processor's tensors for it alone (what `get_image_features` takes)."""

    key: bytes
    positions: np.ndarray  # [k] int64: the prompt positions its k feature rows fill
    tensors: dict[str, torch.Tensor]

    @property
    def start(self) -> int:
        return int(self.positions[0])

    @property
    def end(self) -> int:
        """One past its last placeholder."""
        return int(self.positions[-1]) + 1

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass(frozen=True, eq=False)
class MMPrompt:
    """A prompt's images in prompt order, and its decoder-side extras."""

    items: tuple[ImageItem, ...]
    mrope: np.ndarray | None = None  # [3, L] int64 prompt positions (M-RoPE families)
    rope_delta: int = 0  # decode position = cache position + rope_delta (M-RoPE)
    bidirectional: bool = False  # attention inside each image sees the whole image

    def block_key(self, block: int, block_size: int) -> bytes:
        """What a prefix-cache hash of block `block` adds for the images it overlaps: each
        one's key and offset from the block's start (b"" when it overlaps none), so the
        same tokens with another image never share a block."""
        lo, hi = block * block_size, (block + 1) * block_size
        parts = [item.key + (item.start - lo).to_bytes(8, "little", signed=True)
                 for item in self.items if item.start < hi and item.end > lo]
        return b"".join(parts)

    def overlapping(self, start: int, end: int) -> list[tuple[ImageItem, int, int]]:
        """The images with placeholders in positions [start, end), each with the range
        [lo, hi) of its feature rows those positions take."""
        out = []
        for item in self.items:
            if item.start < end and item.end > start:
                lo, hi = np.searchsorted(item.positions, (start, end))
                if hi > lo:
                    out.append((item, int(lo), int(hi)))
        return out

    def cut(self, start: int, n: int) -> int:
        """The longest chunk [start, start + m), m <= n, whose end falls inside no
        bidirectional image (its queries would need keys not computed yet); 0 when the
        image at `start` does not fit in `n`. Any chunk when attention is causal."""
        if not self.bidirectional:
            return n
        end = start + n
        for item in self.items:
            if item.start < end < item.end:
                return max(item.start - start, 0)
        return n

    @property
    def longest_image(self) -> int:
        """The most placeholder tokens one image spans (a bidirectional one is computed in
        one chunk)."""
        return max((item.end - item.start for item in self.items), default=0)

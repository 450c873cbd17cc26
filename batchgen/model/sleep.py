"""Sleep mode (vLLM's `sleep` / `wake_up`): give the memory of an idle engine back to the
process it shares (a trainer between rollouts), and take it again.

Level 1 frees the KV pool (and a hybrid's mixer-state pool) and offloads the weights batchgen loaded to CPU RAM (on the CPU
they stay where they are); level 2 frees the pool and discards those weights (the caller
sends new ones with `load_weights` after `wake_up(tags=["weights"])`). A shared model's
weights (`LLM(model=<module>)`) are the caller's and are never touched. Under tensor
parallelism each rank frees its own shards (a DTensor stays; its local tensor's memory goes).
The pool's storage is resized in place, so every view of it (per-layer views, backends) stays
valid; its contents are gone, so the caller resets the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from batchgen.checks import check, check_choice
from batchgen.kv.cache import KVCache
from batchgen.state.pool import StatePool

KV_CACHE, WEIGHTS = "kv_cache", "weights"
TAGS = (WEIGHTS, KV_CACHE)


class SleepState:
    """What is asleep, and what it takes to wake it: the pool's byte size, the weights'
    shapes (or their CPU copies at level 1)."""

    def __init__(self, cache: KVCache, model: torch.nn.Module, owns_weights: bool,
                 state: StatePool | None = None) -> None:
        self.cache = cache
        self.state = state  # a hybrid's mixer state: freed and restored with the KV pool
        self.model = model
        self.owns_weights = owns_weights
        self.asleep: set[str] = set()
        # the pool's tensors (one, or K and V apart when their widths differ) and their bytes
        self._pool_bytes = [t.untyped_storage().nbytes() for t in cache.tensors]
        # each weight asleep (a Parameter, or a DTensor's local shard): its shape, and its CPU
        # copy at level 1 (None: discarded)
        self._weights: dict[torch.Tensor, tuple[torch.Size, torch.Tensor | None]] = {}

    def sleep(self, level: int) -> None:
        """Free the pool; offload (1) or discard (2) the weights batchgen owns."""
        check_choice(level, "level", (1, 2))
        if KV_CACHE not in self.asleep:
            for t in self.cache.tensors:
                t.untyped_storage().resize_(0)
            if self.state is not None:
                self.state.release()
            self.asleep.add(KV_CACHE)
        if not self.owns_weights or WEIGHTS in self.asleep:
            return
        device = next(self.model.parameters()).device
        if level == 1 and device.type == "cpu":
            return  # offloading to CPU RAM from CPU RAM frees nothing
        for p in map(own_memory, self.model.parameters()):  # tied weights are one Parameter
            self._weights[p] = (p.data.shape, p.data.to("cpu") if level == 1 else None)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.asleep.add(WEIGHTS)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what `tags` name (both when None): the pool (zeroed) and the weights (their
        offloaded values, or zeros to be overwritten by load_weights)."""
        check(tags is None or (not isinstance(tags, str) and all(t in TAGS for t in tags)),
              "tags", f"None or a list of {TAGS}", tags)
        tags = list(TAGS if tags is None else tags)
        if KV_CACHE in tags and KV_CACHE in self.asleep:
            for t, nbytes in zip(self.cache.tensors, self._pool_bytes):
                t.untyped_storage().resize_(nbytes)
                t.zero_()
            if self.state is not None:
                self.state.restore()
            self.asleep.discard(KV_CACHE)
        if WEIGHTS in tags and WEIGHTS in self.asleep:
            for p, (shape, saved) in self._weights.items():
                p.data = (saved.to(p.device) if saved is not None else
                          torch.zeros(shape, dtype=p.dtype, device=p.device))
            self._weights.clear()
            self.asleep.discard(WEIGHTS)

    def check_awake(self, weights_only: bool = False) -> None:
        """RuntimeError when a call would need what is asleep (the weights only: loading)."""
        asleep = self.asleep & {WEIGHTS} if weights_only else self.asleep
        if asleep:
            tags = sorted(asleep)
            raise RuntimeError(f"this LLM's {' and '.join(tags)} are asleep: call "
                               f"wake_up(tags={tags}) first")


def own_memory(p: torch.Tensor) -> torch.Tensor:
    """The tensor holding `p`'s memory on this rank: a tensor-parallel DTensor's local shard
    (its `to_local()` is a fresh view for a Parameter since torch 2.13, and a CPU shard read
    from safetensors is a memory map whose storage cannot be resized: swapping the local
    tensor's data is the one way to free it), else `p` itself."""
    return p._local_tensor if hasattr(p, "to_local") else p  # type: ignore[attr-defined]

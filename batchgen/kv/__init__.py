"""The paged KV cache: the BlockManager's bookkeeping and the KVCache pool it indexes."""

from batchgen.kv.block_manager import BlockManager, PoolExhausted, blocks_for, slot_of
from batchgen.kv.cache import KVCache, kv_cache_bytes

__all__ = ["BlockManager", "PoolExhausted", "KVCache", "blocks_for", "kv_cache_bytes", "slot_of"]

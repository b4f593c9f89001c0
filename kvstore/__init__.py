"""Paged KV memory: the block pool, who owns which blocks, and the KV tensors themselves."""

from kvstore.block_manager import BlockManager
from kvstore.block_pool import Block, BlockPool
from kvstore.kv_cache import KVCache, KVCacheSpec, LayerKV
from kvstore.slots import batch_slots, token_slots

__all__ = ["Block", "BlockManager", "BlockPool", "KVCache", "KVCacheSpec", "LayerKV", "batch_slots", "token_slots"]

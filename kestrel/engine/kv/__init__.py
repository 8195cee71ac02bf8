"""Paged KV-cache bookkeeping, pure Python (the tensors live in the runner): the block pool (pool.py), one
manager per KV-cache group and the spec -> manager table (managers.py), and the coordinator over them
(coordinator.py)."""
from kestrel.engine.kv.coordinator import KVCacheManager
from kestrel.engine.kv.managers import MANAGERS, FullAttentionManager, KVManager, SlidingWindowManager, manager_class
from kestrel.engine.kv.pool import NULL_BLOCK_ID, BlockPool, KVBlock, hash_block

__all__ = ["MANAGERS", "NULL_BLOCK_ID", "BlockPool", "FullAttentionManager", "KVBlock", "KVCacheManager",
           "KVManager", "SlidingWindowManager", "hash_block", "manager_class"]

"""Residency: where each adapter version's weights are on this replica, tier by tier.

- manager.py: `ResidencyManager`, the one owner of the tiers below; its `make_resident` is
  the only way into the pool, for the sync and admission alike (the seam: its docstring)
- slots.py: the slot map (which slot holds which adapter version: fills, LRU eviction, pins,
  the fairness rule), pure bookkeeping
- pool.py (+ pool_ops.py, slot_digest.py): the device tier, the JAX LoRA memory pool
- host_tier.py: parsed weights, LRU within a byte bound, and the worker that fetches and
  parses misses into it beside decode
- blob_cache.py (+ direct_write.py): the verified on-disk blob cache, fetched from peers or
  statesvc by sha256, written past the page cache; the parse of a blob into slot weights

This package imports nothing at import time, so that the model and the backends can import
the pool's types.
"""

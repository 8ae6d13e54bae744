"""Sharded (FSDP2) training helpers: per-layer ``fully_shard``, load-time sharding settings, full state dicts."""

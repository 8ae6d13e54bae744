"""Per-rank memory and per-step communication of a training layout, verified against the real sharding on the meta
device, and the ``kimi-k3-plan`` command."""

"""Stand-in for flash-linear-attention (fla-core 0.6): only ``fla.ops.kda``. See ``tests/stand_ins/README.md``."""

"""Per-Head Muon (Muon with per-head and per-expert Newton–Schulz blocks, AdamW for the rest), its Newton–Schulz
split across ranks, and the matmul precision it picks for the device."""

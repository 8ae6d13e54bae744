"""Quantization-aware training: the routed experts trained as they ship (MXFP4 weights, optionally MXFP8 inputs)."""

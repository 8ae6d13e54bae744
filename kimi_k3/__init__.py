"""Training-side library for Kimi K3 models: balancing, optimizers, data and training entry points.

The model itself lives in the flat modules ``configuration_kimi_k3`` / ``modeling_kimi_k3`` so that the very
same files can be copied into checkpoint folders for ``trust_remote_code``.
"""

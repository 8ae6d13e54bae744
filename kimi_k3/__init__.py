"""Training-side library for Kimi K3 models: balancing, optimizers, data and training entry points.

The model itself lives in the flat modules ``configuration_kimi_k3`` / ``modeling_kimi_k3`` so that the very
same files can be copied into checkpoint folders for ``trust_remote_code``.
"""

from configuration_kimi_k3 import SUPPORTED_TRANSFORMERS, installed_transformers, transformers_is_supported

if not transformers_is_supported():
    raise ImportError(
        f"kimi_k3 supports transformers {SUPPORTED_TRANSFORMERS}, but {installed_transformers()} is installed: "
        f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
    )

"""Resource bounds checked before allocation: a model the machine cannot hold is refused in one line naming the config
field that makes it large, instead of dying of a MemoryError (or the kernel's OOM killer) minutes later."""

import torch

from checkpoint_format_kimi_k3 import available_memory_bytes
from configuration_kimi_k3 import KimiK3Config
from kimi_k3.job.arguments import UsageError
from variants_kimi_k3 import causal_lm_class


def check_model_fits_memory(config: KimiK3Config, source: str) -> None:
    """Build the model on the meta device (no memory) and compare its parameters and buffers with what this process
    may allocate; ``source`` names where the config came from."""
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    needed = sum(tensor.numel() * tensor.element_size() for _, tensor in tensors)
    available = available_memory_bytes()
    if available is None or needed <= available:
        return
    largest = max(tensors, key=lambda item: item[1].numel())[0]
    raise UsageError(
        f"{source}: the model needs about {needed / 2**30:,.1f} GiB for its weights alone, more than the "
        f"{available / 2**30:,.1f} GiB of memory available; its largest tensors ({largest}) grow with "
        f"{governing_field(largest)}"
    )


def governing_field(tensor_name: str) -> str:
    """The config field that sets the leading size of the tensor ``tensor_name``."""
    if ".experts." in tensor_name or ".gate." in tensor_name:
        return "num_experts"
    if "embed_tokens" in tensor_name or "lm_head" in tensor_name:
        return "vocab_size"
    return "hidden_size and num_hidden_layers"

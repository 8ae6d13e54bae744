"""Resource bounds checked before allocation: a model the machine cannot hold is refused in one line naming the config
field that makes it large, instead of dying of a MemoryError (or the kernel's OOM killer) minutes later."""

from pathlib import Path

import psutil
import torch

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
    if needed <= available:
        return
    largest = max(tensors, key=lambda item: item[1].numel())[0]
    raise UsageError(
        f"{source}: the model needs about {needed / 2**30:,.1f} GiB for its weights alone, more than the "
        f"{available / 2**30:,.1f} GiB of memory available; its largest tensors ({largest}) grow with "
        f"{governing_field(largest)}"
    )


def available_memory_bytes() -> int:
    """What this process may still allocate: the least of the free memory, the address-space limit (``ulimit -v``)
    and the cgroup's limit, which is read by hand because psutil reports the host's memory inside a container."""
    limits = [psutil.virtual_memory().available]
    try:
        import resource  # Unix only

        address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
        limits += [] if address_space == resource.RLIM_INFINITY else [address_space]
    except ImportError:
        pass
    try:
        cgroup_limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        cgroup_limit = ""
    return min(limits + ([int(cgroup_limit)] if cgroup_limit.isdigit() else []))


def governing_field(tensor_name: str) -> str:
    """The config field that sets the leading size of the tensor ``tensor_name``."""
    if ".experts." in tensor_name or ".gate." in tensor_name:
        return "num_experts"
    if "embed_tokens" in tensor_name or "lm_head" in tensor_name:
        return "vocab_size"
    return "hidden_size and num_hidden_layers"

"""Finding NaN and infinity in weights, in memory or in safetensors shards (read one tensor at a time)."""

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open


def first_non_finite(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int] | None:
    """The first floating-point tensor holding NaN or infinity, with how many such values; None when all are finite."""
    for name, tensor in named_tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and local.device.type != "meta":
            finite = torch.isfinite(local.detach())
            if not bool(finite.all()):
                return name, int((~finite).sum())
    return None


def shard_tensors(shard_files: list[str]) -> Iterable[tuple[str, torch.Tensor]]:
    for path in shard_files:
        with safe_open(path, framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)


def check_finite_files(shard_files: list[str], what: str) -> None:
    """Refuse ``what`` (a folder, named by its flag) whose stored weights hold NaN or infinity."""
    found = first_non_finite(shard_tensors(shard_files))
    if found is not None:
        name, count = found
        raise ValueError(
            f"{what}: tensor {name} in {Path(shard_files[0]).parent} holds {count} non-finite value(s) (NaN or "
            "infinity); use a folder saved before the run diverged"
        )

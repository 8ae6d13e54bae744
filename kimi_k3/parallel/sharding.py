"""Sharded (FSDP2) training of Kimi K3: per-layer ``fully_shard``, sharded loading, full state dicts.

Data-parallel training (DDP through ``Trainer``/``accelerate``) needs nothing from this module: the model keeps its
router statistics in buffers, so ``TrainingArguments(ddp_broadcast_buffers=False)`` plus the one SUM all-reduce of
Quantile Balancing keep every rank's bias identical.

FSDP2 stores every parameter as a ``DTensor`` sharded along dim 0. :class:`~kimi_k3.optim.muon.PerHeadMuon` (and so
``PerHeadMuonFactory`` in ``Trainer``) takes such parameters as they are: it orthogonalises the blocks inside each
rank's shard there and exchanges only the blocks a shard boundary cuts (:mod:`kimi_k3.optim.split_newton_schulz`), also
under expert parallelism; QK-Clip scales the rows of each rank's shard.

Two ways to shard: :func:`shard_decoder_layers` on a model built in memory (what ``accelerate``'s FSDP2 plugin does
on GPUs with ``configs/accelerate_fsdp2.yaml``), or transformers' own sharding while loading a saved model,
``from_pretrained(path, distributed_config=sharded_loading_config(...))``, which also offers expert parallelism and
runs on CPU processes too; ``Trainer`` then trains the sharded model as it is.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers.distributed import DistributedConfig


def shard_decoder_layers(model: nn.Module, mesh: DeviceMesh | None = None, **fully_shard_kwargs) -> nn.Module:
    """FSDP2 per decoder layer: ``fully_shard`` each layer, then the root (embeddings, final norms, ``lm_head``).

    One layer's parameters are gathered at a time in forward and backward. Router buffers (bias, statistics) are
    not sharded: every rank keeps a full copy, as Quantile Balancing needs. ``mesh`` defaults to all ranks on the
    device the model's parameters are on (see :func:`mesh_device_type`); ``fully_shard_kwargs`` go to every
    ``fully_shard`` call.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard_decoder_layers needs torch.distributed; call dist.init_process_group() first")
    if mesh is None:
        mesh = init_device_mesh(mesh_device_type(model), (dist.get_world_size(),))
    for layer in model.base_model.layers:
        fully_shard(layer, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model


def mesh_device_type(model: nn.Module) -> str:
    """Where the model's parameters are; for a model on the meta device (built to be materialised after sharding),
    the accelerator only where one is actually usable. torch's CUDA builds, which the package index also serves to
    machines without a GPU, name ``cuda`` as their accelerator even there, and a CUDA mesh then fails on the driver."""
    device = next(model.parameters()).device
    if device.type != "meta":
        return device.type
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator.type if accelerator is not None else "cpu"


def sharded_loading_config(fsdp_size: int, expert_parallel_size: int = 1) -> DistributedConfig:
    """``DistributedConfig`` for ``KimiK3ForCausalLM.from_pretrained``: FSDP2 per decoder layer over ``fsdp_size``
    ranks, experts split over ``expert_parallel_size`` of them (which must divide ``fsdp_size``), by the plans the
    config class carries (``KimiK3Config.base_model_ep_plan``).

    ``Trainer`` refuses to checkpoint the optimizer state of such a model: pass ``save_only_model=True``.
    """
    return DistributedConfig(fsdp_size=fsdp_size, ep_size=expert_parallel_size)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (parameters and persistent buffers) on CPU, on rank 0 only (other ranks get ``{}``).

    A collective: every rank must call it. Gathering to one rank bounds the host memory to one model copy.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (e.g. of a single-process checkpoint) into a model, sharded or not; strict.

    ``nn.Module.load_state_dict`` cannot copy plain tensors into FSDP2's ``DTensor`` parameters; this keeps each
    rank's shard of every tensor. Every rank passes the full state dict.
    """
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def save_pretrained_full(model, save_directory) -> None:
    """Write a sharded model as an ordinary ``save_pretrained`` folder that loads in a single process.

    Every rank must call it (the state dict is gathered); only rank 0 writes.
    """
    state_dict = full_state_dict(model)
    if dist.get_rank() == 0:
        model.save_pretrained(save_directory, state_dict=state_dict)
    dist.barrier()

"""What a launch actually runs: the parallelism and autocast accelerate chose, said once at the start and recorded in
the card. accelerate shards with FSDP only on GPUs: CPU processes launched with an FSDP config train with DDP."""

import os

from accelerate.utils import DistributedType

# `accelerate launch` sets this for its workers when the config asks for FSDP.
FSDP_REQUESTED = "ACCELERATE_USE_FSDP"


def describe_parallelism(trainer) -> str:
    """How the Trainer's processes share the model, e.g. ``DDP over 2 CPU processes (gloo), each holding the whole
    model``."""
    processes, device = trainer.args.world_size, trainer.args.device.type.upper()
    if trainer.is_fsdp_enabled:
        return f"FSDP{trainer.accelerator.state.fsdp_plugin.fsdp_version} over {processes} {device} processes"
    if trainer.accelerator.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        backend = trainer.accelerator.state.backend
        return f"DDP over {processes} {device} processes ({backend}), each holding the whole model"
    return f"one {device} process"


def describe_autocast(trainer) -> str:
    precision = trainer.accelerator.mixed_precision
    return "none (fp32 compute)" if precision == "no" else f"{precision} autocast"


def announce_parallelism(trainer) -> None:
    """One line, on the main process, when the launch asked for FSDP and accelerate runs something else."""
    requested = os.environ.get(FSDP_REQUESTED, "false").lower() == "true"
    if requested and not trainer.is_fsdp_enabled and trainer.is_world_process_zero():
        print(
            f"kimi-k3-train: warning: the accelerate config asks for FSDP, which accelerate runs on GPUs only: this "
            f"run trains with {describe_parallelism(trainer)}, under {describe_autocast(trainer)}"
        )

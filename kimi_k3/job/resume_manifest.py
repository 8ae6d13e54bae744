"""What a resumed checkpoint must hold besides the model, checked before anything is built from it.

Trainer restores the optimizer and the learning-rate schedule only when both ``optimizer.pt`` and ``scheduler.pt``
exist, and the RNG state only when ``rng_state.pth`` does; otherwise it starts them afresh with one log line at
info level, so the learning rate jumps back to its peak and the run silently differs from an uninterrupted one.
Corrupt files would surface as raw torch or JSON tracebacks deep inside ``Trainer.train``.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_pt_utils import safe_globals

REINITIALIZE_FLAG = "--reinitialize_missing_trainer_state"
# The fields a resumed job reads from trainer_state.json, and their JSON types.
TRAINER_STATE_FIELDS = {"global_step": int, "max_steps": int, "log_history": list, "stateful_callbacks": dict}


class CheckpointFileError(ValueError):
    """A file of the resumed checkpoint is missing or cannot be read; its message names the file."""


def rng_state_names(training_args: TrainingArguments) -> list[str]:
    """Trainer's names: one file per process in a distributed run."""
    if training_args.world_size > 1:
        return [f"rng_state_{rank}.pth" for rank in range(training_args.world_size)]
    return ["rng_state.pth"]


def has_optimizer_state(checkpoint: Path) -> bool:
    """``optimizer.pt``, accelerate's ``optimizer.bin``, or an FSDP ``optimizer_*`` folder, as Trainer looks for."""
    if (checkpoint / OPTIMIZER_NAME).is_file() or (checkpoint / OPTIMIZER_NAME_BIN).is_file():
        return True
    return any(path.is_dir() and path.name.startswith("optimizer") for path in checkpoint.iterdir())


def missing_state_files(checkpoint: Path, training_args: TrainingArguments) -> list[str]:
    missing = [] if has_optimizer_state(checkpoint) else [OPTIMIZER_NAME]
    missing += [name for name in (SCHEDULER_NAME, *rng_state_names(training_args)) if not (checkpoint / name).is_file()]
    return missing


def check_trainer_files(checkpoint: str, training_args: TrainingArguments, reinitialize_missing: bool) -> None:
    """Refuse a checkpoint whose optimizer, schedule or RNG state is missing (or, with the flag, announce that they
    start afresh), and any Trainer file that cannot be read, naming it."""
    folder = Path(checkpoint)
    check_trainer_state(folder / TRAINER_STATE_NAME)
    missing = missing_state_files(folder, training_args)
    if missing and not reinitialize_missing:
        raise CheckpointFileError(
            f"--resume_from_checkpoint {checkpoint} has no {', '.join(missing)}: resuming would restart the optimizer "
            "moments, the learning-rate schedule or the random state, so the run would not continue the original "
            f"one; resume from a complete checkpoint, or pass {REINITIALIZE_FLAG} to start them afresh"
        )
    if missing:
        only_rng = set(missing) <= set(rng_state_names(training_args))
        restarted = "the random state" if only_rng else "the optimizer and the learning-rate schedule"
        print(
            f"kimi-k3-train: warning: {checkpoint} has no {', '.join(missing)}; starting {restarted} afresh "
            f"({REINITIALIZE_FLAG}), so the run differs from an uninterrupted one",
            file=sys.stderr,
        )
    for name in (SCHEDULER_NAME, *rng_state_names(training_args)):
        if (folder / name).is_file():
            check_torch_file(folder / name)


def check_trainer_state(path: Path) -> None:
    """trainer_state.json as Trainer wrote it: valid JSON with the fields a resumed job reads."""
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointFileError(f"{path} cannot be read: {first_line(error)}") from None
    if not isinstance(state, dict):
        raise CheckpointFileError(f"{path} must hold a JSON object, got {type(state).__name__}")
    for field, kind in TRAINER_STATE_FIELDS.items():
        if not isinstance(state.get(field), kind) or isinstance(state.get(field), bool):
            raise CheckpointFileError(
                f"{path}: field {field!r} must be a JSON {kind.__name__}, got {state.get(field)!r:.60}; "
                "it is not a checkpoint written by transformers' Trainer"
            )
    if "TrainerControl" not in state["stateful_callbacks"]:
        raise CheckpointFileError(f"{path}: 'stateful_callbacks' lacks 'TrainerControl', which Trainer saves with it")
    try:
        TrainerState(**state)
    except TypeError as error:
        raise CheckpointFileError(f"{path}: {first_line(error)}") from None


def check_torch_file(path: Path) -> None:
    """The scheduler and RNG states are small: load them once to learn whether Trainer can."""
    try:
        with safe_globals():
            torch.load(path, weights_only=True)
    except Exception as error:  # torch reports a corrupt zip, a bad pickle or a truncated file in many classes
        raise CheckpointFileError(f"{path} cannot be loaded (corrupt or truncated?): {first_line(error)}") from None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

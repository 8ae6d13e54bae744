"""What a resumed checkpoint must hold besides the model, checked before anything is built from it.

Trainer restores the optimizer and the learning-rate schedule only when both ``optimizer.pt`` and ``scheduler.pt``
exist, and the RNG state only when the file of its own process count does (``rng_state.pth`` from one process,
``rng_state_{rank}.pth`` from several; `rng_source` maps one count to another); otherwise it starts them afresh with one log line at
info level, so the learning rate jumps back to its peak and the run silently differs from an uninterrupted one.
Corrupt files would surface as raw torch or JSON tracebacks deep inside ``Trainer.train``.
"""

import json
import sys
from pathlib import Path

import numpy as np
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


def saved_rng_names(checkpoint: Path) -> list[str]:
    """The RNG files Trainer wrote into ``checkpoint``: ``rng_state.pth`` from one process, ``rng_state_{rank}.pth``
    for ranks 0..M-1 from M; empty if neither is complete."""
    if (checkpoint / "rng_state.pth").is_file():
        return ["rng_state.pth"]
    names = []
    while (checkpoint / f"rng_state_{len(names)}.pth").is_file():
        names.append(f"rng_state_{len(names)}.pth")
    return names


def rng_source(checkpoint: Path, training_args: TrainingArguments) -> str | None:
    """The RNG file this process restores: its own under Trainer's naming; from another process count, rank r of
    this run takes the saved rank r mod M (the single process's file for every rank)."""
    own = rng_state_names(training_args)[training_args.process_index]
    if (checkpoint / own).is_file():
        return own
    saved = saved_rng_names(checkpoint)
    return saved[training_args.process_index % len(saved)] if saved else None


def inexact_rng_restore(checkpoint: Path, training_args: TrainingArguments) -> str | None:
    """Why restoring another process count's RNG files cannot continue the run exactly, or None when it can: the
    saved ranks' states are all equal (Trainer seeds every rank alike), so each rank of this run gets the state it
    would have had."""
    saved = saved_rng_names(checkpoint)
    if not saved or len(saved) == training_args.world_size or saved == rng_state_names(training_args):
        return None
    with safe_globals():
        states = [torch.load(checkpoint / name, weights_only=True) for name in saved]
    if all(same_state(state, states[0]) for state in states[1:]):
        return None
    return (f"the {len(saved)} saved processes' random states differ ({', '.join(saved)}), and this run of "
            f"{training_args.world_size} restores them by rank modulo {len(saved)}, so its random draws (dropout, "
            "sampling) differ from an uninterrupted run's")


def same_state(first, second) -> bool:
    """Equality of two RNG states as Trainer saves them: nested dicts, tuples and lists of tensors, arrays, numbers."""
    if isinstance(first, dict):
        return isinstance(second, dict) and first.keys() == second.keys() and all(
            same_state(first[key], second[key]) for key in first
        )
    if isinstance(first, (tuple, list)):
        return isinstance(second, (tuple, list)) and len(first) == len(second) and all(map(same_state, first, second))
    if isinstance(first, (torch.Tensor, np.ndarray)):
        return type(first) is type(second) and first.shape == second.shape and bool((first == second).all())
    return first == second


def has_optimizer_state(checkpoint: Path) -> bool:
    """``optimizer.pt``, accelerate's ``optimizer.bin``, or an FSDP ``optimizer_*`` folder, as Trainer looks for."""
    if (checkpoint / OPTIMIZER_NAME).is_file() or (checkpoint / OPTIMIZER_NAME_BIN).is_file():
        return True
    return any(path.is_dir() and path.name.startswith("optimizer") for path in checkpoint.iterdir())


def missing_state_files(checkpoint: Path, training_args: TrainingArguments) -> list[str]:
    missing = [] if has_optimizer_state(checkpoint) else [OPTIMIZER_NAME]
    missing += [] if (checkpoint / SCHEDULER_NAME).is_file() else [SCHEDULER_NAME]
    missing += [] if saved_rng_names(checkpoint) else rng_state_names(training_args)
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
    for name in (SCHEDULER_NAME, *saved_rng_names(folder)):
        if (folder / name).is_file():
            check_torch_file(folder / name)
    inexact = inexact_rng_restore(folder, training_args)
    if inexact and training_args.process_index == 0:
        print(f"kimi-k3-train: warning: resuming {checkpoint} cannot be exact: {inexact}", file=sys.stderr)


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

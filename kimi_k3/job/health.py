"""Training health: a run whose loss, gradients or weights stop being finite ends as a failure, and nothing
non-finite reaches a checkpoint, ``model/`` or the hub.

Trainer's ``logging_nan_inf_filter`` replaces a non-finite loss with the running mean in the logs and trains on, so
a diverged run would otherwise look healthy. The gradients are checked before every optimizer step (a non-finite
loss makes them non-finite too, and clipping a non-finite norm spreads it to every gradient) through the norm Trainer
computes over them anyway (`kimi_k3.job.trainer.KimiK3Trainer`); the weights once more before anything is saved, as
the last guard.
"""

import math
from collections.abc import Iterable

import torch

from kimi_k3.checkpoint.finite import first_non_finite


class TrainingDiverged(RuntimeError):
    """The loss, a gradient or a weight became non-finite; nothing was saved from that state."""


def check_finite_gradients(grad_norm, step: int) -> None:
    """Stop the job before optimizer step ``step`` would apply non-finite gradients: ``grad_norm`` is the norm Trainer
    computed over them (for clipping, or for its logs), a tensor, a sharded ``DTensor`` or a float."""
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    if grad_norm is not None and not math.isfinite(float(grad_norm)):
        raise TrainingDiverged(divergence_message(f"the gradients are not finite at step {step}"))


def check_finite_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Refuse to save ``what`` when a weight holds NaN or infinity (on the one process that saves it)."""
    found = first_non_finite(named_tensors)
    if found is not None:
        raise TrainingDiverged(non_finite_weight_message(*found, what))


def non_finite_weight_message(name: str, count: int | str, what: str) -> str:
    return divergence_message(f"{name} holds {count} non-finite value(s); {what} was not saved")


def check_finite_metric(metrics: dict[str, float], key: str) -> None:
    value = metrics.get(key)
    if value is not None and not math.isfinite(value):
        raise TrainingDiverged(divergence_message(f"the final {key} is {value}; the final model was not saved"))


def divergence_message(what: str) -> str:
    return (
        f"training diverged: {what}; start again with a lower --learning_rate (or more --warmup_steps), or train on "
        "from the last checkpoint's weights with --model_name_or_path CHECKPOINT and a lower rate"
    )

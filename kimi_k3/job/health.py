"""Training health: a run whose loss, gradients or weights stop being finite ends as a failure, and nothing
non-finite reaches a checkpoint, ``model/`` or the hub.

Trainer's ``logging_nan_inf_filter`` replaces a non-finite loss with the running mean in the logs and trains on, so
a diverged run would otherwise look healthy. The gradients are checked before every optimizer step (a non-finite
loss makes them non-finite too, and clipping a non-finite norm spreads it to every gradient); the weights once more
before anything is saved, as the last guard.
"""

import math
from collections.abc import Iterable

import torch
from transformers import TrainerCallback

from kimi_k3.checkpoint.finite import first_non_finite


class TrainingDiverged(RuntimeError):
    """The loss, a gradient or a weight became non-finite; nothing was saved from that state."""


class TrainingHealthCallback(TrainerCallback):
    """Stops the job before an optimizer step would apply non-finite gradients."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        if gradients and not math.isfinite(total_norm(gradients)):
            raise TrainingDiverged(divergence_message(f"the gradients are not finite at step {state.global_step + 1}"))


def total_norm(tensors: list[torch.Tensor]) -> float:
    """The 2-norm over ``tensors``; a norm over sharded ``DTensor`` gradients is reduced across their mesh."""
    norm = torch.nn.utils.get_total_norm(tensors, norm_type=2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


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

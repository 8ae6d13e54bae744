"""A training policy under ``transformers.Trainer``: attached for the run, logged, detached.

The policy itself updates from a step hook of the optimizer (`Attachment.run_after_each_step`), so the callback
does nothing at steps: under ``Trainer`` the policy acts exactly as in a plain ``torch`` loop or an accelerate loop.
Beside it, `ResumableCallback`: the base of every callback (the policies' and the training job's) whose records span
the jobs of a resumed run.
"""

import warnings

from transformers import TrainerCallback, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.integrations import get_reporting_integration_callbacks


class PolicyCallback(TrainerCallback):
    """Attaches ``policy`` to the Trainer's model and optimizer at the start of training, adds the policy's
    ``latest_metrics`` to every training-loss log, and removes the attachment at the end.

    A policy has ``attach(optimizer, model)`` returning a handle with ``remove()``, and ``latest_metrics``.
    """

    def __init__(self, policy=None):
        self.policy = policy
        self.attachment = None
        self.ahead_of_reporting = False

    def policy_for(self, model):
        """The policy to attach to the Trainer's ``model``."""
        return self.policy

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.detach()  # a previous run that ended in an exception never reached on_train_end
        if optimizer is None:
            raise ValueError(f"{type(self).__name__} updates after each optimizer step, and the Trainer gave it none")
        self.policy = self.policy_for(model)
        self.attachment = self.policy.attach(optimizer, model)
        self._warn_if_reporting_misses_the_metrics(args)

    def on_train_end(self, args, state, control, **kwargs):
        self.detach()

    def detach(self) -> None:
        """Remove what the policy attached, so that a model trained again records only for that run's policy."""
        if self.attachment is not None:
            self.attachment.remove()
            self.attachment = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Only the training-loss log of a step; eval and end-of-training summaries have other keys.
        metrics = getattr(self.policy, "latest_metrics", None)
        if logs is not None and "loss" in logs and metrics:
            logs.update(metrics)
            state.log_history[-1].update(metrics)

    def attach(self, trainer) -> "PolicyCallback":
        """Register right after DefaultFlowCallback, before the ``report_to`` integrations, so that they log the
        policy's metrics too; moves the callback there if it was already registered (two copies would attach twice).
        """
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(1, self)
        self.ahead_of_reporting = True
        return self

    def _warn_if_reporting_misses_the_metrics(self, args) -> None:
        """Trainer puts ``callbacks=[...]`` after its ``report_to`` integrations, which then log before the metrics
        join the logs: say so rather than leave TensorBoard (or W&B, ...) silently without them."""
        report_to = [args.report_to] if isinstance(args.report_to, str) else args.report_to or []
        integrations = [name for name in report_to if name != "none"]
        if integrations and not self.ahead_of_reporting:
            warnings.warn(
                f"{type(self).__name__}'s metrics reach the console and trainer_state.json but not report_to "
                f"{integrations}, which log before it: register it with `callback.attach(trainer)`, or call "
                "`report_after_every_callback(trainer)` (kimi_k3.policies.callback), before training.",
                stacklevel=2,
            )


def report_after_every_callback(trainer) -> None:
    """Move ``trainer``'s ``report_to`` integrations behind all its other callbacks, each group keeping its order, so
    that TensorBoard, W&B and the others log what any callback adds to the logs, the policies' metrics among them.
    The other callbacks keep their order, which decides whose optimizer step hooks run first."""
    reporting = tuple(get_reporting_integration_callbacks(trainer.args.report_to))
    callbacks = trainer.callback_handler.callbacks
    callbacks[:] = [callback for callback in callbacks if not isinstance(callback, reporting)] + [
        callback for callback in callbacks if isinstance(callback, reporting)
    ]
    for callback in callbacks:
        if isinstance(callback, PolicyCallback):
            callback.ahead_of_reporting = True


class ResumableCallback(TrainerCallback, ExportableState):
    """A callback whose `attributes` (JSON values) are saved with every checkpoint and restored on resume.

    Trainer writes ``state()`` of each ``ExportableState`` callback into every checkpoint's ``trainer_state.json``
    (``TrainerState.stateful_callbacks``). Trainer reads them back only under
    ``--restore_callback_states_from_checkpoint``, and then by constructing a new callback from JSON arguments, which
    cannot hand back a callback's live references (the expert-load recorder's balancing callback). So each such
    callback restores its own attributes from the resumed state in ``on_train_begin``, when that state is already
    loaded.
    """

    def attributes(self) -> dict:
        raise NotImplementedError

    def restore(self, attributes: dict, step: int) -> None:
        """Take back `attributes` saved by the checkpoint of optimizer step ``step``."""
        raise NotImplementedError

    def state(self) -> dict:
        return {"args": {}, "attributes": self.attributes()}

    def on_train_begin(self, args, state, control, **kwargs):
        self.resume_from(state)

    def resume_from(self, state: TrainerState) -> None:
        """Restore from ``state`` when it is a checkpoint's (a fresh run's state holds this callback's own record)."""
        name = type(self).__name__
        saved = state.stateful_callbacks.get(name)
        if state.global_step > 0 and isinstance(saved, dict):
            self.restore(saved.get("attributes", {}), state.global_step)
        # Trainer's checkpoint save updates only the entries the state already holds: a checkpoint written before this
        # callback existed has none.
        state.stateful_callbacks.setdefault(name, self.state())

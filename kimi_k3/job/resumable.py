"""Callbacks whose records span every job of a resumed run.

Trainer writes ``state()`` of each ``ExportableState`` callback into every checkpoint's ``trainer_state.json``
(``TrainerState.stateful_callbacks``). Trainer reads them back only under ``--restore_callback_states_from_checkpoint``,
and then by constructing a new callback from JSON arguments, which cannot hand back a callback's live references (the
expert-load recorder's balancing callback). So each callback here restores its own attributes from the resumed state
in ``on_train_begin``, when that state is already loaded.
"""

import time

from transformers import TrainerCallback, TrainerState
from transformers.trainer_callback import ExportableState


class ResumableCallback(TrainerCallback, ExportableState):
    """A callback whose `attributes` (JSON values) are saved with every checkpoint and restored on resume."""

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


class TrainingClock(ResumableCallback):
    """Wall time of the whole run: this job's since ``start``, plus the earlier jobs' up to the checkpoint that the
    next one resumed from (steps after that checkpoint were trained again, and their time is counted when they are).

    Beside it, ``step_s`` over ``steps``: the time inside optimizer steps alone (forward, backward, optimizer and its
    step hooks), without start-up, evaluation and checkpoints, which is what a step costs."""

    def __init__(self, start: float | None = None):
        self.start = time.perf_counter() if start is None else start
        self.earlier_s = 0.0
        self.resumed_at: list[int] = []
        self.step_s, self.steps, self._step_start = 0.0, 0, None

    def seconds(self) -> float:
        return self.earlier_s + time.perf_counter() - self.start

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is not None:
            self.step_s += time.perf_counter() - self._step_start
            self.steps += 1
        self._step_start = None

    def attributes(self) -> dict:
        return {"earlier_s": self.seconds(), "resumed_at": list(self.resumed_at), "step_s": self.step_s,
                "steps": self.steps}

    def restore(self, attributes: dict, step: int) -> None:
        self.earlier_s = float(attributes.get("earlier_s", 0.0))
        self.resumed_at = [*attributes.get("resumed_at", []), step]
        self.step_s, self.steps = float(attributes.get("step_s", 0.0)), int(attributes.get("steps", 0))

"""Callbacks of the training job whose records span every job of a resumed run (how they are saved and restored:
`kimi_k3.policies.callback.ResumableCallback`)."""

import time

from kimi_k3.policies.callback import ResumableCallback


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

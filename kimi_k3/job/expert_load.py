"""A picture of expert load for the model card: every MoE layer's token share per routed expert at
the first and the last optimizer step of a training job, beside MaxVio over the steps.

The counts come from `QuantileBalancing.latest_loads` (the step's counts, summed over ranks), never from the routers
themselves. matplotlib is an optional dependency (``pip install 'kimi-k3[plot]'``); without it nothing is
drawn. Drawing goes through ``matplotlib.figure.Figure``, not ``pyplot``, so no global backend or figure state is
touched in the process that trains.
"""

import io

import torch

from kimi_k3.policies.callback import ResumableCallback

PNG_NAME = "expert_load.png"
PLOT_EXTRA = "pip install 'kimi-k3[plot]'"
# Logged by QuantileBalancingCallback at every logging step: the worst layer's MaxVio and the mean over layers.
MAX_VIO_SERIES = {"worst layer": "balance/max_vio", "mean over layers": "balance/max_vio_mean"}


Snapshot = tuple[int, dict[str, torch.Tensor]]


class ExpertLoadRecorder(ResumableCallback):
    """Keeps the per-expert token counts of the first and the last optimizer step of the run, read from ``balancing``
    (a `QuantileBalancing`, which updates them from the optimizer's step hook, before ``on_step_end``).

    Both snapshots are saved with every checkpoint, so a resumed run still shows the run's first step.
    """

    def __init__(self, balancing):
        self.balancing = balancing
        self.first: Snapshot | None = None
        self.last: Snapshot | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if not self.balancing.latest_loads:
            return
        snapshot = (state.global_step, dict(self.balancing.latest_loads))
        if self.first is None:
            self.first = snapshot
        self.last = snapshot

    def attributes(self) -> dict:
        return {"first": snapshot_to_json(self.first), "last": snapshot_to_json(self.last)}

    def restore(self, attributes: dict, step: int) -> None:
        self.first = snapshot_from_json(attributes.get("first"))
        self.last = snapshot_from_json(attributes.get("last"))

    def snapshots(self) -> list[Snapshot]:
        """(step, counts per layer) at the first and the last step; one entry after a one-step job, none before."""
        if self.first is None:
            return []
        return [self.first] if self.first[0] == self.last[0] else [self.first, self.last]


def snapshot_to_json(snapshot: Snapshot | None) -> list | None:
    if snapshot is None:
        return None
    step, loads = snapshot
    return [step, {name: load.tolist() for name, load in loads.items()}]


def snapshot_from_json(saved: list | None) -> Snapshot | None:
    if saved is None:
        return None
    step, loads = saved
    return step, {name: torch.tensor(load) for name, load in loads.items()}


def token_share(loads: dict[str, torch.Tensor]) -> torch.Tensor:
    """[layers, experts]: each expert's share of its layer's routed tokens, over the ideal share 1/E (1 = balanced)."""
    counts = torch.stack([load.double() for load in loads.values()])
    return counts * counts.shape[-1] / counts.sum(-1, keepdim=True).clamp(min=1)


def max_vio_history(log_history: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """MaxVio at each logged step, per series of `MAX_VIO_SERIES` (Trainer's ``state.log_history``)."""
    return {
        label: [(entry["step"], entry[key]) for entry in log_history if key in entry]
        for label, key in MAX_VIO_SERIES.items()
    }


def matplotlib_available() -> bool:
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def new_figure(**kwargs):
    """A ``matplotlib.figure.Figure`` detached from pyplot (raises ImportError without matplotlib)."""
    from matplotlib.figure import Figure

    return Figure(layout="constrained", **kwargs)


def plot_max_vio(axis, runs: dict[str, list[tuple[int, float]]]) -> None:
    """MaxVio over optimizer steps, one line per run, on a log scale."""
    for label, points in runs.items():
        if points:
            axis.plot([step for step, _ in points], [value for _, value in points], label=label)
    axis.set(xlabel="optimizer step", ylabel="MaxVio", yscale="log")
    if any(runs.values()):
        axis.legend()


def expert_load_png(snapshots: list[Snapshot], log_history: list[dict], title: str) -> bytes:
    """The picture as PNG bytes: a heatmap of `token_share` per snapshot, then MaxVio over the logged steps.

    One diverging scale for all heatmaps, centred on the balanced share: blue experts get fewer tokens than their
    share, red ones more.
    """
    from matplotlib.colors import TwoSlopeNorm

    shares = [(step, token_share(loads)) for step, loads in snapshots]
    layers = [name.removeprefix("layer_") for name in snapshots[0][1]] if snapshots else []
    height = min(12.0, max(3.5, 1.5 + 0.3 * len(layers)))
    figure = new_figure(figsize=(4.5 * (len(shares) + 1), height))
    axes = figure.subplots(1, len(shares) + 1, squeeze=False)[0]
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max([2.0] + [float(share.max()) for _, share in shares]))
    for axis, (step, share) in zip(axes, shares):
        image = axis.imshow(share.numpy(), aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
        axis.set(title=f"step {step}", xlabel="routed expert", ylabel="MoE layer")
        axis.set_yticks(range(len(layers)), layers)
    if shares:
        figure.colorbar(image, ax=list(axes[: len(shares)]), label="token share / ideal share (1 = balanced)")
    plot_max_vio(axes[-1], max_vio_history(log_history))
    axes[-1].set_title("MaxVio = max load / mean load - 1")
    figure.suptitle(title)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()

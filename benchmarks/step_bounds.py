"""What each part of the default training step would save if it cost nothing, and how the step scales with tokens.

`step_profile.py` sorts the step's time by operator class; outside the matrix products no single operator stands out.
This script asks the question by component instead: the default `kimi-k3-train` step (`step_profile.job_training_step`)
timed interleaved with copies of it in which one component is replaced by a *stand-in*, one or two elementwise passes
over the same tensors that keep every input in the autograd graph (so the same parameters get gradients and the
optimizer does the same work). The difference is an upper bound on what any kernel for that component can save; the
stand-ins compute nothing useful, and the step with one of them is a timing device only. Each variant is set against
its own matmul floor, recorded with the stand-in in place: the KDA stand-in also drops the chunk's own products.

- **KDA chunk kernel**: ``chunk_kda`` (the chunked delta rule: intra-chunk scores, the triangular solve, the chunk
  loop) becomes ``v·β + (q + k)·g`` and a zero state.
- **SiTU-GLU**: every GLU activation module, the fused kernels the job attaches included, returns ``gate·up``.
- **short convolutions**: each KDA short convolution + SiLU becomes ``x·w`` (its last tap).
- **RMSNorm outside AttnRes**: the layers' input and post-attention norms, the latent-MoE norm, MLA's two latent norms
  and the final norm become ``x·weight`` (the Block AttnRes norms run inside its fused mix and stay).

Second table: the step and its matmul floor (`step_profile.MatmulFloor`) at 1, 2 and 4 times the job's tokens per
step. Were the time outside the products a fixed cost per operator call, the ratio would fall as the batch grows.

    python benchmarks/step_bounds.py
    python benchmarks/step_bounds.py --quick     # one repetition, the first table only (a smoke run)
"""

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_arguments, report, time_interleaved  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from benchmarks.step_profile import JOB_BATCH, JobStep, job_training_step, record_matmuls  # noqa: E402


def _kernel_module(model: nn.Module):
    """The module of the model's KDA torch kernels (``kda_kimi_k3`` beside the model's own module): the stand-in
    replaces the chunked kernel where the seams' torch bodies look it up."""
    seam_body = sys.modules[type(model).__module__].torch_chunk_kimi_delta_attention
    return sys.modules[seam_body.__module__]


@contextlib.contextmanager
def _module_function(module, name: str, replacement: Callable) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def _instance_forwards(modules: list[nn.Module], replacement: Callable[[nn.Module], Callable]) -> Iterator[None]:
    previous = [module.__dict__.get("forward") for module in modules]
    for module in modules:
        module.forward = replacement(module)
    try:
        yield
    finally:
        for module, forward in zip(modules, previous):
            del module.forward
            if forward is not None:
                module.forward = forward


def _kda_stand_in(q, k, v, g, beta, initial_state=None, **_):
    """Needs key and value heads of one width, as the default model's."""
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    return v * beta[..., None] + (q + k) * g, state


def _situ_stand_in(gate, up=None):
    if up is None:  # the routed experts' concatenated [gate ‖ up]
        gate, up = gate.chunk(2, dim=-1)
    return gate * up


def _modules_named(model: nn.Module, class_name: str, exclude: str | None = None) -> list[nn.Module]:
    return [module for name, module in model.named_modules()
            if type(module).__name__ == class_name and (exclude is None or exclude not in name)]


def kda_chunk_free(model: nn.Module) -> contextlib.AbstractContextManager:
    return _module_function(_kernel_module(model), "chunk_kda", _kda_stand_in)


def situ_free(model: nn.Module) -> contextlib.AbstractContextManager:
    return _instance_forwards(_modules_named(model, "KimiK3GLUActivation"), lambda activation: _situ_stand_in)


def short_convolutions_free(model: nn.Module) -> contextlib.AbstractContextManager:
    convolutions = _modules_named(model, "KimiK3ShortConvolution")
    return _instance_forwards(convolutions, lambda conv: lambda x, positions=None: x * conv.weight[:, 0, -1:])


def norms_free(model: nn.Module) -> contextlib.AbstractContextManager:
    norms = _modules_named(model, "KimiK3RMSNorm", exclude="res_norm")
    return _instance_forwards(norms, lambda norm: lambda x: x * norm.weight)


STAND_INS: dict[str, Callable[[nn.Module], contextlib.AbstractContextManager]] = {
    "KDA chunk kernel": kda_chunk_free,
    "SiTU-GLU": situ_free,
    "short convolutions": short_convolutions_free,
    "RMSNorm outside AttnRes": norms_free,
}


def with_stand_in(step: JobStep, stand_in: Callable[[nn.Module], contextlib.AbstractContextManager]):
    """``step`` with ``stand_in`` in place for each call, and the model as it was between calls."""
    def run():
        with stand_in(step.model):
            return step()

    return run


def warmed(step: Callable, calls: int = 2) -> Callable:
    for _ in range(calls):  # compiles the fused kernels, allocates the optimizer state
        step()
    return step


def bounds(repeats: int) -> dict:
    """The step with each stand-in against the step itself, each beside its own matmul floor (a stand-in drops the
    products of its component, KDA's batched products and triangular solve, from the floor too)."""
    variants = {"(none: the job's step)": None, **STAND_INS}
    steps = {name: warmed(job_training_step() if stand_in is None else with_stand_in(job_training_step(), stand_in))
             for name, stand_in in variants.items()}
    floors = {f"{name} floor": record_matmuls(around=stand_in).replay() for name, stand_in in variants.items()}
    times = time_interleaved({**steps, **floors}, repeats=repeats)
    base = times["(none: the job's step)"]
    rows = [{"component free": name, "step ms": 1e3 * times[name], "saved ms": 1e3 * (base - times[name]),
             "saved %": 100 * (base - times[name]) / base, "matmul floor ms": 1e3 * times[f"{name} floor"],
             "step / floor": times[name] / times[f"{name} floor"]}
            for name in variants]
    return {"caption": "The step with one component replaced by a stand-in, against its own matmul floor.",
            "columns": list(rows[0]), "rows": rows}


def scaling(repeats: int, factors: tuple[int, ...] = (1, 2, 4)) -> dict:
    rows = []
    for factor in factors:
        batch_size, seq_len = JOB_BATCH[0] * factor, JOB_BATCH[1]
        floor = record_matmuls(batch_size, seq_len).replay()
        step = warmed(job_training_step(batch_size, seq_len))
        times = time_interleaved({"step": step, "floor": floor}, repeats=repeats)
        tokens = batch_size * seq_len
        rows.append({"batch": f"{batch_size} x {seq_len}", "tokens": tokens, "step ms": 1e3 * times["step"],
                     "floor ms": 1e3 * times["floor"], "step / floor": times["step"] / times["floor"],
                     "outside products, µs / token": 1e6 * (times["step"] - times["floor"]) / tokens})
    return {"caption": "The step and its matmul floor by tokens per step.", "columns": list(rows[0]), "rows": rows}


def run(repeats: int = 3, scale: bool = True) -> dict:
    torch.use_deterministic_algorithms(True)  # as the job's full_determinism
    torch.utils.deterministic.fill_uninitialized_memory = False  # the job's Trainer turns it off
    tables = [bounds(repeats)] + ([scaling(repeats)] if scale else [])
    return {"title": f"Default kimi-k3-train step, batch {JOB_BATCH}: what each component would save if it were free",
            "tables": tables,
            "notes": ["A stand-in is one or two elementwise passes over the component's inputs; the step with it is a "
                      "timing device, not a model."]}


def main() -> None:
    args = bench_arguments(__doc__)
    repeats = args.repeats or (1 if args.quick else 3)
    report("step_bounds", run(repeats=repeats, scale=not args.quick), args.json)


if __name__ == "__main__":
    main()

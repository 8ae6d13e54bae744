"""Where the default training step spends its time, and the floor its own matrix products set.

The step is the one `kimi-k3-train` runs with its defaults: the default `KimiK3Config()` (4,096-token vocabulary),
batch 8 x 128, the kernels the job attaches (`use_fused_kernels`), Per-Head Muon (Newton–Schulz in the precision the
CPU picks), QK-Clip and Quantile Balancing attached to the optimizer's step hooks, and torch's deterministic algorithms
(the job's ``full_determinism``) without their filling of new tensors (as the job's Trainer). Forward, loss, backward,
optimizer step and the policies' updates; no data loading.

- **Breakdown**: torch's profiler on a few steps; each operator's *self* CPU time goes to one class (matmuls,
  elementwise and reductions, data movement, the compiled SiTU-GLU and AttnRes kernels); the step's wall time not
  spent inside any operator is Python and dispatch. The profiler adds a few microseconds per operator, so the per-operator
  classes are taken from the profile and the Python/dispatch share is the unprofiled wall time minus them.
- **QK-Clip's cost**: the same step without QK-Clip, timed interleaved with it.
- **What compiling Per-Head Muon's elementwise passes buys**: the same step with those passes eager at every size
  (``kimi_k3.optim.elementwise``), timed interleaved with it.
- **Matmul floor**: every matrix product of one step (forward, backward, Newton–Schulz), recorded with its shapes by
  a dispatch mode, then replayed back to back on fresh tensors of the same shapes, strides and dtypes. That is the
  time the step would take if everything but its matrix products were free; each phase is also set against the
  products it runs itself.

    python benchmarks/step_profile.py                    # this CPU's kernels
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/step_profile.py
"""

import collections
import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, report, time_interleaved  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.kernels.training import use_fused_kernels  # noqa: E402
from kimi_k3.optim import elementwise  # noqa: E402
from kimi_k3.optim.muon import PerHeadMuon  # noqa: E402
from kimi_k3.policies.qk_clip import QKClip  # noqa: E402
from kimi_k3.policies.quantile_balancing import QuantileBalancing  # noqa: E402
from modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402

JOB_BATCH = (8, 128)  # kimi-k3-train's per_device_train_batch_size x block_size
aten = torch.ops.aten

# Matrix products and the FLOPs of one call, from the shapes of its operands.
MATMULS = {
    aten.mm.default: lambda a, b: 2 * a.shape[0] * a.shape[1] * b.shape[1],
    aten.addmm.default: lambda bias, a, b, *_: 2 * a.shape[0] * a.shape[1] * b.shape[1],
    aten.bmm.default: lambda a, b: 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
    aten.baddbmm.default: lambda bias, a, b, *_: 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
    # Newton–Schulz writes its products into buffers it reuses.
    aten.bmm.out: lambda a, b: 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
    aten.baddbmm.out: lambda bias, a, b, *_: 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
    aten._grouped_mm.default: lambda a, b, *_: 2 * a.shape[0] * a.shape[-1] * b.shape[-1],
    # KDA's T = (I + L)^-1 (forward substitution): n² multiply-adds per right-hand column of an n x n system.
    aten.linalg_solve_triangular.default: lambda a, b, *_: math.prod(b.shape) * a.shape[-1],
}
# Products without a 16-bit CPU kernel (torch 2.13): a floor in 16 bits replays them in their recorded dtype.
RECORDED_DTYPE_ONLY = {aten.linalg_solve_triangular.default}
MATMUL_NAMES = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                "aten::linalg_solve_triangular"}
DATA_MOVEMENT_NAMES = {
    "aten::copy_", "aten::cat", "aten::stack", "aten::index", "aten::index_put_", "aten::_index_put_impl_",
    "aten::index_add_", "aten::index_select", "aten::gather", "aten::scatter", "aten::scatter_add_",
    "aten::scatter_add", "aten::fill_", "aten::zero_", "aten::zeros", "aten::zeros_like", "aten::empty",
    "aten::empty_like", "aten::empty_strided", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to",
    "aten::new_zeros", "aten::new_empty_strided", "aten::embedding_dense_backward", "aten::embedding",
    "aten::constant_pad_nd", "aten::repeat_interleave", "aten::masked_scatter", "aten::narrow_copy",
    "aten::resize_", "aten::sort", "aten::argsort", "aten::histc", "aten::bincount", "aten::unique_dim",
    "aten::_unique2", "aten::nonzero", "aten::where", "aten::topk", "aten::flip", "aten::tril", "aten::triu",
}
VIEW_NAMES = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::permute", "aten::transpose", "aten::t",
    "aten::as_strided", "aten::expand", "aten::select", "aten::slice", "aten::unsqueeze", "aten::squeeze",
    "aten::detach", "aten::alias", "aten::unbind", "aten::split", "aten::split_with_sizes", "aten::chunk",
    "aten::unflatten", "aten::flatten", "aten::narrow", "aten::view_as", "aten::expand_as", "aten::diagonal",
    "aten::lift_fresh", "aten::_unsafe_view", "aten::numpy_T", "aten::matrix_H", "aten::mT", "aten::result_type",
    "aten::broadcast_tensors", "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::resolve_conj",
    "aten::resolve_neg", "aten::_has_compatible_shallow_copy_type",
}


PHASES = ("forward", "backward", "optimizer step")


@dataclass
class JobStep:
    model: KimiK3ForCausalLM
    optimizer: torch.optim.Optimizer
    input_ids: torch.Tensor

    def __call__(self, modes: dict[str, TorchDispatchMode] | None = None) -> tuple[float, float, float]:
        """Seconds of the forward (with the loss), the backward and the optimizer step; with ``modes``, each of the
        three `PHASES` runs under its own dispatch mode."""
        modes = modes or {}
        start = time.perf_counter()
        with modes.get("forward", contextlib.nullcontext()):
            loss = self.model(input_ids=self.input_ids, labels=self.input_ids).loss
        forward = time.perf_counter()
        with modes.get("backward", contextlib.nullcontext()):
            loss.backward()
        backward = time.perf_counter()
        with modes.get("optimizer step", contextlib.nullcontext()):
            self.optimizer.step()  # the Quantile Balancing and QK-Clip updates run from its step hooks
        self.optimizer.zero_grad(set_to_none=True)
        return forward - start, backward - forward, time.perf_counter() - backward


def job_training_step(batch_size: int = JOB_BATCH[0], seq_len: int = JOB_BATCH[1], seed: int = 0,
                      fused_kernels: bool = True, qk_clip: bool = True) -> JobStep:
    """The default `kimi-k3-train` training step on random tokens (see the module docstring)."""
    torch.manual_seed(seed)
    config = KimiK3Config()
    model = KimiK3ForCausalLM(config).train()
    if fused_kernels:
        use_fused_kernels(model)
    optimizer = PerHeadMuon.for_model(model, lr=3e-3, weight_decay=0.1, adamw_betas=(0.9, 0.95))
    QuantileBalancing(model).attach(optimizer, model)
    if qk_clip:
        QKClip(model, 100.0).attach(optimizer, model)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, config.vocab_size, (batch_size, seq_len), generator=generator)
    return JobStep(model, optimizer, input_ids)


def with_eager_optimizer_passes(step: JobStep) -> Callable[[], tuple[float, float, float]]:
    """``step`` with Per-Head Muon's elementwise passes eager whatever the parameter's size (same results)."""
    def run():
        threshold, elementwise.COMPILED_MIN_ELEMENTS = elementwise.COMPILED_MIN_ELEMENTS, math.inf
        try:
            return step()
        finally:
            elementwise.COMPILED_MIN_ELEMENTS = threshold

    return run


def operator_class(name: str) -> str:
    if name in MATMUL_NAMES:
        return "matmuls"
    if name in DATA_MOVEMENT_NAMES:
        return "data movement"
    if name in VIEW_NAMES:
        return "views and scalars (dispatch)"
    if "CompiledFxGraph" in name:
        return "compiled kernels (SiTU-GLU, AttnRes, Muon's elementwise passes)"
    if "convolution" in name:
        return "short convolution"
    if name.startswith("aten::"):
        return "elementwise and reductions"
    return "other"


@dataclass
class Profile:
    """One profiled step: its wall time under the profiler, self seconds per operator class and per operator."""

    wall: float
    by_class: dict[str, float]
    by_operator: dict[str, float]
    operators: int

    @property
    def outside_operators(self) -> float:
        return self.wall - sum(self.by_class.values())


def profile_step(step) -> Profile:
    by_class, by_operator = collections.defaultdict(float), collections.defaultdict(float)
    operators = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    for event in profiler.key_averages():
        name = operator_class(event.key)
        if name == "other":
            continue  # autograd nodes and record_function ranges: their own time is Python and dispatch
        by_class[name] += event.self_cpu_time_total / 1e6
        by_operator[event.key] += event.self_cpu_time_total / 1e6
        operators += event.count
    return Profile(wall, dict(by_class), dict(by_operator), operators)


def least_disturbed_profile(step, steps: int) -> Profile:
    """The profiled step with the shortest wall time: on a shared machine, the one the load disturbed least."""
    return min((profile_step(step) for _ in range(steps)), key=lambda profile: profile.wall)


def breakdown_rows(profile: Profile, wall: float) -> list[dict]:
    """Shares of the profiled step, in milliseconds of the unprofiled ``wall`` (the profiler slows every operator by
    about the same few microseconds, so shares transfer better than its absolute times)."""
    parts = {**profile.by_class, "Python, autograd and dispatch outside operators": profile.outside_operators}
    return [{"class": name, "share of step %": 100 * seconds / profile.wall, "ms / step": 1e3 * wall * seconds / profile.wall}
            for name, seconds in sorted(parts.items(), key=lambda item: -item[1])]


def phase_times(steps: dict[str, Callable[[], tuple[float, float, float]]], repeats: int) -> dict[str, dict]:
    """Fastest forward, backward and optimizer step (with the policies' hooks) of each of ``steps`` over ``repeats``
    rounds in which every step runs once, in seconds."""
    runs = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            runs[name].append(step())
    return {name: {phase: min(times) for phase, times in zip(PHASES, zip(*rounds))} for name, rounds in runs.items()}


class MatmulRecorder(TorchDispatchMode):
    """Records (operator, shapes, strides, dtypes, non-tensor arguments) of every matrix product that runs."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.calls[(func, _signature(args), _signature(tuple((kwargs or {}).items())))] += 1
        return func(*args, **(kwargs or {}))


def _signature(values) -> tuple:
    signature = []
    for value in values:
        if isinstance(value, torch.Tensor):
            signature.append(("tensor", tuple(value.shape), value.stride(), value.dtype))
        elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
            signature.append((value[0], _signature((value[1],))[0]))
        else:
            signature.append(("value", value))
    return tuple(signature)


def _in_dtype(entry, dtype: torch.dtype | None):
    if dtype is None or entry[0] != "tensor" or not entry[3].is_floating_point:
        return entry
    return (*entry[:3], dtype)


def _materialise(entry, generator: torch.Generator):
    kind, *rest = entry
    if kind == "tensor":
        shape, stride, dtype = rest
        if dtype in (torch.int32, torch.int64):  # grouped_mm offsets: an even split of the rows
            return None
        size = 1 + sum((extent - 1) * step for extent, step in zip(shape, stride)) if shape else 1
        storage = torch.randn(size, generator=generator).to(dtype)
        return storage.as_strided(shape, stride)
    if kind == "value":
        return rest[0]
    return kind, _materialise(rest[0], generator)


def _grouped_offsets(args: list, entries) -> list:
    """An even split of the grouped product's rows over its groups (the recorded split is data-dependent)."""
    for index, entry in enumerate(entries):
        if entry[0] == "tensor" and entry[3] in (torch.int32, torch.int64):
            groups, rows = entry[1][0], args[0].shape[0]
            args[index] = torch.linspace(rows / groups, rows, groups).round().to(entry[3])
    return args


@dataclass
class MatmulFloor:
    calls: collections.Counter

    @classmethod
    def together(cls, floors) -> "MatmulFloor":
        """One floor for the products of all ``floors`` (the phases of a step)."""
        return cls(sum((floor.calls for floor in floors), collections.Counter()))

    @property
    def flops(self) -> float:
        return sum(count * MATMULS[func](*_shapes_only(args)) for (func, args, _), count in self.calls.items())

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def replay(self, dtype: torch.dtype | None = None):
        """A callable that runs every recorded product once, on fresh tensors, back to back; in ``dtype`` instead of
        the recorded floating dtypes when given."""
        generator = torch.Generator().manual_seed(0)
        prepared = []
        for (func, args, kwargs), count in self.calls.items():
            args = tuple(_in_dtype(entry, None if func in RECORDED_DTYPE_ONLY else dtype) for entry in args)
            materialised = _grouped_offsets([_materialise(entry, generator) for entry in args], args)
            prepared.append((func, materialised, dict(_materialise(entry, generator) for entry in kwargs), count))

        def run() -> None:
            with torch.no_grad():
                for func, args, kwargs, count in prepared:
                    for _ in range(count):
                        func(*args, **kwargs)

        return run

    def by_shape(self, limit: int = 10) -> list[dict]:
        rows = []
        for (func, args, _), count in self.calls.items():
            shapes = [entry[1] for entry in args if entry[0] == "tensor"]
            rows.append({"op": func.__name__.split(".")[0], "shapes": " x ".join(map(str, shapes)), "calls": count,
                         "GFLOP": count * MATMULS[func](*_shapes_only(args)) / 1e9})
        return sorted(rows, key=lambda row: -row["GFLOP"])[:limit]


class _Shape:
    def __init__(self, shape):
        self.shape = shape


def _shapes_only(args) -> list:
    return [_Shape(entry[1]) if entry[0] == "tensor" else entry[-1] for entry in args]


def record_phase_matmuls(batch_size: int = JOB_BATCH[0], seq_len: int = JOB_BATCH[1],
                         around: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None,
                         ) -> dict[str, MatmulFloor]:
    """The matrix products of each phase of one job step (its second: the first allocates the optimizer state),
    taken from a step of its own with the eager references (neither SiTU-GLU nor AttnRes has a matrix product; the
    compiled kernels would run eagerly under the recording mode anyway); with ``around(model)`` entered for the
    recorded step."""
    step = job_training_step(batch_size, seq_len, fused_kernels=False)
    step()
    recorders = {phase: MatmulRecorder() for phase in PHASES}
    with around(step.model) if around is not None else contextlib.nullcontext():
        step(recorders)
    return {phase: MatmulFloor(recorder.calls) for phase, recorder in recorders.items()}


def record_matmuls(batch_size: int = JOB_BATCH[0], seq_len: int = JOB_BATCH[1],
                   around: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None,
                   ) -> MatmulFloor:
    """The matrix products of one whole job step (`record_phase_matmuls` together)."""
    return MatmulFloor.together(record_phase_matmuls(batch_size, seq_len, around).values())


def large_gemm_rate(dtype: torch.dtype = torch.float32, size: int = 1024) -> float:
    """FLOP/s of one large square product, the rate the CPU's GEMM reaches at its best shapes."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    seconds = time_interleaved({"gemm": lambda: a @ b}, repeats=5)["gemm"]
    return 2 * size**3 / seconds


def run(profiled_steps: int = 3, repeats: int = 3, fill_uninitialized_memory: bool = False) -> dict:
    torch.use_deterministic_algorithms(True)  # as the job's full_determinism
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized_memory  # the job's Trainer turns it off
    phase_floors = record_phase_matmuls()
    floor = MatmulFloor.together(phase_floors.values())
    step = job_training_step()
    for _ in range(2):  # compiles the fused kernels, allocates the optimizer state
        step()
    # The same step without QK-Clip (it watches every MLA logit in training forwards): what the policy costs.
    without_qk_clip = job_training_step(qk_clip=False)
    for _ in range(2):
        without_qk_clip()
    eager_passes = with_eager_optimizer_passes(job_training_step())
    for _ in range(2):
        eager_passes()
    replays = {"floor": floor.replay(), **{f"{phase} floor": phase_floors[phase].replay() for phase in PHASES}}
    times = time_interleaved({"step": step, "without QK-Clip": without_qk_clip, "eager passes": eager_passes,
                              **replays}, repeats=repeats)
    phases, eager_phases = phase_times({"step": step, "eager passes": eager_passes}, 2 * repeats).values()
    profile = least_disturbed_profile(step, profiled_steps)
    wall, gemm = times["step"], large_gemm_rate()
    summary = {
        "step ms": 1e3 * wall, "tokens/s": step.input_ids.numel() / wall,
        "step without QK-Clip ms": 1e3 * times["without QK-Clip"],
        "step, Muon's elementwise passes eager ms": 1e3 * times["eager passes"],
        **{f"{name} ms": 1e3 * seconds for name, seconds in phases.items()},
        "optimizer step, Muon's elementwise passes eager ms": 1e3 * eager_phases["optimizer step"],
        "matmul floor ms": 1e3 * times["floor"], "step / floor": wall / times["floor"],
        "matmul GFLOP / step": floor.flops / 1e9, "step GFLOP/s": floor.flops / wall / 1e9,
        "large-GEMM GFLOP/s": gemm / 1e9, "share of large-GEMM rate %": 100 * floor.flops / wall / gemm,
    }
    top = sorted(profile.by_operator.items(), key=lambda item: -item[1])[:12]
    return {
        "title": f"Default kimi-k3-train step, batch {tuple(step.input_ids.shape)}: time by operator class",
        "tables": [
            {"caption": "Step, phases (fastest of each), matmul floor, FLOP rate.", "columns": list(summary),
             "rows": [summary]},
            {"caption": "Each phase against the matrix products it runs, replayed back to back.",
             "columns": ["phase", "ms", "matmul floor ms", "phase / floor", "matmul GFLOP", "matmul calls"],
             "rows": [{"phase": phase, "ms": 1e3 * phases[phase], "matmul floor ms": 1e3 * times[f"{phase} floor"],
                       "phase / floor": phases[phase] / times[f"{phase} floor"],
                       "matmul GFLOP": phase_floors[phase].flops / 1e9, "matmul calls": phase_floors[phase].count}
                      for phase in PHASES]},
            {"caption": "Self CPU time by class (least-disturbed profiled step), scaled to the unprofiled step.",
             "columns": ["class", "share of step %", "ms / step"], "rows": breakdown_rows(profile, wall)},
            {"caption": "Top operators by self time, share of the profiled step.", "columns": ["operator", "%"],
             "rows": [{"operator": name, "%": 100 * seconds / profile.wall} for name, seconds in top]},
            {"caption": "Largest matmul shapes of one step.", "columns": ["op", "shapes", "calls", "GFLOP"],
             "rows": floor.by_shape()},
        ],
        "notes": [f"Newton–Schulz dtype {step.optimizer.ns_dtype}; {profile.operators} operators per step, "
                  f"{floor.count} of them matrix products; profiled step {1e3 * profile.wall:,.0f} ms; new tensors "
                  f"{'filled' if fill_uninitialized_memory else 'not filled'} under deterministic algorithms."],
    }


def main() -> None:
    args = bench_arguments(__doc__, extra=lambda parser: parser.add_argument(
        "--fill-uninitialized-memory", action="store_true",
        help="let torch fill every new tensor first, as kimi-k3-train did before it turned that off"))
    report("step_profile", run(repeats=args.repeats or 3, fill_uninitialized_memory=args.fill_uninitialized_memory),
           args.json)


if __name__ == "__main__":
    main()

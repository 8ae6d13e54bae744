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
- **Matmul floor**: every matrix product of one step (forward, backward, Newton–Schulz), recorded in order by a
  dispatch mode with its shapes, strides, dtypes and where each operand lay, then replayed back to back in that order
  on random operands laid out the same way: products that shared a storage in the step share one in the replay, and
  grouped products split their rows as the step's routing did. That is the time the step would take if everything
  but its matrix products were free; each phase is also set against the products it runs itself. Beside it, the floor
  on shared operands (each shape's products reusing one set of operands, grouped rows split evenly), which keeps
  operands in cache that the step has to fetch: a lower figure than the step's products can reach.

    python benchmarks/step_profile.py                    # this CPU's kernels
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/step_profile.py
"""

import collections
import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

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


@dataclass(frozen=True)
class Operand:
    """A floating-point tensor operand of a recorded product: which of the step's storages it lies in (numbered in
    order of first use), and its view of that storage."""

    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def in_dtype(self, dtype: torch.dtype) -> "Operand":
        return replace(self, dtype=dtype)

    @property
    def layout(self) -> tuple:
        return "tensor", self.shape, self.stride, self.dtype

    @property
    def span(self) -> int:
        """Elements of the storage the view covers, from its first element to its last."""
        if not all(self.shape):
            return 0
        return 1 + sum((size - 1) * step for size, step in zip(self.shape, self.stride))

    @property
    def reach(self) -> int:
        """Bytes of the storage the view reaches, from the storage's start."""
        return (self.offset + self.span) * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class Counts:
    """An integer tensor operand (a grouped product's group offsets), kept by value: the step's own expert loads."""

    values: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def layout(self) -> tuple:
        return "integers", self.shape, self.values.dtype


class Call(NamedTuple):
    """One recorded product: its operator and its arguments, tensors as `Operand` or `Counts`."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict

    def operands(self) -> list:
        return [value for value in (*self.args, *self.kwargs.values()) if isinstance(value, (Operand, Counts))]

    @property
    def flops(self) -> int:
        return MATMULS[self.func](*self.args)

    @property
    def signature(self) -> tuple:
        """What the call computes on, without where its operands lie: shapes, strides, dtypes and other arguments."""
        return (self.func, tuple(map(_layout, self.args)),
                tuple((name, _layout(value)) for name, value in self.kwargs.items()))


def _layout(value) -> tuple:
    return value.layout if isinstance(value, (Operand, Counts)) else ("value", value)


class MatmulRecorder(TorchDispatchMode):
    """Records every matrix product that runs, in order: its operator, its operands (where each lies: recorders given
    one ``storages`` dict number the storages of one step alike) and its other arguments."""

    def __init__(self, storages: dict[int, int] | None = None):
        super().__init__()
        self.calls: list[Call] = []
        self._storages = {} if storages is None else storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS:
            self.calls.append(Call(func, tuple(map(self._operand, args)),
                                   {name: self._operand(value) for name, value in kwargs.items()}))
        return func(*args, **kwargs)

    def _operand(self, value):
        if not isinstance(value, torch.Tensor):
            return value
        if not value.is_floating_point():
            return Counts(value.clone())
        storage = self._storages.setdefault(value.untyped_storage().data_ptr(), len(self._storages))
        return Operand(storage, value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)


@dataclass
class MatmulFloor:
    """The matrix products of a step, in the order it ran them, to replay back to back."""

    calls: list[Call]

    @classmethod
    def together(cls, floors) -> "MatmulFloor":
        """One floor for the products of all ``floors`` (the phases of a step, recorded with shared storage numbers)."""
        return cls([call for floor in floors for call in floor.calls])

    @property
    def flops(self) -> float:
        return sum(call.flops for call in self.calls)

    @property
    def count(self) -> int:
        return len(self.calls)

    def replay(self, dtype: torch.dtype | None = None, shared_operands: bool = False) -> Callable[[], None]:
        """A callable that runs every recorded product once, back to back, in the recorded order; in ``dtype``
        instead of the recorded floating dtypes when given.

        The operands lie as they did in the step: products that read or wrote the same storage there share one here
        (a weight read by the forward and the backward, Newton–Schulz's reused buffers, the memory the allocator
        handed on from one activation to the next), and grouped products split their rows as the step's routing did.
        So the products find in cache what the products themselves left there, as if everything else in the step took
        no time. ``shared_operands=True`` gives every distinct shape one set of fresh operands that all its products
        reuse, with grouped rows split evenly: a product repeated over the layers then keeps its operands in cache,
        which the step cannot (the floor as first defined here, kept for comparison).
        """
        if shared_operands:
            return self._replay_on_shared_operands(dtype)
        generator = torch.Generator().manual_seed(0)
        calls = [_in_dtype(call, dtype) for call in self.calls]
        reach, first_dtype = collections.defaultdict(int), {}
        for operand in (operand for call in calls for operand in call.operands() if isinstance(operand, Operand)):
            reach[operand.storage] = max(reach[operand.storage], operand.reach)
            first_dtype.setdefault(operand.storage, operand.dtype)
        storages = {}
        for storage, size in reach.items():
            storages[storage] = torch.empty(-(-size // 8), dtype=torch.float64).view(torch.uint8)  # 8-byte aligned
            storages[storage].view(first_dtype[storage]).normal_(generator=generator)

        def materialise(value):
            if isinstance(value, Operand):
                return storages[value.storage].view(value.dtype).as_strided(value.shape, value.stride, value.offset)
            return value.values if isinstance(value, Counts) else value

        return _back_to_back([(call.func, [materialise(value) for value in call.args],
                               {name: materialise(value) for name, value in call.kwargs.items()}, 1) for call in calls])

    def _replay_on_shared_operands(self, dtype: torch.dtype | None) -> Callable[[], None]:
        generator = torch.Generator().manual_seed(0)
        by_signature: dict[tuple, list[Call]] = {}
        for call in (_in_dtype(call, dtype) for call in self.calls):
            by_signature.setdefault(call.signature, []).append(call)
        prepared = []
        for calls in by_signature.values():
            func, args, kwargs = calls[0]
            args = [_fresh(value, generator) for value in args]
            args = [_even_split(value, args[0].shape[0]) if isinstance(value, Counts) else value for value in args]
            prepared.append((func, args, {name: _fresh(value, generator) for name, value in kwargs.items()},
                             len(calls)))
        return _back_to_back(prepared)

    def by_shape(self, limit: int = 10) -> list[dict]:
        rows = {}
        for call in self.calls:
            row = rows.setdefault(call.signature, {
                "op": call.func.__name__.split(".")[0], "calls": 0, "GFLOP": 0.0,
                "shapes": " x ".join(str(operand.shape) for operand in call.args if isinstance(operand, Operand))})
            row["calls"] += 1
            row["GFLOP"] += call.flops / 1e9
        return sorted(rows.values(), key=lambda row: -row["GFLOP"])[:limit]


def _back_to_back(prepared: list[tuple]) -> Callable[[], None]:
    """Runs each prepared ``(operator, args, kwargs, times)`` that many times, in order, without autograd."""
    def run() -> None:
        with torch.no_grad():
            for func, args, kwargs, times in prepared:
                for _ in range(times):
                    func(*args, **kwargs)

    return run


def _in_dtype(call: Call, dtype: torch.dtype | None) -> Call:
    """``call`` with its floating operands in ``dtype``; products without a 16-bit kernel keep their own."""
    if dtype is None or call.func in RECORDED_DTYPE_ONLY:
        return call

    def retyped(value):
        return value.in_dtype(dtype) if isinstance(value, Operand) else value

    return Call(call.func, tuple(map(retyped, call.args)), {name: retyped(value) for name, value in call.kwargs.items()})


def _fresh(value, generator: torch.Generator):
    """An operand's view on a storage of its own, of random values."""
    if not isinstance(value, Operand):
        return value
    return torch.randn(value.span, generator=generator).to(value.dtype).as_strided(value.shape, value.stride)


def _even_split(counts: Counts, rows: int) -> torch.Tensor:
    """Group offsets that split ``rows`` evenly over the groups."""
    groups = counts.shape[0]
    return torch.linspace(rows / groups, rows, groups).round().to(counts.values.dtype)


def record_phase_matmuls(batch_size: int = JOB_BATCH[0], seq_len: int = JOB_BATCH[1],
                         around: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None,
                         ) -> dict[str, MatmulFloor]:
    """The matrix products of each phase of one job step (its second: the first allocates the optimizer state),
    taken from a step of its own with the eager references (neither SiTU-GLU nor AttnRes has a matrix product; the
    compiled kernels would run eagerly under the recording mode anyway); with ``around(model)`` entered for the
    recorded step."""
    step = job_training_step(batch_size, seq_len, fused_kernels=False)
    step()
    storages = {}  # one numbering for the three phases: the backward reads what the forward wrote
    recorders = {phase: MatmulRecorder(storages) for phase in PHASES}
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
    replays = {"floor": floor.replay(), "floor on shared operands": floor.replay(shared_operands=True),
               **{f"{phase} floor": phase_floors[phase].replay() for phase in PHASES}}
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
        "matmul floor, shared operands ms": 1e3 * times["floor on shared operands"],
        "step / floor on shared operands": wall / times["floor on shared operands"],
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

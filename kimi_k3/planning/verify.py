"""Check a :mod:`kimi_k3.planning.plan` against the real sharding, on the meta device, in one process.

The model is built on the meta device (no memory for its weights), torch's fake process group stands in for
``world_size`` ranks (this process is rank 0; collectives return at once), and the project's own code shards it:
:func:`kimi_k3.parallel.sharding.shard_decoder_layers` (what accelerate's FSDP2 plugin does) or transformers' load-time
sharding, ``maybe_distribute_model`` with ``DistributedConfig(fsdp_size, ep_size)`` and
``KimiK3Config.base_model_ep_plan`` (what ``from_pretrained(distributed_config=...)`` does before reading weights).
Gradients are given, shaped like their parameters as FSDP2's reduce-scatter leaves them, to exactly the parameters
a real backward reaches (found by one backward of a narrow model with the same layer pattern), and one optimizer
step of :class:`kimi_k3.optim.muon.PerHeadMuon` or ``torch.optim.AdamW`` allocates the optimizer state. What rank 0 then
holds is counted in elements; every parameter's mesh and placements, the bytes the step hands to collectives and
the Newton–Schulz block assignment the optimizer computed from the real DTensors are compared with the plan's.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from kimi_k3.parallel.sharding import shard_decoder_layers, sharded_loading_config
from kimi_k3.planning.model_inventory import build_model, parameters_reached_by_backward
from kimi_k3.optim.muon import PerHeadMuon
from kimi_k3.planning.plan import ElementCounts, Layout, Plan, Setup, validate
from modeling_kimi_k3 import KimiK3ForCausalLM

SHARDING_PATHS = ("accelerate", "transformers")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_STATE_FIELDS = {"momentum_buffer": "muon_momentum", "exp_avg": "adamw_exp_avg", "exp_avg_sq": "adamw_exp_avg_sq",
                 "step": "adamw_steps"}
_COLLECTIVES = ("all_gather", "allgather", "all_reduce", "allreduce", "reduce_scatter", "all_to_all", "alltoall",
                "broadcast")
# c10d ops whose first argument is the output buffer: the input is the second.
_INPUT_SECOND = ("c10d::_allgather_base_", "c10d::allgather_", "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_",
                 "c10d::alltoall_base_", "c10d::alltoall_")


class CollectivePayload(TorchDispatchMode):
    """Bytes of the tensors this rank hands to torch.distributed collectives, c10d and functional (DTensor's), and of
    what each call leaves in its output; a functional collective's own c10d call is not counted again. Works under the
    fake process group too."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.received: list[int] = []
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        namespace, _, op = name.partition("::")
        if namespace not in ("c10d", "_c10d_functional") or not any(kind in op for kind in _COLLECTIVES):
            return func(*args, **(kwargs or {}))
        outermost = self._depth == 0
        if outermost:
            given = args[1] if name in _INPUT_SECOND else args[0]
            self.calls.append((name, _nbytes(given)))
        self._depth += 1
        try:
            result = func(*args, **(kwargs or {}))
        finally:
            self._depth -= 1
        if outermost:
            self.received.append(_nbytes(result if namespace == "_c10d_functional" else args[0]))
        return result

    @property
    def payload(self) -> int:
        return sum(size for _, size in self.calls)


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    else:
        for item in value:
            yield from _tensors(item)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """torch.distributed initialised as rank ``rank`` of ``world_size`` with the fake backend (no other processes)."""
    if dist.is_initialized():
        raise RuntimeError("verifying a plan needs its own fake process group; torch.distributed is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def default_sharding_path(layout: Layout) -> str:
    """Expert parallelism exists only in transformers' load-time sharding; plain FSDP2 goes through our own."""
    return "transformers" if layout.ep > 1 else "accelerate"


def shard(model, layout: Layout, path: str):
    if path == "accelerate":
        return shard_decoder_layers(model)
    distributed_config, _, mesh_manager = KimiK3ForCausalLM.prepare_distribute_model(
        sharded_loading_config(layout.fsdp, layout.ep)
    )
    return KimiK3ForCausalLM.maybe_distribute_model(model, distributed_config, mesh_manager)


def build_optimizer(model, setup: Setup):
    """Per-Head Muon at the plan's Newton–Schulz precision, or AdamW."""
    if setup.optimizer == "muon":
        return PerHeadMuon.for_model(model, ns_dtype=NS_DTYPES[setup.ns_dtype])
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def local_numel(tensor) -> int:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()


@dataclass
class ShardedRun:
    """What rank 0 holds after the real sharding and one optimizer step, the layout of every parameter, what the step
    handed to collectives, and the Newton–Schulz plans the optimizer computed."""

    counts: ElementCounts
    sent: CollectivePayload
    placements: dict[str, tuple]
    newton_schulz_plans: list


def sharded_run(config, layout: Layout, setup: Setup, path: str | None = None) -> ShardedRun:
    validate(config, layout, setup)
    path = path or default_sharding_path(layout)
    if path not in SHARDING_PATHS:
        raise ValueError(f"`path` must be one of {SHARDING_PATHS}, got {path!r}.")
    if path == "accelerate" and layout.ep > 1:
        raise ValueError("`path` 'accelerate' (shard_decoder_layers) has no expert parallelism; use 'transformers'.")
    reached = parameters_reached_by_backward(config, setup.lora_rank)
    with fake_process_group(layout.world_size):
        model = shard(build_model(config, "meta", setup.lora_rank), layout, path)
        updated = [p for name, p in model.named_parameters() if p.requires_grad and name in reached]
        for p in updated:
            p.grad = torch.zeros_like(p)
        optimizer = build_optimizer(model, setup)
        with CollectivePayload() as sent:
            optimizer.step()
        plans = optimizer.newton_schulz_plans() if isinstance(optimizer, PerHeadMuon) else []
        placements = {name: placement_of(p) for name, p in model.named_parameters()}
        return ShardedRun(held_counts(model, optimizer), sent, placements, plans)


def placement_of(tensor) -> tuple:
    """(mesh shape, mesh ranks in row-major order, placements) of a DTensor; None for a plain tensor."""
    if not isinstance(tensor, DTensor):
        return None
    mesh = tensor.device_mesh.mesh
    return tuple(mesh.shape), tuple(mesh.flatten().tolist()), tuple(tensor.placements)


def differences(plan: Plan, run: ShardedRun) -> list[str]:
    """Where ``plan`` disagrees with the real sharding of ``run``: counts, placements, the optimizer step's collectives
    and its Newton–Schulz assignment (FLOPs and exchanged elements of every rank)."""
    found = plan.counts.differences(run.counts)
    for name, planned in plan.placements.items():
        if run.placements[name] != planned:
            found.append(f"{name}: plan places it {planned}, the sharded model {run.placements[name]}")
            break
    calls, payload = plan.newton_schulz_traffic
    if (calls, payload) != (len(run.sent.calls), run.sent.payload):
        found.append(f"optimizer-step collectives: plan {calls} calls / {payload:,} bytes vs {len(run.sent.calls)} "
                     f"calls / {run.sent.payload:,} bytes handed in by rank 0")
    expected = [plan.newton_schulz] if plan.newton_schulz is not None else []
    summary = [(p.flops_per_rank(), p.moved_elements()) for p in expected]
    if summary != [(p.flops_per_rank(), p.moved_elements()) for p in run.newton_schulz_plans]:
        found.append("Newton-Schulz: the plan's block assignment (FLOPs and exchanged elements per rank) is not the "
                     "optimizer's")
    return found


def held_counts(model, optimizer) -> ElementCounts:
    """Elements this rank holds: its parameter and gradient shards, optimizer state and buffers."""
    state = dict.fromkeys(_STATE_FIELDS.values(), 0)
    for per_param in optimizer.state.values():
        for key, tensor in per_param.items():
            state[_STATE_FIELDS[key]] += local_numel(tensor)
    return ElementCounts(
        parameters=sum(local_numel(p) for p in model.parameters()),
        gradients=sum(local_numel(p.grad) for p in model.parameters() if p.grad is not None),
        buffers=sum(local_numel(b) for b in model.buffers()),
        **state,
    )

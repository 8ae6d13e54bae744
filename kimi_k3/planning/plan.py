"""Per-rank memory and per-step communication of a Kimi K3 training run, for a layout of ranks.

The plan reads the model: its parameters, the optimizer's Muon blocks and step order come from the model built on the
meta device and :func:`kimi_k3.optim.muon.build_param_groups` (:mod:`kimi_k3.planning.model_inventory`). It shards every parameter
the way the project's two FSDP2 paths do (:func:`kimi_k3.parallel.sharding.shard_decoder_layers`, and transformers'
load-time sharding with ``DistributedConfig(fsdp_size, ep_size)`` and ``KimiK3Config.base_model_ep_plan``), stated
once as DTensor placements (:func:`planned_placements`) from which :mod:`kimi_k3.parallel.shard_layout` derives what every
rank holds, and sizes the optimizer state :class:`kimi_k3.optim.muon.PerHeadMuon` allocates. Newton–Schulz's work,
exchange and workspace come from the block assignment the optimizer itself runs
(:class:`kimi_k3.optim.split_newton_schulz.ShardedPlan`) on those placements. :mod:`kimi_k3.planning.verify` checks the
counts, the placements and the assignment against the sharded model and optimizer on the meta device. Activations,
FSDP gather buffers, the Newton–Schulz workspace and the communication volumes are estimates from the shapes.

Sharding rule (torch.chunk along dim 0, as FSDP2 does): over a group of g ranks a tensor of d0 rows keeps
ceil(d0 / g) rows per rank (the last ranks fewer, but FSDP2 pads every rank's storage to that size). Under expert
parallelism the expert dim is first split evenly over ``ep`` ranks, then FSDP2 shards the local experts over the
``fsdp / ep`` ranks that hold the same experts.

Units: bytes, shown as GB = 1e9 bytes.
"""

import contextlib
import functools
import inspect
from dataclasses import dataclass, field

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from checkpoint_format_kimi_k3 import MXFP4_GROUP_SIZE
from kda_kimi_k3 import chunk_kda
from kimi_k3.optim.muon import NS_STEPS
from kimi_k3.optim.split_newton_schulz import ShardedPlan, Tiling
from kimi_k3.parallel.shard_layout import Holding, holding_at, mesh_holdings
from kimi_k3.planning.model_inventory import ParamSpec, model_inventory
from kimi_k3.policies.quantile_balancing import QuantileBalancing


def default_of(function, argument: str):
    """``argument``'s default, read from the function that owns it, so the plan follows the code it plans."""
    return inspect.signature(function).parameters[argument].default


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZERS = ("muon", "adamw")
# MXFP4: 4-bit E2M1 values plus one E8M0 scale byte per group (OCP microscaling).
MXFP4_BITS_PER_ELEMENT = 4 + 8 / MXFP4_GROUP_SIZE
INT64_BYTES = 8
FP32_BYTES = 4
GB = 1e9
KDA_CHUNK_SIZE = default_of(chunk_kda, "chunk_size")
NEWTON_SCHULZ_ROW = "Newton-Schulz all-to-all (cut blocks)"
QUANTILE_BALANCING_ROW = "Quantile Balancing all-reduce"
# Copies of a batch of blocks Newton–Schulz holds at once: the input cast, the iterate, the Gram matrix and its
# polynomial (at most the iterate's size each), and the output.
NEWTON_SCHULZ_COPIES = 5


class PlanError(ValueError):
    """A layout or setting the sharding code cannot run; the message is one line naming the field."""


# ---------------------------------------------------------------------------------------------------------------------
# What the training policies hold beside the model
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BufferSpec:
    """A buffer every rank keeps whole (routers' statistics, MLA logit maxima)."""

    name: str
    numel: int
    itemsize: int
    category: str


def statistics_specs(config, setup) -> list[BufferSpec]:
    """What the training policies record beside the model, whole on every rank: per MoE layer the token counts and,
    under Quantile Balancing, the [experts, bins] required-bias histogram (int64); with QK-Clip the per-head logit
    maxima of every MLA layer (fp32)."""
    specs = []
    for i, (layer_type, mlp_type) in enumerate(zip(config.layer_types, config.mlp_layer_types)):
        if mlp_type == "sparse":
            counts = config.num_experts * (1 + (setup.qb_num_bins if setup.quantile_balancing else 0))
            specs.append(BufferSpec(f"layer {i} router statistics", counts, INT64_BYTES, "router statistics"))
        if layer_type == "full_attention" and setup.qk_clip:
            specs.append(BufferSpec(f"layer {i} logit maxima", config.num_attention_heads, FP32_BYTES,
                                    "attention logit maxima"))
    return specs


# ---------------------------------------------------------------------------------------------------------------------
# Layout and setup
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """``fsdp`` ranks shard every parameter (and each sees its own batch); ``ep`` of them split the experts."""

    world_size: int
    fsdp: int
    ep: int = 1
    tp: int = 1

    @property
    def efsdp(self) -> int:
        """Ranks holding the same experts, which FSDP2 shards them over (transformers' ``efsdp_size``)."""
        return self.fsdp * self.tp // self.ep


@dataclass(frozen=True)
class Setup:
    """What a run trains with: batch shape, dtypes, optimizer, LoRA, QAT, and the GPU it must fit."""

    micro_batch: int = 1
    sequence_length: int = 4096
    gradient_accumulation: int = 1
    gradient_checkpointing: bool = True
    param_dtype: str = "fp32"
    compute_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    optimizer_dtype: str = "fp32"
    ns_dtype: str = "bf16"  # PerHeadMuon's Newton–Schulz precision ("auto" picks bf16 on GPUs)
    optimizer: str = "muon"
    lora_rank: int = 0
    qat: bool = False
    qk_clip: bool = True
    quantile_balancing: bool = True  # histogram estimator; False: token counts only (the sign and "none" rules)
    qb_num_bins: int = default_of(QuantileBalancing.__init__, "num_bins")
    gpu_memory_gb: float = 141.0
    reserved_gb: float = 4.0

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.sequence_length


def validate(config, layout: Layout, setup: Setup) -> None:
    """Refuse, in one line naming the field, what the sharding code or this plan cannot run. Runs before anything is
    instantiated."""
    for name in ("world_size", "fsdp", "ep", "tp"):
        if getattr(layout, name) < 1:
            raise PlanError(f"`{name}` must be a positive integer, got {getattr(layout, name)}.")
    if layout.tp != 1:
        has_plan = bool(getattr(config, "base_model_tp_plan", None))
        why = "this plan does not model tensor parallelism" if has_plan else "KimiK3Config has no base_model_tp_plan"
        raise PlanError(f"`tp` must be 1 ({why}), got {layout.tp}.")
    if layout.fsdp * layout.tp != layout.world_size:
        raise PlanError(f"The layout does not cover the world: fsdp ({layout.fsdp}) x tp ({layout.tp}) = "
                        f"{layout.fsdp * layout.tp} ranks, but `world_size` is {layout.world_size}.")
    if layout.ep > 1 and getattr(config, "enabled_variants", ()):
        raise PlanError(f"`ep` must be 1 with {config.enabled_variants[0]}: the expert-parallel plan names the "
                        f"released tensors only, got {layout.ep}.")
    if layout.ep > 1:
        if config.num_experts is None or not any(t == "sparse" for t in config.mlp_layer_types):
            raise PlanError(f"`ep` is {layout.ep} but the config has no MoE layers (num_experts={config.num_experts}).")
        if layout.fsdp % layout.ep:
            raise PlanError(f"`ep` ({layout.ep}) must divide `fsdp` ({layout.fsdp}) (transformers' DistributedConfig).")
        if config.num_experts % layout.ep:
            raise PlanError(f"`ep` ({layout.ep}) must divide the {config.num_experts} experts (num_experts); "
                            f"sizes that divide both it and fsdp: {common_divisors(config.num_experts, layout.fsdp)}.")
    for name in ("param_dtype", "compute_dtype", "grad_dtype", "optimizer_dtype", "ns_dtype"):
        if getattr(setup, name) not in DTYPE_BYTES:
            raise PlanError(f"`{name}` must be one of {tuple(DTYPE_BYTES)}, got {getattr(setup, name)!r}.")
    if setup.ns_dtype not in ("bf16", "fp32"):
        raise PlanError(f"`ns_dtype` must be one of ('bf16', 'fp32') (PerHeadMuon's choices), got {setup.ns_dtype!r}.")
    if setup.optimizer not in OPTIMIZERS:
        raise PlanError(f"`optimizer` must be one of {OPTIMIZERS}, got {setup.optimizer!r}.")
    if setup.lora_rank < 0:
        raise PlanError(f"`lora_rank` must be >= 0 (0 = full fine-tuning), got {setup.lora_rank}.")
    if setup.lora_rank and setup.optimizer == "muon":
        raise PlanError("`optimizer` 'muon' needs the per-head attention projections trainable, which LoRA freezes "
                        "(PerHeadMuon.for_model refuses such a model); use `optimizer` 'adamw' with LoRA.")
    if setup.lora_rank and layout.ep > 1:
        raise PlanError("LoRA is planned with `ep` 1 only (peft adds its adapters before FSDP2 wraps the layers; "
                        "load-time expert parallelism shards the model before peft sees it).")
    for name in ("micro_batch", "sequence_length", "gradient_accumulation"):
        if getattr(setup, name) < 1:
            raise PlanError(f"`{name}` must be a positive integer, got {getattr(setup, name)}.")


def common_divisors(a: int, b: int) -> list[int]:
    return [d for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0]


def planned_placements(expert: bool, layout: Layout) -> tuple[tuple[int, ...], tuple[int, ...], tuple]:
    """(mesh shape, mesh ranks in row-major order, placements) of a parameter's DTensor under ``layout`` (``expert``:
    a stacked-expert tensor): FSDP2's ``Shard(0)`` over all ranks; under expert parallelism transformers' 2-D
    (efsdp, ep) mesh for the experts, split over ``ep`` first and FSDP2-sharded over the ``efsdp`` ranks holding the
    same experts."""
    ranks = tuple(range(layout.world_size))
    if expert and layout.ep > 1:
        return (layout.efsdp, layout.ep), ranks, (_StridedShard(0, split_factor=layout.ep), Shard(0))
    return (layout.fsdp,), ranks, (Shard(0),)


def holdings(spec: ParamSpec, layout: Layout) -> tuple[Holding, ...]:
    """What every rank holds of ``spec`` under ``layout`` (:mod:`kimi_k3.parallel.shard_layout`), in rank order."""
    return _holdings(spec.shape, spec.expert, layout)


@functools.lru_cache(maxsize=256)
def _holdings(shape, expert: bool, layout: Layout) -> tuple[Holding, ...]:
    # One tuple per kind of parameter: plans share the analysis of parameters holding alike (ShardedPlan).
    mesh_shape, ranks, placements = planned_placements(expert, layout)
    by_rank = mesh_holdings(shape, mesh_shape, ranks, placements)
    return tuple(by_rank[rank] for rank in ranks)


def local_numel(spec: ParamSpec, layout: Layout) -> int:
    """Elements of ``spec`` on rank 0 (the largest shard: torch.chunk gives the first ranks the extra rows)."""
    mesh_shape, _, placements = planned_placements(spec.expert, layout)
    return holding_at(spec.shape, mesh_shape, (0,) * len(mesh_shape), placements).numel


# ---------------------------------------------------------------------------------------------------------------------
# Exact per-rank counts (checked by parallel_verify)
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ElementCounts:
    """Elements rank 0 holds; ``adamw_steps`` is the number of AdamW step counters (one scalar per tensor)."""

    parameters: int
    gradients: int
    muon_momentum: int
    adamw_exp_avg: int
    adamw_exp_avg_sq: int
    adamw_steps: int
    buffers: int

    def differences(self, other: "ElementCounts") -> list[str]:
        return [f"{name}: plan {getattr(self, name):,} vs sharded model {getattr(other, name):,}"
                for name in self.__dataclass_fields__ if getattr(self, name) != getattr(other, name)]


def updated_specs(specs: list[ParamSpec]) -> list[ParamSpec]:
    return [spec for spec in specs if spec.trainable and spec.receives_grad]


def element_counts(config, layout: Layout, setup: Setup, specs: list[ParamSpec] | None = None) -> ElementCounts:
    inventory = model_inventory(config, setup.lora_rank)
    specs = inventory.specs if specs is None else specs
    updated = updated_specs(specs)
    by_optimizer = {name: sum(local_numel(s, layout) for s in updated if optimizer_of(s, setup) == name)
                    for name in OPTIMIZERS}
    return ElementCounts(
        parameters=sum(local_numel(s, layout) for s in specs),
        gradients=sum(local_numel(s, layout) for s in updated),
        muon_momentum=by_optimizer["muon"],
        adamw_exp_avg=by_optimizer["adamw"],
        adamw_exp_avg_sq=by_optimizer["adamw"],
        adamw_steps=sum(1 for s in updated if optimizer_of(s, setup) == "adamw"),
        buffers=inventory.buffer_elements,
    )


def optimizer_of(spec: ParamSpec, setup: Setup) -> str:
    return spec.optimizer if setup.optimizer == "muon" else "adamw"


# ---------------------------------------------------------------------------------------------------------------------
# Memory and communication
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    config: object
    layout: Layout
    setup: Setup
    counts: ElementCounts
    memory: dict[str, float] = field(default_factory=dict)  # bytes per rank by category
    estimated: set[str] = field(default_factory=set)  # categories that are estimates, not exact counts
    activations_other: float = 0.0  # activations with the other gradient-checkpointing setting
    communication: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    newton_schulz: ShardedPlan | None = None  # the optimizer's block assignment (Per-Head Muon only)
    placements: dict[str, tuple] = field(default_factory=dict)  # name -> planned_placements

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def budget(self) -> float:
        return (self.setup.gpu_memory_gb - self.setup.reserved_gb) * GB

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    @property
    def newton_schulz_traffic(self) -> tuple[int, int]:
        """(collective calls, payload bytes handed in by rank 0) of one optimizer step's Newton–Schulz."""
        rows = [row for row in self.communication if row[0] == NEWTON_SCHULZ_ROW]
        return sum(row[2] for row in rows), sum(row[3] for row in rows)

    @property
    def largest_category(self) -> str:
        return max(self.memory, key=self.memory.get)


def make_plan(config, layout: Layout, setup: Setup, with_communication: bool = True, prune: bool = False) -> Plan:
    """The plan of one layout. ``prune=True`` (the search) skips Newton–Schulz's block assignment when the rest alone
    already exceeds the budget, leaving its workspace at 0."""
    validate(config, layout, setup)
    inventory = model_inventory(config, setup.lora_rank)
    specs = list(inventory.specs)
    counts = element_counts(config, layout, setup, specs)
    placements = {spec.name: planned_placements(spec.expert, layout) for spec in specs}
    plan = Plan(config, layout, setup, counts, placements=placements)
    b = {name: DTYPE_BYTES[getattr(setup, f"{name}_dtype")] for name in ("param", "compute", "grad", "optimizer", "ns")}
    statistics = statistics_specs(config, setup)
    plan.memory = {
        "parameters": counts.parameters * b["param"],
        "gradients": counts.gradients * b["grad"],
        "Muon momentum": counts.muon_momentum * b["optimizer"],
        "AdamW moments": (counts.adamw_exp_avg + counts.adamw_exp_avg_sq) * b["optimizer"] + counts.adamw_steps * FP32_BYTES,
        "router statistics": inventory.buffer_bytes + sum(x.numel * x.itemsize for x in statistics
                                                          if x.category == "router statistics"),
        "attention logit maxima": sum(x.numel * x.itemsize for x in statistics if x.category == "attention logit maxima"),
        "FSDP gathered units": fsdp_gather_buffers(specs, layout, b),
        "Newton-Schulz workspace": 0,
    }
    with_ckpt, without_ckpt = activations(config, setup, b["compute"], True), activations(config, setup, b["compute"], False)
    plan.memory["activations"] = with_ckpt if setup.gradient_checkpointing else without_ckpt
    plan.activations_other = without_ckpt if setup.gradient_checkpointing else with_ckpt
    if setup.qat:
        plan.memory["QAT fake-quantized experts"] = qat_fake_quantized_experts(config, specs, layout, setup, b)
        exported = sum(local_numel(s, layout) for s in specs if s.expert) * MXFP4_BITS_PER_ELEMENT / 8
        plan.notes.append(
            f"QAT: each experts module's forward binds an MXFP4 fake-quantized copy of its gathered weights (compute "
            f"dtype), kept for backward: one MoE layer's with gradient checkpointing, every layer's without. The "
            f"exported MXFP4 shard of rank 0 (4.25 bits/element) would take {exported / GB:,.2f} GB."
        )
    plan.estimated = {"FSDP gathered units", "Newton-Schulz workspace", "activations", "QAT fake-quantized experts"}
    if setup.optimizer == "muon" and not (prune and not plan.fits):
        plan.newton_schulz = newton_schulz_plan(inventory.muon_step_order, layout)
        plan.memory["Newton-Schulz workspace"] = newton_schulz_workspace(plan.newton_schulz, b)
        plan.notes.append(newton_schulz_note(plan.newton_schulz))
    if with_communication:
        plan.communication = communication(config, specs, layout, setup, b, plan.newton_schulz)
    return plan


def _units(specs: list[ParamSpec], layout: Layout) -> dict[str, list[ParamSpec]]:
    """FSDP2 units: each decoder layer, the root, and under expert parallelism each layer's experts on their own."""
    units = {}
    for spec in specs:
        unit = f"{spec.unit}.experts" if spec.expert and layout.ep > 1 else spec.unit
        units.setdefault(unit, []).append(spec)
    return units


def _unit_group(unit: str, layout: Layout) -> int:
    return layout.efsdp if unit.endswith(".experts") else layout.fsdp


def fsdp_gather_buffers(specs, layout, b) -> float:
    """Two units gathered at once (the one computing and the one prefetched) in the compute dtype, plus one unit's
    unsharded gradients before the reduce-scatter (in the gradient dtype)."""
    sizes = sorted(sum(local_numel(s, layout) for s in unit) * _unit_group(name, layout)
                   for name, unit in _units(specs, layout).items())
    gathered = sum(sizes[-2:]) * b["compute"]
    largest_trainable = max(sum(local_numel(s, layout) for s in unit if s.trainable) * _unit_group(n, layout)
                            for n, unit in _units(specs, layout).items())
    return gathered + largest_trainable * b["grad"]


def qat_fake_quantized_experts(config, specs, layout: Layout, setup: Setup, b) -> float:
    """The fake-quantized expert weights QAT keeps between an experts module's forward and its backward."""
    moe_layers = sum(t == "sparse" for t in config.mlp_layer_types)
    experts = [s for s in specs if s.expert]
    gathered = sum(local_numel(s, layout) * (layout.efsdp if layout.ep > 1 else layout.fsdp) for s in experts)
    per_layer = gathered // max(moe_layers, 1)
    return per_layer * (1 if setup.gradient_checkpointing else moe_layers) * b["compute"]


def newton_schulz_plan(step_order: list[ParamSpec], layout: Layout) -> ShardedPlan:
    """PerHeadMuon's block assignment for the updated Muon parameters (in its step order) under ``layout``: every
    parameter is a DTensor on a mesh of all ranks, so they share one process group and one plan."""
    return ShardedPlan([Tiling.of(spec.shape, spec.block_pattern) for spec in step_order],
                       [holdings(spec, layout) for spec in step_order], NS_STEPS)


def newton_schulz_workspace(plan: ShardedPlan, b) -> float:
    """The most any rank holds at once in PerHeadMuon's sharded step, besides parameters, gradients and state.

    Exchange: its pieces of cut blocks (inputs, then results), the pieces it receives and returns for the blocks it
    owns, and those blocks whole, batched with Newton–Schulz's copies. Then, one parameter at a time: its local
    Nesterov update (gradient dtype), its home blocks batched with Newton–Schulz's copies, and the assembled update,
    while the cut pieces' results wait to be applied. An upper bound: Newton–Schulz runs its calls in chunks of at
    most ``CHUNK_ELEMENTS`` elements (or one block), and a parameter's blocks wait for others of their shape."""
    cut = plan.cut_elements()
    # Parameters of one shape, blocks and layout share their analysis (and so its object): count each kind once.
    kinds = {id(param): (held, param) for held, param in zip(plan.holdings, plan.params)}.values()
    largest = 0.0
    for rank in range(plan.world_size):
        exchange = 2 * cut["held"][rank] + 2 * cut["received"][rank] + NEWTON_SCHULZ_COPIES * cut["owned"][rank]
        one_param = max((held[rank].numel * (b["grad"] + b["ns"]) + NEWTON_SCHULZ_COPIES * param.home_elements[rank]
                         * b["ns"] for held, param in kinds), default=0)
        largest = max(largest, exchange * b["ns"], cut["held"][rank] * b["ns"] + one_param)
    return largest


def newton_schulz_note(plan: ShardedPlan) -> str:
    flops = plan.flops_per_rank()
    mean = sum(flops) / len(flops)
    return (f"Newton-Schulz: {plan.block_count:,} blocks, {len(plan.cut):,} of them cut by a shard boundary (these "
            f"travel); per rank {mean / 1e12:,.2f} TFLOP per step on average, the busiest {max(flops) / mean - 1:.1%} "
            f"above it.")


def activations(config, setup: Setup, compute_bytes: int, checkpointing: bool) -> float:
    """Saved activations of one micro-batch (estimate from the shapes; a fused attention kernel, no s x s matrix).

    Without checkpointing every layer keeps its intermediate tensors; with per-layer checkpointing each layer keeps
    its input (and AttnRes keeps its block snapshots) and one layer's intermediates exist during its recomputation.
    The logits (compute dtype, fp32 for the loss and its gradient) are counted either way."""
    n, h = setup.tokens, config.hidden_size
    per_layer = [_layer_activation_elements(config, i, n) for i in range(config.num_hidden_layers)]
    blocks = 0 if config.attn_res_block_size is None else -(-config.num_hidden_layers // config.attn_res_block_size)
    logits = n * config.vocab_size * (compute_bytes + 2 * FP32_BYTES)
    if checkpointing:
        kept = (config.num_hidden_layers + blocks) * n * h + max(per_layer)
    else:
        kept = sum(per_layer) + blocks * n * h
    return kept * compute_bytes + logits


def _layer_activation_elements(config, i: int, n: int) -> int:
    """Elements autograd saves in layer ``i`` for ``n`` tokens, counted per tensor kind from the model's forward
    (fp32 router scores count twice). Attention is taken as a fused kernel (no heads x s x s probabilities)."""
    h = config.hidden_size
    blocks = 1 if config.attn_res_block_size is None else i // config.attn_res_block_size + 1
    per_token = 2 * h + 4 * (blocks + 1) * h  # the two norms' inputs, AttnRes's stacked blocks in its two mixings
    if config.layer_types[i] == "linear_attention":
        heads, head_dim = config.linear_num_heads, config.linear_head_dim
        # q/k/v/gates before and after the convs, their fp32 chunked copies and the per-chunk [C, C] matrices.
        per_token += h + head_dim + 30 * heads * head_dim + 5 * heads * KDA_CHUNK_SIZE
    else:
        heads, v = config.num_attention_heads, config.v_head_dim
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        per_token += (h + 3 * (config.q_lora_rank or 0) + 3 * (config.kv_lora_rank + config.qk_rope_head_dim)
                      + 2 * heads * qk + heads * (config.qk_nope_head_dim + v) + 4 * heads * v)
    if config.mlp_layer_types[i] == "sparse":
        k, width = config.num_experts_per_token, config.routed_expert_hidden_size or h
        mi = config.moe_intermediate_size
        per_token += h + 2 * config.num_experts + 3 * width + k * (2 * width + 7 * mi)
        per_token += 6 * mi * config.num_shared_experts
    else:
        per_token += h + 6 * config.intermediate_size
    return n * per_token


def communication(config, specs, layout: Layout, setup: Setup, b, newton_schulz: ShardedPlan | None = None
                  ) -> list[tuple[str, int, int, float, float]]:
    """Per step: (collective, group size, calls, payload bytes this rank hands in, bytes this rank sends on a ring).

    A ring all-gather or reduce-scatter over g ranks sends (g-1)/g of the whole tensor per rank, an all-reduce twice
    that; an all-to-all sends the part of its payload bound for other ranks ((ep-1)/ep of it with balanced routes)."""
    rows = []
    micro = setup.gradient_accumulation
    for name, unit in _units(specs, layout).items():
        group = _unit_group(name, layout)
        if group == 1:
            continue
        shard = sum(local_numel(s, layout) for s in unit)
        gathers = (1 if name == "root" else 2) * micro  # layers re-gather for backward; the root stays unsharded
        trainable = sum(local_numel(s, layout) for s in unit if s.trainable)
        kind = "experts" if name.endswith(".experts") else "dense"
        rows.append((f"FSDP all-gather ({kind})", group, gathers, shard * b["compute"] * gathers,
                     shard * (group - 1) * b["compute"] * gathers))
        rows.append((f"FSDP reduce-scatter ({kind})", group, micro, trainable * group * b["grad"] * micro,
                     trainable * (group - 1) * b["grad"] * micro))
    rows = _merge_rows(rows)
    moe_layers = sum(t == "sparse" for t in config.mlp_layer_types)
    if layout.ep > 1 and moe_layers:
        width = config.routed_expert_hidden_size or config.hidden_size
        routes = setup.tokens * config.num_experts_per_token
        calls = (6 if setup.gradient_checkpointing else 4) * moe_layers * micro  # dispatch + combine, fwd (+recompute) + bwd
        payload = routes * width * b["compute"] * calls
        rows.append(("expert all-to-all", layout.ep, calls, payload, payload * (layout.ep - 1) / layout.ep))
    if layout.world_size > 1 and moe_layers:
        qb = quantile_balancing_payload(config, setup)
        rows.append((QUANTILE_BALANCING_ROW, layout.world_size, 1, qb, 2 * qb * (layout.world_size - 1) / layout.world_size))
    mla_layers = sum(t == "full_attention" for t in config.layer_types)
    if layout.world_size > 1 and setup.qk_clip and mla_layers and setup.optimizer == "muon" and not setup.lora_rank:
        payload = mla_layers * config.num_attention_heads * FP32_BYTES
        rows.append(("QK-Clip max all-reduce", layout.world_size, 1, payload, 2 * payload * (layout.world_size - 1) / layout.world_size))
    if newton_schulz is not None and newton_schulz.cut:
        moved = newton_schulz.moved_elements()[0] * b["ns"]
        rows.append((NEWTON_SCHULZ_ROW, layout.world_size, 2, moved, moved))
    return rows


def _merge_rows(rows):
    merged = {}
    for name, group, calls, payload, sent in rows:
        key = (name, group)
        old = merged.get(key, (0, 0.0, 0.0))
        merged[key] = (old[0] + calls, old[1] + payload, old[2] + sent)
    return [(name, group, *values) for (name, group), values in merged.items()]


def quantile_balancing_payload(config, setup) -> int:
    """Bytes of the one SUM all-reduce of ``QuantileBalancingCallback.update``: the token counts [L, n] and, with the
    histogram estimator, the histograms [L, n, bins] of all MoE layers, flattened into one int64 tensor."""
    return sum(spec.numel for spec in statistics_specs(config, setup) if spec.category == "router statistics") * INT64_BYTES


# ---------------------------------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------------------------------
def candidate_layouts(config, world_size: int, setup: Setup) -> list[Layout]:
    """Pure FSDP and every expert-parallel size the sharding code accepts at ``world_size`` (tp = 1)."""
    eps = [1]
    if config.num_experts is not None and not setup.lora_rank and "sparse" in config.mlp_layer_types:
        eps += common_divisors(config.num_experts, world_size)[1:]
    return [Layout(world_size, world_size, ep) for ep in eps]


def search(config, setup: Setup, max_world_size: int = 4096, step: int = 8) -> tuple[Plan | None, Plan]:
    """The smallest world size (a multiple of ``step``) with a layout that fits, and there the layout needing the
    least memory; ``(None, least-memory plan of the largest world size the sharding code accepts)`` when none fits."""
    if step < 1 or max_world_size < step:
        raise PlanError(f"`max_world_size` ({max_world_size}) must be >= the search step ({step}), both positive.")
    best = None
    for world_size in range(step, max_world_size + 1, step):
        plans = []
        for layout in candidate_layouts(config, world_size, setup):
            with contextlib.suppress(PlanError):
                plans.append(make_plan(config, layout, setup, with_communication=False, prune=True))
        if not plans:
            continue
        best = min(plans, key=lambda plan: plan.total)
        if best.fits:
            best = make_plan(config, best.layout, setup)
            return best, best
    if best is None:
        raise PlanError(f"No layout up to {max_world_size} ranks is accepted by the sharding code for this setup.")
    return None, make_plan(config, best.layout, setup)

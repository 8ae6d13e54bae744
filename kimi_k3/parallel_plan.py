"""Per-rank memory and per-step communication of a Kimi K3 training run, computed from the config alone.

The plan lists every parameter tensor the model builds (from the config fields, the way the model classes size
them), shards it the way the project's two FSDP2 paths do (:func:`kimi_k3.distributed.shard_decoder_layers`, and
transformers' load-time sharding with ``DistributedConfig(fsdp_size, ep_size)`` and
``KimiK3Config.base_model_ep_plan``), and sizes the optimizer state :class:`kimi_k3.muon.PerHeadMuon` allocates.
Those counts are exact, in elements, and :mod:`kimi_k3.parallel_verify` checks them against the sharded model and
optimizer on the meta device. Activations, FSDP gather buffers, the Newton–Schulz workspace and the communication
volumes are estimates from the shapes (the communication of Newton–Schulz and Quantile Balancing is checked against
a 2-process run in the tests).

Sharding rule (torch.chunk along dim 0, as FSDP2 does): over a group of g ranks a tensor of d0 rows keeps
ceil(d0 / g) rows per rank (the last ranks fewer, but FSDP2 pads every rank's storage to that size). Under expert
parallelism the expert dim is first split evenly over ``ep`` ranks, then FSDP2 shards the local experts over the
``fsdp / ep`` ranks that hold the same experts.

Units: bytes, shown as GB = 1e9 bytes.
"""

import contextlib
import math
from dataclasses import dataclass, field, replace

from kimi_k3.muon import _LAYER_PARAM, _head_rows_by_layer_type, newton_schulz_exchange_bytes
from variants_kimi_k3 import BASIS_OF_EXPERT_TENSOR

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZERS = ("muon", "adamw")
# MXFP4: 4-bit E2M1 values plus one E8M0 scale byte per group of 32 (OCP microscaling).
MXFP4_BITS_PER_ELEMENT = 4 + 8 / 32
INT64_BYTES = 8
FP32_BYTES = 4
GB = 1e9
KDA_CHUNK_SIZE = 64
NEWTON_SCHULZ_ROWS = ("Newton-Schulz all-to-all (split blocks)", "Newton-Schulz all-gather (expert updates)")
QUANTILE_BALANCING_ROW = "Quantile Balancing all-reduce"
# Attention projections LoRA adapts by default (peft ``target_modules`` names, matched on the module's last name).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj")


class PlanError(ValueError):
    """A layout or setting the sharding code cannot run; the message is one line naming the field."""


# ---------------------------------------------------------------------------------------------------------------------
# What the model holds
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its FSDP2 unit ("root" or "layers.<i>"), whether it is a stacked-expert tensor (split by
    expert parallelism), which half of Per-Head Muon updates it, and whether backward ever gives it a gradient."""

    name: str
    shape: tuple[int, ...]
    unit: str
    optimizer: str
    expert: bool = False
    trainable: bool = True
    receives_grad: bool = True
    muon_tag: tuple | None = None  # ("head_rows" | "expert_rows", rows of one block): PerHeadMuon's group key

    @property
    def block_pattern(self) -> tuple[int, ...] | None:
        """``kimi_k3.muon.row_pattern`` of the parameter's group: rows of each block of a period, None = whole."""
        if self.muon_tag is None:
            return None
        rows = self.muon_tag[1]
        return (rows,) if isinstance(rows, int) else tuple(rows)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BufferSpec:
    """A buffer every rank keeps whole (routers' statistics and bias, MLA logit maxima)."""

    name: str
    numel: int
    itemsize: int
    category: str


def muon_or_adamw(name: str, shape: tuple[int, ...], expert: bool) -> str:
    """The split of ``kimi_k3.muon.build_param_groups``: 2-D matrices and stacked experts (or shared-basis banks) to
    Muon; vectors, embeddings, ``lm_head``, the AttnRes pseudo-queries, the 3-D conv kernels and shared-basis
    coefficients to AdamW."""
    adamw_matrices = ("_res_proj.weight", "_coefficients")
    if len(shape) < 2 or "embed_tokens" in name or "lm_head" in name or name.endswith(adamw_matrices):
        return "adamw"
    return "muon" if len(shape) == 2 or expert or name.endswith(tuple(BASIS_OF_EXPERT_TENSOR)) else "adamw"


def _linear(name, out_features, in_features, unit):
    return name, (out_features, in_features), unit


def _layer_params(config, i: int) -> list[tuple]:
    """(name, shape, unit) of decoder layer ``i``, in the model's naming."""
    h, unit, prefix = config.hidden_size, f"layers.{i}", f"model.layers.{i}"
    params = [(f"{prefix}.input_layernorm.weight", (h,), unit), (f"{prefix}.post_attention_layernorm.weight", (h,), unit)]
    if config.attn_res_block_size is not None:
        for kind in ("self_attention", "mlp"):
            params += [_linear(f"{prefix}.{kind}_res_proj.weight", 1, h, unit), (f"{prefix}.{kind}_res_norm.weight", (h,), unit)]
    attn = f"{prefix}.self_attn"
    if config.layer_types[i] == "linear_attention":
        kda = config.linear_attn_config
        heads, head_dim, kernel = kda["num_heads"], kda["head_dim"], kda["short_conv_kernel_size"]
        proj = heads * head_dim
        params += [_linear(f"{attn}.{p}_proj.weight", proj, h, unit) for p in "qkv"]
        params += [(f"{attn}.{p}_conv1d.weight", (proj, 1, kernel), unit) for p in "qkv"]
        params += [_linear(f"{attn}.f_a_proj.weight", head_dim, h, unit), _linear(f"{attn}.f_b_proj.weight", proj, head_dim, unit),
                   (f"{attn}.A_log", (heads,), unit), (f"{attn}.dt_bias", (proj,), unit),
                   _linear(f"{attn}.b_proj.weight", heads, h, unit), _linear(f"{attn}.g_proj.weight", proj, h, unit),
                   (f"{attn}.o_norm.weight", (head_dim,), unit), _linear(f"{attn}.o_proj.weight", h, proj, unit)]
    else:
        heads, qk = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank is None:
            params.append(_linear(f"{attn}.q_proj.weight", heads * qk, h, unit))
        else:
            params += [_linear(f"{attn}.q_a_proj.weight", config.q_lora_rank, h, unit),
                       (f"{attn}.q_a_layernorm.weight", (config.q_lora_rank,), unit),
                       _linear(f"{attn}.q_b_proj.weight", heads * qk, config.q_lora_rank, unit)]
        params += [_linear(f"{attn}.kv_a_proj_with_mqa.weight", config.kv_lora_rank + config.qk_rope_head_dim, h, unit),
                   (f"{attn}.kv_a_layernorm.weight", (config.kv_lora_rank,), unit),
                   _linear(f"{attn}.kv_b_proj.weight", heads * (config.qk_nope_head_dim + config.v_head_dim),
                           config.kv_lora_rank, unit)]
        if config.mla_use_output_gate:
            params.append(_linear(f"{attn}.g_proj.weight", heads * config.v_head_dim, h, unit))
            if config.attention_gate_routing and config.mlp_layer_types[i] == "sparse":
                params.append((f"{attn}.g_proj.routing_weight", (heads, config.num_experts), unit))
        params.append(_linear(f"{attn}.o_proj.weight", h, heads * config.v_head_dim, unit))
    if config.mlp_layer_types[i] == "sparse":
        params += _moe_params(config, f"{prefix}.block_sparse_moe", unit)
    else:
        params += _mlp_params(f"{prefix}.mlp", h, config.intermediate_size, unit)
    return params


def _mlp_params(prefix, hidden, intermediate, unit):
    return [_linear(f"{prefix}.gate_proj.weight", intermediate, hidden, unit),
            _linear(f"{prefix}.up_proj.weight", intermediate, hidden, unit),
            _linear(f"{prefix}.down_proj.weight", hidden, intermediate, unit)]


def _moe_params(config, prefix, unit):
    h, latent, experts = config.hidden_size, config.routed_expert_hidden_size, config.num_experts
    width = latent or h
    params = [_linear(f"{prefix}.gate.weight", experts, h, unit)]
    if config.num_coarse_experts is not None:
        params.append(_linear(f"{prefix}.gate.coarse_gate.weight", config.num_coarse_experts, h, unit))
    if latent is not None:
        params += [_linear(f"{prefix}.routed_expert_down_proj.weight", latent, h, unit),
                   _linear(f"{prefix}.routed_expert_up_proj.weight", h, latent, unit)]
    params += _routed_expert_params(config, f"{prefix}.experts", width, unit)
    if config.latent_moe_use_norm:
        params.append((f"{prefix}.routed_expert_norm.weight", (width,), unit))
    if config.num_shared_experts > 0:
        params += _mlp_params(f"{prefix}.shared_experts", h, config.moe_intermediate_size * config.num_shared_experts, unit)
    return params


def _routed_expert_params(config, prefix, width, unit):
    """E independent experts of P = 3·width·I parameters each, or (shared basis) M basis matrices and two [E, M]
    coefficient tables: M·P + 2·E·M."""
    experts, intermediate, basis = config.num_experts, config.moe_intermediate_size, config.expert_basis_size
    if basis is None:
        return [(f"{prefix}.gate_up_proj", (experts, 2 * intermediate, width), unit),
                (f"{prefix}.down_proj", (experts, width, intermediate), unit)]
    return [(f"{prefix}.gate_up_basis", (basis, 2 * intermediate, width), unit),
            (f"{prefix}.down_basis", (basis, width, intermediate), unit),
            (f"{prefix}.gate_up_coefficients", (experts, basis), unit),
            (f"{prefix}.down_coefficients", (experts, basis), unit)]


def _never_in_backward(config, name: str) -> bool:
    """Layer 0's self-attention AttnRes projection and norm weigh earlier blocks, and layer 0 has none: no gradient."""
    return config.attn_res_block_size is not None and name.startswith("model.layers.0.self_attention_res_")


def parameter_specs(config, lora_rank: int = 0, lora_targets=DEFAULT_LORA_TARGETS) -> list[ParamSpec]:
    """Every parameter tensor of ``KimiK3ForCausalLM(config)``; with ``lora_rank`` > 0, the base is frozen and each
    targeted projection gets peft's ``lora_A`` [r, in] and ``lora_B`` [out, r] (trained with AdamW)."""
    h, vocab = config.hidden_size, config.vocab_size
    raw = [(name, shape, "root") for name, shape in [("model.embed_tokens.weight", (vocab, h))]]
    for i in range(config.num_hidden_layers):
        raw += _layer_params(config, i)
    if config.attn_res_block_size is not None:
        raw += [_linear("model.output_attn_res_proj.weight", 1, h, "root"), ("model.output_attn_res_norm.weight", (h,), "root")]
    raw.append(("model.norm.weight", (h,), "root"))
    if not config.tie_word_embeddings:
        raw.append(_linear("lm_head.weight", vocab, h, "root"))
    specs = []
    tags = _muon_tags(config)
    for name, shape, unit in raw:
        expert = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        optimizer = muon_or_adamw(name, shape, expert)
        spec = ParamSpec(name, tuple(shape), unit, optimizer, expert, receives_grad=not _never_in_backward(config, name),
                         muon_tag=tags(name) if optimizer == "muon" else None)
        if lora_rank:
            specs.append(replace(spec, trainable=False))
            module = name.rsplit(".", 2)[-2]
            if len(shape) == 2 and name.endswith(".weight") and module in lora_targets:
                base = name[: -len(".weight")]
                out_features, in_features = shape
                for adapter, adapter_shape in (("lora_A", (lora_rank, in_features)), ("lora_B", (out_features, lora_rank))):
                    specs.append(ParamSpec(f"{base}.{adapter}.default.weight", adapter_shape, unit, "adamw",
                                           receives_grad=spec.receives_grad))
        else:
            specs.append(spec)
    return specs


def _muon_tags(config):
    """name -> PerHeadMuon's block tag, by the rules of ``kimi_k3.muon.build_param_groups`` (split K and V)."""
    head_rows = _head_rows_by_layer_type(config, split_kv=True)
    expert_rows = {"gate_up_proj": config.moe_intermediate_size,
                   "down_proj": config.routed_expert_hidden_size or config.hidden_size}

    def tag(name):
        layer = _LAYER_PARAM.search(name)
        if layer is not None:
            rows = head_rows[config.layer_types[int(layer.group(1))]].get(layer.group(2))
            if rows is not None:
                return ("head_rows", rows)
        weight = name.rsplit(".", 1)[-1]
        weight = BASIS_OF_EXPERT_TENSOR.get(weight, weight)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj", *BASIS_OF_EXPERT_TENSOR)):
            return ("expert_rows", expert_rows[weight])
        return None

    return tag


def buffer_specs(config) -> list[BufferSpec]:
    """Buffers of the model every rank keeps whole: the router bias of each MoE layer (fp32), and with the routing
    variants a quantile router's score CDF knots and a coarse router's bias."""
    per_layer = {"gate.e_score_correction_bias": config.num_experts}
    if config.router_score_normalization == "quantile":
        per_layer["gate.score_quantiles"] = config.num_experts * (config.router_score_quantile_bins + 1)
    if config.num_coarse_experts is not None:
        per_layer["gate.coarse_gate.e_score_correction_bias"] = config.num_coarse_experts
    return [BufferSpec(f"model.layers.{i}.block_sparse_moe.{name}", numel, FP32_BYTES, "router statistics")
            for i, mlp_type in enumerate(config.mlp_layer_types) if mlp_type == "sparse"
            for name, numel in per_layer.items()]


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
    qb_num_bins: int = 1000
    gpu_memory_gb: float = 141.0
    reserved_gb: float = 4.0

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.sequence_length


def validate(config, layout: Layout, setup: Setup, specs: list[ParamSpec] | None = None) -> None:
    """Refuse, in one line naming the field, what the sharding code or this plan cannot run. Runs before anything is
    instantiated; ``specs`` (from :func:`parameter_specs`) saves rebuilding them."""
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
    if setup.optimizer == "muon":
        _require_muon_rows_per_rank(parameter_specs(config, setup.lora_rank) if specs is None else specs, layout, setup)


def _require_muon_rows_per_rank(specs: list[ParamSpec], layout: Layout, setup: Setup) -> None:
    """Under expert parallelism PerHeadMuon gathers each expert update whole and adds it to the 2-D (efsdp x ep)
    shard in place; DTensor has no strategy for that when there are fewer experts than ranks sharding them."""
    experts = [s for s in updated_specs(specs) if s.expert and optimizer_of(s, setup) == "muon"]
    if layout.ep > 1 and experts and experts[0].shape[0] < layout.fsdp:
        raise PlanError(
            f"`optimizer` 'muon' cannot run with ep {layout.ep} over fsdp {layout.fsdp}: `{experts[0].name}` has "
            f"{experts[0].shape[0]} experts, fewer than the ranks sharding them, and DTensor refuses PerHeadMuon's "
            f"in-place update of such a shard; use fsdp <= {experts[0].shape[0]}, ep 1 or `optimizer` 'adamw'."
        )


def common_divisors(a: int, b: int) -> list[int]:
    return [d for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0]


def local_rows(rows: int, group: int) -> int:
    """Rows rank 0 keeps of a dim-0 shard over ``group`` ranks (torch.chunk; FSDP2 pads every rank to this)."""
    return -(-rows // group)


def local_numel(spec: ParamSpec, layout: Layout) -> int:
    """Elements of ``spec`` on rank 0 after expert parallelism and FSDP2."""
    rows, rest = spec.shape[0], math.prod(spec.shape[1:])
    if spec.expert and layout.ep > 1:
        return local_rows(rows // layout.ep, layout.efsdp) * rest
    return local_rows(rows, layout.fsdp) * rest


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
    specs = parameter_specs(config, setup.lora_rank) if specs is None else specs
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
        buffers=sum(b.numel for b in buffer_specs(config)),
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
        rows = [row for row in self.communication if row[0] in NEWTON_SCHULZ_ROWS]
        return sum(row[2] for row in rows), sum(row[3] for row in rows)

    @property
    def largest_category(self) -> str:
        return max(self.memory, key=self.memory.get)


def make_plan(config, layout: Layout, setup: Setup, specs: list[ParamSpec] | None = None,
              with_communication: bool = True) -> Plan:
    """The plan of one layout; ``specs`` (from :func:`parameter_specs`) saves rebuilding them in a search, which
    also skips the communication (Newton–Schulz's block assignment takes seconds at full size)."""
    specs = parameter_specs(config, setup.lora_rank) if specs is None else specs
    validate(config, layout, setup, specs)
    counts = element_counts(config, layout, setup, specs)
    plan = Plan(config, layout, setup, counts)
    b = {name: DTYPE_BYTES[getattr(setup, f"{name}_dtype")] for name in ("param", "compute", "grad", "optimizer", "ns")}
    buffers = buffer_specs(config) + statistics_specs(config, setup)
    plan.memory = {
        "parameters": counts.parameters * b["param"],
        "gradients": counts.gradients * b["grad"],
        "Muon momentum": counts.muon_momentum * b["optimizer"],
        "AdamW moments": (counts.adamw_exp_avg + counts.adamw_exp_avg_sq) * b["optimizer"] + counts.adamw_steps * FP32_BYTES,
        "router statistics": sum(x.numel * x.itemsize for x in buffers if x.category == "router statistics"),
        "attention logit maxima": sum(x.numel * x.itemsize for x in buffers if x.category == "attention logit maxima"),
    }
    plan.memory["FSDP gathered units"] = fsdp_gather_buffers(specs, layout, b)
    plan.memory["Newton-Schulz workspace"] = newton_schulz_workspace(specs, layout, setup, b) if setup.optimizer == "muon" else 0
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
    if with_communication:
        plan.communication = communication(config, specs, layout, setup, b)
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


def newton_schulz_workspace(specs, layout, setup, b) -> float:
    """What PerHeadMuon's step holds at once besides the state: every local Nesterov update (gradient dtype), every
    orthogonalised result (bf16) and, for updates split across ranks (dim-0 shards on the 1-D fsdp mesh), this rank's
    ~1/fsdp share of whole blocks batched by shape with Newton–Schulz's iterate, Gram matrix, its polynomial and the
    next iterate (5 bf16 copies). Expert updates under expert parallelism (2-D mesh) are gathered whole first, in the
    gradient dtype, and batched in bf16 by shape."""
    split, whole = muon_split_and_whole(specs, layout, setup)
    local = sum(local_numel(s, layout) for s in split + whole) * (b["grad"] + b["ns"])
    owned_share = 5 * sum(s.numel for s in split) / layout.fsdp * b["ns"]
    by_shape = {}
    for s in whole:
        by_shape[s.shape[-2:]] = by_shape.get(s.shape[-2:], 0) + s.numel
    gathered = sum(s.numel for s in whole) * b["grad"] + max(by_shape.values(), default=0) * b["ns"]
    return local + owned_share + gathered


def muon_split_and_whole(specs, layout: Layout, setup: Setup) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """Muon parameters in optimizer step order, split into those whose Newton–Schulz PerHeadMuon splits across the
    fsdp ranks and the expert tensors it gathers whole (expert parallelism puts them on a 2-D mesh)."""
    jobs = muon_step_order(specs, setup)
    return [s for s in jobs if not (s.expert and layout.ep > 1)], [s for s in jobs if s.expert and layout.ep > 1]


def muon_step_order(specs, setup: Setup) -> list[ParamSpec]:
    """Every updated Muon parameter in PerHeadMuon's step order: ``build_param_groups`` makes one group per tag in
    order of first appearance, parameters in model order within a group."""
    groups = {}
    for spec in updated_specs(specs):
        if optimizer_of(spec, setup) == "muon":
            groups.setdefault(spec.muon_tag, []).append(spec)
    return [spec for members in groups.values() for spec in members]


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
        kda = config.linear_attn_config
        heads, head_dim = kda["num_heads"], kda["head_dim"]
        # q/k/v/gates before and after the convs, their fp32 chunked copies and the per-chunk [64, 64] matrices.
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


def communication(config, specs, layout: Layout, setup: Setup, b) -> list[tuple[str, int, int, float, float]]:
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
    if setup.optimizer == "muon":
        rows += newton_schulz_communication(specs, layout, setup, b)
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


def newton_schulz_communication(specs, layout: Layout, setup: Setup, b) -> list[tuple]:
    """PerHeadMuon splits Newton–Schulz of dim-0 shards on the 1-D fsdp mesh across the ranks: two all-to-alls of
    the rows of blocks cut by shard boundaries (``kimi_k3.muon.newton_schulz_exchange_bytes``, rank 0's share, in
    the Newton–Schulz dtype). Expert tensors under expert parallelism (2-D mesh) are gathered whole, first over the efsdp ranks holding
    the same experts (when there are several), then over the ep ranks, in the gradient dtype."""
    split, whole = muon_split_and_whole(specs, layout, setup)
    rows = []
    if split and layout.fsdp > 1:
        sent, _ = newton_schulz_exchange_bytes([s.shape for s in split], [s.block_pattern for s in split], layout.fsdp,
                                               sharded=True, itemsize=b["ns"])[0]
        rows.append((NEWTON_SCHULZ_ROWS[0], layout.fsdp, 2, sent, sent))
    calls, payload, sent = 0, 0, 0
    for spec in whole:
        shard = local_numel(spec, layout) * b["grad"]
        if layout.efsdp > 1:
            calls, payload, sent = calls + 1, payload + shard, sent + shard * (layout.efsdp - 1)
        gathered = shard * layout.efsdp
        calls, payload, sent = calls + 1, payload + gathered, sent + gathered * (layout.ep - 1)
    if whole:
        rows.append((NEWTON_SCHULZ_ROWS[1], layout.world_size, calls, payload, sent))
    return rows


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
    specs = parameter_specs(config, setup.lora_rank)
    best = None
    for world_size in range(step, max_world_size + 1, step):
        plans = []
        for layout in candidate_layouts(config, world_size, setup):
            with contextlib.suppress(PlanError):
                plans.append(make_plan(config, layout, setup, specs, with_communication=False))
        if not plans:
            continue
        best = min(plans, key=lambda plan: plan.total)
        if best.fits:
            best = make_plan(config, best.layout, setup, specs)
            return best, best
    if best is None:
        raise PlanError(f"No layout up to {max_world_size} ranks is accepted by the sharding code for this setup.")
    return None, make_plan(config, best.layout, setup, specs)

"""Opt-in Stable LatentMoE variants of the Kimi K3 model. The released checkpoint uses none of them.

Descriptions of Stable LatentMoE name more ideas than the released design (K3 report §2.3) implements. Five of them
change the model and live here; the sixth, periodic expert merging, is a training procedure
(``kimi_k3.policies.expert_merging``). `KimiK3Config` fields switch each on, and the model classes at the end of this
file build them: subclasses of the released classes whose decoder layers swap the modules below in for the released
router, experts and MLA gate projection, as transformers' modular models inherit a base model and override its
layers. The released model file never imports this one, so a folder saved from the released model carries no
variant code; a configuration with a variant on points ``auto_map`` here, and the released classes refuse it. Where a
description is ambiguous, the definition here decides; each class says so.

1. Shared-basis experts (`expert_basis_size` = M): W_e = sum_j C[e, j] B_j over M shared basis matrices, one bank
   for ``gate_up_proj`` and one for ``down_proj``, coefficients [E, M] each.
2. Quantile-normalized routing (`router_score_normalization` = "quantile"): top-k over u[t, e] = F_e(s[t, e]), the
   score's quantile under expert e's running score distribution; mixing weights still from the raw scores s.
3. Routing-modulated attention gates (`attention_gate_routing`): MLA's output gate sigma(W_g x + U r(x)), r(x) the
   layer's sparse routing weights of the attention input, U [heads, experts] starting at zero.
4. Two-level routing (`num_coarse_experts` = G, `coarse_experts_per_token` = g): a coarse sigmoid router picks g
   groups of E / G experts, the fine router picks k experts inside them; weights are the renormalized product of
   the coarse and fine scores. DeepSeek-V3's group-limited routing (arXiv:2412.19437) is a different rule.
5. Dynamic k (`dynamic_experts_per_token`): every expert with s + b > 0, clamped to [`min_experts_per_token`,
   `max_experts_per_token`]; balancing sets b so that each expert fires on a k / E share of tokens (compare the
   top-p routing of Huang et al., "Harder Tasks Need More Experts", arXiv:2403.07652).

Only torch, transformers and the sibling model files are imported, so the file ships inside checkpoint folders.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.integrations import use_experts_implementation

try:
    from .checkpoint_format_kimi_k3 import register_expert_layout
    from .configuration_kimi_k3 import KimiK3Config
    from .modeling_kimi_k3 import (
        KeepsFloat32Tensors,
        KimiK3DecoderLayer,
        KimiK3Experts,
        KimiK3ForCausalLM,
        KimiK3GLUActivation,
        KimiK3Model,
        KimiK3PreTrainedModel,
        KimiK3TopkRouter,
        per_expert_loop,
        upcast,
    )
except ImportError:
    from checkpoint_format_kimi_k3 import register_expert_layout
    from configuration_kimi_k3 import KimiK3Config
    from modeling_kimi_k3 import (
        KeepsFloat32Tensors,
        KimiK3DecoderLayer,
        KimiK3Experts,
        KimiK3ForCausalLM,
        KimiK3GLUActivation,
        KimiK3Model,
        KimiK3PreTrainedModel,
        KimiK3TopkRouter,
        per_expert_loop,
        upcast,
    )

# Basis banks of the shared-basis experts -> the per-expert tensor each materialises (its row blocks are the same).
BASIS_OF_EXPERT_TENSOR = {"gate_up_basis": "gate_up_proj", "down_basis": "down_proj"}


def _refuse_tensor_and_expert_parallelism(config: KimiK3Config) -> None:
    """The tensor- and expert-parallel plans name the released tensors only; FSDP shards any parameter."""
    distributed = getattr(config, "distributed_config", None)
    sizes = {name: getattr(distributed, name, 1) or 1 for name in ("tp_size", "ep_size")}
    if any(size > 1 for size in sizes.values()):
        raise ValueError(
            f"{config.enabled_variants[0]} has no tensor- or expert-parallel plan: load it with tp_size=1 and "
            f"ep_size=1 (got {sizes}); FSDP (fsdp_size) shards it."
        )


def _router_class(config: KimiK3Config) -> type[nn.Module]:
    if config.router_score_normalization == "quantile":
        return KimiK3QuantileRouter
    if config.num_coarse_experts is not None:
        return KimiK3TwoLevelRouter
    if config.dynamic_experts_per_token:
        return KimiK3DynamicTopkRouter
    return KimiK3TopkRouter


def _experts_class(config: KimiK3Config) -> type[nn.Module]:
    shared_basis = config.expert_basis_size is not None
    if config.dynamic_experts_per_token:
        return KimiK3VaryingCountSharedBasisExperts if shared_basis else KimiK3VaryingCountExperts
    return KimiK3SharedBasisExperts if shared_basis else KimiK3Experts


# ---------------------------------------------------------------------------------------------------------------------
# Routing helpers shared by the variant routers (the released router keeps its own forward)
# ---------------------------------------------------------------------------------------------------------------------
def router_logits(router: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.linear(upcast(hidden_states), upcast(router.weight))


def router_scores(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    return logits.sigmoid() if router.score_function == "sigmoid" else logits.softmax(-1)


def normalize_and_scale(router: nn.Module, weights: torch.Tensor) -> torch.Tensor:
    """The released weight rule on the gathered scores: renormalized over the chosen experts, then scaled."""
    if router.renormalize and router.top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


# ---------------------------------------------------------------------------------------------------------------------
# 1. Shared-basis experts
# ---------------------------------------------------------------------------------------------------------------------
def materialise_experts(coefficients: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """W_e = sum_j C[e, j] B_j for every expert, as one matmul: C [E, M] and B [M, R, K] -> [E, R, K]."""
    return (coefficients @ basis.flatten(1)).view(coefficients.shape[0], *basis.shape[1:])


def materialise_experts_reference(coefficients: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """`materialise_experts` written out term by term: the reference it is tested against."""
    experts = []
    for row in coefficients:
        weight = torch.zeros_like(basis[0])
        for coefficient, matrix in zip(row, basis):
            weight = weight + coefficient * matrix
        experts.append(weight)
    return torch.stack(experts)


@use_experts_implementation
class KimiK3SharedBasisExperts(nn.Module):
    """Routed experts that share a latent basis: each expert is a linear combination of M basis matrices.

    ``gate_up_basis`` [M, 2I, H] and ``down_basis`` [M, H, I] are the two banks, ``gate_up_coefficients`` and
    ``down_coefficients`` [E, M] each expert's combination (one per bank, so an expert's gate/up and down matrices
    mix the bases independently). Routed-expert parameters fall from E·P to M·P + 2·E·M (P = 3·H·I); with M = E and
    C = I the layer is the independent experts. ``gate_up_proj`` / ``down_proj`` materialise every W_e, which is what the
    experts backends (grouped_mm, batched_mm) read and what the released-layout export writes.
    """

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.num_experts = config.num_experts
        self.basis_size = config.expert_basis_size
        self.hidden_dim = config.routed_expert_hidden_size or config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        basis, hidden, intermediate = self.basis_size, self.hidden_dim, self.intermediate_dim
        self.gate_up_basis = nn.Parameter(torch.empty(basis, 2 * intermediate, hidden))
        self.down_basis = nn.Parameter(torch.empty(basis, hidden, intermediate))
        self.gate_up_coefficients = nn.Parameter(torch.empty(self.num_experts, basis))
        self.down_coefficients = nn.Parameter(torch.empty(self.num_experts, basis))
        self.glu = KimiK3GLUActivation(config)

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return materialise_experts(self.gate_up_coefficients, self.gate_up_basis)

    @property
    def down_proj(self) -> torch.Tensor:
        return materialise_experts(self.down_coefficients, self.down_basis)

    _apply_gate = KimiK3Experts._apply_gate

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The released per-expert loop (``experts_implementation="eager"``) over weights materialised once."""
        return per_expert_loop(
            self.gate_up_proj, self.down_proj, self._apply_gate, hidden_states, top_k_index, top_k_weights
        )

    def init_variant_weights(self, std: float) -> None:
        """Bases ~ N(0, std²), coefficients ~ N(0, 1/M): each W_e then has the independent experts' N(0, std²)."""
        for basis in (self.gate_up_basis, self.down_basis):
            init.normal_(basis, mean=0.0, std=std)
        for coefficients in (self.gate_up_coefficients, self.down_coefficients):
            init.normal_(coefficients, mean=0.0, std=self.basis_size**-0.5)


# ---------------------------------------------------------------------------------------------------------------------
# 2. Quantile-normalized routing
# ---------------------------------------------------------------------------------------------------------------------
def quantile_normalize(scores: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """u[t, e] = F_e(s[t, e]) for scores [N, E]: the piecewise-linear CDF through (knots[e, j], j / B), B + 1 knots.

    One batched ``searchsorted`` finds each score's bin; within it u interpolates linearly. A bin of zero width (equal
    knots) maps to its lower level.
    """
    num_bins = knots.shape[-1] - 1
    knots = knots.to(scores.dtype)
    per_expert = scores.T.contiguous()
    bins = (torch.searchsorted(knots, per_expert, right=True) - 1).clamp_(0, num_bins - 1)
    lower, upper = knots.gather(1, bins), knots.gather(1, bins + 1)
    fraction = ((per_expert - lower) / (upper - lower).clamp_min(torch.finfo(scores.dtype).tiny)).clamp_(0, 1)
    return ((bins + fraction) / num_bins).T


def quantile_normalize_reference(scores: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """`quantile_normalize` by counting, for each score, the interior knots at or below it (no search)."""
    num_bins = knots.shape[-1] - 1
    knots = knots.to(scores.dtype)
    bins = (scores[..., None] >= knots[:, 1:-1]).sum(-1)
    lower, upper = knots.T.gather(0, bins), knots.T.gather(0, bins + 1)
    width = upper - lower
    fraction = torch.where(width > 0, (scores - lower) / width.where(width > 0, 1.0), 0.0).clamp(0, 1)
    return (bins + fraction) / num_bins


def uniform_knots(num_experts: int, num_bins: int) -> torch.Tensor:
    """The identity CDF on [0, 1] for every expert: u = s until the balancing callback has seen any scores."""
    return torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float32).repeat(num_experts, 1)


class KimiK3QuantileRouter(KimiK3TopkRouter):
    """Top-k over each expert's score quantile u = F_e(s), plus the balancing bias when a rule also runs.

    ``score_quantiles`` [E, B + 1] holds the knots of each expert's running score CDF: F_e(knots[e, j]) = j / B, with
    the first and last knot fixed at 0 and 1 (sigmoid and softmax scores lie in between). It is a buffer, saved with
    the model, so inference is deterministic; the balancing callback refits it between optimizer steps from the score
    counts it records. The mixing weights come from the raw scores s, as released: only the selection changes. A fresh
    router's knots are uniform, so it starts as the released rule.
    """

    float32_tensors = ("e_score_correction_bias", "score_quantiles")

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.register_buffer("score_quantiles", uniform_knots(self.num_experts, config.router_score_quantile_bins))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The raw scores s whose distribution ``score_quantiles`` describes."""
        return router_scores(self, logits)

    def selection_scores(self, hidden_states: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """u = F(s), what the biased top-k compares."""
        return quantile_normalize(self.scores(logits), self.score_quantiles)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = router_logits(self, hidden_states)
        with torch.no_grad():
            selection = self.selection_scores(hidden_states, logits) + self.e_score_correction_bias
            expert_indices = torch.topk(selection, self.top_k, dim=-1, sorted=False).indices
        weights = normalize_and_scale(self, self.scores(logits).gather(1, expert_indices))
        return logits, weights, expert_indices

    def init_variant_weights(self, std: float) -> None:
        init.copy_(self.score_quantiles, uniform_knots(self.num_experts, self.score_quantiles.shape[1] - 1))


# ---------------------------------------------------------------------------------------------------------------------
# 3. Routing-modulated attention gates
# ---------------------------------------------------------------------------------------------------------------------
def sparse_routing_weights(router: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """r(x): ``router``'s top-k weights of ``hidden_states`` [..., hidden] scattered over [..., E], zero elsewhere.

    Read without gradient and through ``forward`` rather than a module call: U learns to read the routing while the
    router learns from the experts alone, as released, and balancing statistics and ``router_logits`` keep counting
    the MoE's own tokens only. Unused slots of dynamic k (index E) fall into a dropped column.
    """
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    with torch.no_grad():
        _, weights, indices = router.forward(tokens)
    dense = weights.new_zeros(tokens.shape[0], router.num_experts + 1).scatter_(1, indices, weights)
    return dense[:, :-1].view(*hidden_states.shape[:-1], router.num_experts)


class KimiK3RoutedGateProjection(nn.Linear):
    """MLA's output-gate projection, modulated per head by the layer's routing: W_g x + U r(x).

    ``routing_weight`` U [heads, experts] adds one logit per head, broadcast over the head's channels, from r(x), the
    sparse top-k routing-weight vector of the same layer's router applied to the attention input x (the normed layer
    input the gate already reads). U starts at zero, so a fresh model gates exactly as released. The router is the
    MoE block's own (read, not a second copy); the gate's checkpoint name stays ``self_attn.g_proj.weight``.
    """

    def __init__(self, config: KimiK3Config, router: nn.Module):
        super().__init__(config.hidden_size, config.num_attention_heads * config.v_head_dim, bias=False)
        self.num_heads = config.num_attention_heads
        self.routing_weight = nn.Parameter(torch.zeros(self.num_heads, config.num_experts))
        # A function of the router rather than a submodule: the MoE block owns the router and its state-dict entries.
        self.routing_of = partial(sparse_routing_weights, router)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate_logits = super().forward(hidden_states)
        routing = self.routing_of(hidden_states).to(gate_logits.dtype)
        head_logits = F.linear(routing, self.routing_weight.to(gate_logits.dtype))
        return (gate_logits.unflatten(-1, (self.num_heads, -1)) + head_logits.unsqueeze(-1)).flatten(-2)

    def init_variant_weights(self, std: float) -> None:
        init.zeros_(self.routing_weight)


# ---------------------------------------------------------------------------------------------------------------------
# 4. Two-level routing
# ---------------------------------------------------------------------------------------------------------------------
class KimiK3CoarseRouter(KeepsFloat32Tensors):
    """The coarse level of two-level routing: a sigmoid router over G groups with its own selection bias.

    It picks ``coarse_experts_per_token`` groups per token by top-g of score + bias and is balanced like the experts'
    router (a balancing policy finds it by its ``e_score_correction_bias`` and ``top_k``).
    """

    float32_tensors = ("e_score_correction_bias",)

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.top_k = config.coarse_experts_per_token
        self.num_experts = config.num_coarse_experts
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group logits [N, G], the bias-free scores of the chosen groups [N, g] (fp32) and their indices [N, g]."""
        logits = router_logits(self, hidden_states)
        scores = logits.sigmoid()
        with torch.no_grad():
            groups = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        return logits, scores.gather(1, groups), groups

    def init_variant_weights(self, std: float) -> None:
        init.normal_(self.weight, mean=0.0, std=std)
        init.zeros_(self.e_score_correction_bias)


class KimiK3TwoLevelRouter(KimiK3TopkRouter):
    """Coarse experts route to fine experts: g of G groups, then the top-k of the E / G experts each chosen group owns.

    Group i owns experts [i·E/G, (i + 1)·E/G). The fine top-k runs over s + b with the experts of unchosen groups
    excluded; the mixing weight of expert e is c_{g(e)}·s_e renormalized over the k, computed as
    (c_{g(e)} / max chosen c)·s_e renormalized, which is the same number and exactly s_e renormalized when G = 1 (so
    one group is bitwise the flat router). The product is always renormalized (the config requires it).
    """

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.coarse_gate = KimiK3CoarseRouter(config)
        self.experts_per_group = self.num_experts // self.coarse_gate.num_experts

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        coarse_logits, chosen_group_scores, groups = self.coarse_gate(hidden_states)
        logits = router_logits(self, hidden_states)
        scores = router_scores(self, logits)
        with torch.no_grad():
            selection = self.within_groups(scores, groups) + self.e_score_correction_bias
            expert_indices = torch.topk(selection, self.top_k, dim=-1, sorted=False).indices
        group_scores = coarse_logits.sigmoid().gather(1, expert_indices // self.experts_per_group)
        relative = group_scores / chosen_group_scores.max(-1, keepdim=True).values
        weights = normalize_and_scale(self, scores.gather(1, expert_indices) * relative)
        return logits, weights, expert_indices

    def within_groups(self, scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """``scores`` [N, E] with the experts outside the chosen ``groups`` [N, g] at -inf (never selected)."""
        chosen = torch.zeros(scores.shape[0], self.coarse_gate.num_experts, dtype=torch.bool, device=scores.device)
        chosen.scatter_(1, groups, True)
        return scores.masked_fill(~chosen.repeat_interleave(self.experts_per_group, dim=1), float("-inf"))

    def selection_scores(self, hidden_states: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """What the fine top-k compares; the coarse routes are read through ``forward``, as they were counted once."""
        groups = self.coarse_gate.forward(hidden_states)[2]
        return self.within_groups(router_scores(self, logits), groups)


# ---------------------------------------------------------------------------------------------------------------------
# 5. Dynamic k
# ---------------------------------------------------------------------------------------------------------------------
class KimiK3DynamicTopkRouter(KimiK3TopkRouter):
    """A varying number of experts per token: every expert with s + b > 0, clamped to [k_min, k_max].

    Tokens with fewer than k_min experts above the threshold take their k_min best, tokens with more than k_max their
    k_max best. Routes are [N, k_max], best first; the unused slots hold the index E (no expert) and weight 0. The
    weights are the bias-free scores of the used experts, renormalized over them (a token using one expert gives it
    weight 1). ``top_k`` stays k: Quantile Balancing solves each b[e] so that expert e fires on a k / E share of tokens
    (``selection_threshold`` tells it the rule), so the mean count is k while hard tokens may take more.
    """

    selection_threshold = 0.0

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.min_top_k = config.min_experts_per_token
        self.max_top_k = config.max_experts_per_token

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = router_logits(self, hidden_states)
        scores = router_scores(self, logits)
        with torch.no_grad():
            best = torch.topk(scores + self.e_score_correction_bias, self.max_top_k, dim=-1)
            rank = torch.arange(self.max_top_k, device=logits.device)
            used = (best.values > self.selection_threshold) | (rank < self.min_top_k)
            expert_indices = best.indices.masked_fill(~used, self.num_experts)
        weights = scores.gather(1, best.indices) * used
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, expert_indices


class VaryingRouteCount:
    """Experts mixin for dynamic k: the used (token, expert) pairs of routes [N, k_max] are gathered into rows of one
    route each before the experts backend runs, so a token costs its own count of experts and every backend (eager,
    grouped_mm, batched_mm) sees a fixed k of 1. The combine is accumulated in fp32, as released."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        token_idx, slot = torch.nonzero(top_k_index < self.num_experts, as_tuple=True)
        pair_weights = top_k_weights[token_idx, slot, None]
        pair_outputs = super().forward(hidden_states[token_idx], top_k_index[token_idx, slot, None],
                                       torch.ones_like(pair_weights))
        combined = upcast(hidden_states.new_zeros(hidden_states.shape))
        combined.index_add_(0, token_idx, upcast(pair_outputs) * pair_weights)
        return combined.to(hidden_states.dtype)


class KimiK3VaryingCountExperts(VaryingRouteCount, KimiK3Experts):
    """The released experts under dynamic k."""


class KimiK3VaryingCountSharedBasisExperts(VaryingRouteCount, KimiK3SharedBasisExperts):
    """Shared-basis experts under dynamic k."""


# ---------------------------------------------------------------------------------------------------------------------
# The model classes that build the variants
# ---------------------------------------------------------------------------------------------------------------------
class KimiK3VariantDecoderLayer(KimiK3DecoderLayer):
    """The released decoder layer with the variants its config enables in place of the released router, experts and
    MLA gate projection (the forward is the released one)."""

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        _refuse_tensor_and_expert_parallelism(config)
        moe = getattr(self, "block_sparse_moe", None)
        if moe is None:
            return
        router_class, experts_class = _router_class(config), _experts_class(config)
        if router_class is not KimiK3TopkRouter:
            moe.gate = router_class(config)
        if experts_class is not KimiK3Experts:
            moe.experts = experts_class(config)
        if config.attention_gate_routing and self.layer_type == "full_attention":
            self.self_attn.g_proj = KimiK3RoutedGateProjection(config, moe.gate)


class KimiK3VariantPreTrainedModel(KimiK3PreTrainedModel):
    """What every variant model adds to the released one: the variants' layers, their initialisation and the fp32
    tensors they keep."""

    builds_variants = True
    _no_split_modules = ["KimiK3VariantDecoderLayer"]

    def post_init(self):
        super().post_init()
        if self.config.router_score_normalization == "quantile":
            # A quantile router's score CDF stays fp32 under `from_pretrained(dtype=...)`: bf16 would merge its knots.
            self._keep_in_fp32_modules_strict.add("score_quantiles")

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if hasattr(module, "init_variant_weights"):
            module.init_variant_weights(self.config.initializer_range)


class KimiK3VariantModel(KimiK3VariantPreTrainedModel, KimiK3Model):
    decoder_layer_class = KimiK3VariantDecoderLayer


class KimiK3VariantForCausalLM(KimiK3VariantPreTrainedModel, KimiK3ForCausalLM):
    base_model_class = KimiK3VariantModel


def causal_lm_class(config: KimiK3Config) -> type[KimiK3ForCausalLM]:
    """The causal-LM class that builds ``config``: the released one, or the variants' where one is switched on."""
    return KimiK3VariantForCausalLM if config.enabled_variants else KimiK3ForCausalLM


register_expert_layout("KimiK3VariantForCausalLM", "KimiK3VariantModel")
KimiK3VariantModel.register_for_auto_class("AutoModel")
KimiK3VariantForCausalLM.register_for_auto_class("AutoModelForCausalLM")

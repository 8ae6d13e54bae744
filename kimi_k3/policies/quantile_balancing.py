"""Quantile Balancing (QB), the router-bias update of Kimi K3 (K3 report §2.3.3 Eq. 14, App. C-D).

The model records nothing. :class:`RouterStatistics`, a forward hook `QuantileBalancing.attach` puts on every
router, keeps what the update needs from training forwards: token counts per expert and, for every real
(non-padding) token, the required bias r = α − s per expert (α = the token's (k+1)-th biased score), binned into a
histogram. After each step of the optimizer it is attached to (a step hook, as torchtitan updates its expert bias),
the policy pools the statistics of all layers with a single SUM all-reduce, solves b̂_j = (k/n)-quantile of
r_{:,j}, mean-centers it and writes it into ``gate.e_score_correction_bias``. `QuantileBalancingCallback` only
attaches it for a ``Trainer`` run and logs its metrics.

Sign convention (K3 report Eq. 13-14): routing is top-k of s + b, so b = −β of App. C, and a popular expert
ends up with a *negative* bias.

The opt-in routing variants (``variants_kimi_k3.py``) are balanced by the same rule on what their selection compares:
a quantile router's u = F(s) (whose CDF knots the policy also refits, :mod:`kimi_k3.policies.score_quantiles`), a
two-level router's scores within the chosen groups (and its coarse router like any other), and for dynamic k the fixed
threshold 0 instead of the (k+1)-th score, solved without mean-centering, so that each expert fires on a k/n share.
"""

import warnings

import torch
import torch.distributed as dist
from torch import nn

from kimi_k3.attachments.handle import Attachment, undone_on_failure
from kimi_k3.attachments.padding import PaddingTracker, masked_counts, shared_padding
from kimi_k3.attachments.seams import routers_by_level
from kimi_k3.policies.balance_metrics import aggregate_over_layers, load_balance_metrics
from kimi_k3.policies.callback import PolicyCallback
from kimi_k3.policies.score_quantiles import SCORE_QUANTILE_EMA, refit_score_quantiles, score_bin_counts

UPDATE_RULES = ("quantile", "sign", "none")
ESTIMATORS = ("histogram", "exact")


# ---------------------------------------------------------------------------------------------------------
# What is recorded (K3 report App. D): the required biases r and their histogram per expert
# ---------------------------------------------------------------------------------------------------------


def required_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes (top-k of s + b) and the required bias r = α − s of every expert, from one top-(k+1): the reference.

    α, the (k+1)-th biased score, is the cutoff an expert has to beat to enter the token's top-k (Eq. 14).
    """
    top = torch.topk(scores + bias, top_k + 1, dim=-1)
    cutoff = top.values[..., top_k:]
    return top.indices[..., :top_k], cutoff - scores


def required_bias_of_routes(scores: torch.Tensor, bias: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """r = α − s [N, n] given the routes [N, k] the router took: α is the best biased score left outside them."""
    outside = (scores + bias).scatter_(-1, routes, float("-inf"))
    return outside.amax(-1, keepdim=True) - scores


def selection_scores(router: nn.Module, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """What the router's biased selection compares: the sigmoid scores as released, or a variant router's own
    (``router.selection_scores``: u = F(s), or the scores with experts outside the chosen groups at -inf)."""
    own = getattr(router, "selection_scores", None)
    return logits.sigmoid() if own is None else own(tokens, logits)


def required_bias_of_router(router: nn.Module, tokens: torch.Tensor, logits: torch.Tensor, routes: torch.Tensor):
    """r = cutoff − selection score [N, n]: the cutoff is the best biased score left outside the routes (top-k), or
    the router's fixed ``selection_threshold`` (dynamic k fires every expert above it). Unreachable experts get +inf."""
    scores = selection_scores(router, tokens, logits)
    threshold = getattr(router, "selection_threshold", None)
    if threshold is None:
        return required_bias_of_routes(scores, router.e_score_correction_bias, routes)
    return threshold - scores


def histogram_range(bias: torch.Tensor, num_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower edge and bin width of [b_min − 1, b_max + 1] over the last dim of ``bias`` [..., n], which holds every
    required bias r = α − s for scores in (0, 1) (K3 report Eq. 14)."""
    low = bias.min(-1, keepdim=True).values - 1
    return low, (bias.max(-1, keepdim=True).values + 1 - low) / num_bins


def required_bias_histogram(
    required_bias: torch.Tensor, bias: torch.Tensor, num_bins: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-expert counts [n, B] (int64) of the required biases [N, n] in ``num_bins`` bins over ``histogram_range``,
    counting only the rows where ``token_mask`` is True. NaN (the scores of a diverged step, which the loss already
    shows) is not counted instead of becoming an out-of-range bin index."""
    low, width = histogram_range(bias, num_bins)
    num_experts = required_bias.shape[-1]
    dropped = num_experts * num_bins  # masked_counts' spare slot
    if dropped > 2 / torch.finfo(required_bias.dtype).eps:
        required_bias = required_bias.double()  # bin numbers are computed as floats: exact up to 2 / eps (2^24)
    # Each expert's bins after the previous expert's, as floats until the last pass, and in place: every fresh [N, n]
    # tensor is new pages to fault in, and each pass over it costs as much as the arithmetic.
    bins = (required_bias - low).div_(width).floor_().clamp_(0, num_bins - 1)
    bins.add_(torch.arange(num_experts, device=bins.device, dtype=bins.dtype) * num_bins).nan_to_num_(nan=dropped)
    if token_mask is not None:
        bins.masked_fill_(~token_mask[:, None], dropped)
    return masked_counts(bins.long(), None, dropped).view(num_experts, num_bins)


class RouterStatistics:
    """One router's statistics over the training forwards of a step; `record` is a forward hook of the router.

    Always the real tokens routed to each expert (``tokens_per_expert`` [n]); with ``estimator="histogram"`` also the
    histogram [n, B] of r, with ``"exact"`` every r [m, n] (the single-process reference); for a quantile router the
    counts of its raw scores between its CDF knots (``score_counts`` [n, B_q]). Only forwards in training mode with
    gradients record, so evaluation and generation never count; the recompute of activation checkpointing records
    again, to which the quantile and the metrics are invariant.
    """

    def __init__(self, router: nn.Module, padding: PaddingTracker, estimator: str | None, num_bins: int):
        self.router, self.padding, self.estimator, self.num_bins = router, padding, estimator, num_bins
        self.reset()

    def reset(self) -> None:
        """Start a new step: the statistics of a step must cover exactly the forwards of that step."""
        device, experts = self.router.e_score_correction_bias.device, self.router.num_experts
        self.tokens_per_expert = torch.zeros(experts, dtype=torch.int64, device=device)
        self.histogram = (
            torch.zeros(experts, self.num_bins, dtype=torch.int64, device=device)
            if self.estimator == "histogram"
            else None
        )
        self.required_biases: list[torch.Tensor] = []
        knots = getattr(self.router, "score_quantiles", None)
        self.score_counts = (
            None if knots is None else knots.new_zeros(knots.shape[0], knots.shape[1] - 1, dtype=torch.int64)
        )

    def record(self, router: nn.Module, args: tuple, outputs: tuple) -> None:
        if router.training and torch.is_grad_enabled():
            with torch.no_grad():
                self._add(router, args[0], *outputs)

    def _add(self, router, tokens, logits: torch.Tensor, weights: torch.Tensor, routes: torch.Tensor) -> None:
        if self.tokens_per_expert.device != routes.device:  # the model moved after the statistics were allocated
            self.tokens_per_expert = self.tokens_per_expert.to(routes.device)
            self.histogram = None if self.histogram is None else self.histogram.to(routes.device)
            self.score_counts = None if self.score_counts is None else self.score_counts.to(routes.device)
        token_mask = self.padding.rows(routes.shape[0])
        self.tokens_per_expert += masked_counts(routes, token_mask, router.num_experts)
        if self.score_counts is not None:
            self.score_counts += score_bin_counts(router.scores(logits), router.score_quantiles, token_mask)
        if self.estimator is None:
            return
        r = required_bias_of_router(router, tokens, logits, routes)
        if self.estimator == "exact":  # keeps the values, so it drops padding rows (a host sync)
            self.required_biases.append(r if token_mask is None else r[token_mask])
        else:
            self.histogram += required_bias_histogram(r, router.e_score_correction_bias, self.num_bins, token_mask)

    def step_required_bias(self) -> torch.Tensor:
        """All r [m, n] recorded this step (``estimator="exact"``)."""
        if not self.required_biases:
            return self.router.e_score_correction_bias.new_empty(0, self.router.num_experts)
        return torch.cat(self.required_biases)


# ---------------------------------------------------------------------------------------------------------
# Solving the bias (pure functions)
# ---------------------------------------------------------------------------------------------------------


def histogram_quantile(
    hist: torch.Tensor, bias: torch.Tensor, top_k: int, *, interpolate: bool = True
) -> torch.Tensor:
    """Uncentered b̂_j = (k/n)-quantile of r_{:,j} read from pooled counts [..., n, B] (K3 report App. D).

    q = m·k/n takes m from the histogram's own total, so a duplicated forward (activation-checkpointing
    recompute) scales q, c and h alike and leaves b̂ unchanged. ``bias`` [..., n] must be the bias
    the counts were binned with. ``interpolate=False`` snaps to the left bin edge, an ablation that locks the
    update. Meaningless for an empty histogram; ``solve_bias_from_histogram`` guards that.
    """
    num_experts, num_bins = hist.shape[-2:]
    hist = hist.long()
    cum = hist.cumsum(-1)
    target = cum[..., -1:].double() * top_k / num_experts
    first = torch.searchsorted(cum, target.ceil().long()).clamp(max=num_bins - 1)
    inside = hist.gather(-1, first)
    before = cum.gather(-1, first) - inside
    frac = ((target - before) / inside.clamp(min=1)).clamp(0, 1) if interpolate else torch.zeros_like(target)
    low, width = histogram_range(bias, num_bins)
    return (low.double() + (first + frac).squeeze(-1) * width.double()).to(bias.dtype)


def exact_quantile(required_bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Uncentered b̂_j = the (q+1)-th smallest r_{:,j}, i.e. −(the (q+1)-th largest margin), q = ⌊mk/n⌋ (Eq. 14).

    With this b̂_j at most q tokens have s + b̂ > α, and at least q + 1 have s + b̂ ≥ α.
    """
    num_tokens, num_experts = required_bias.shape
    rank = min(num_tokens * top_k // num_experts + 1, num_tokens)
    return required_bias.kthvalue(rank, dim=0).values


def center_bias(bias_hat: torch.Tensor, bias: torch.Tensor, ema: float, center: bool = True) -> torch.Tensor:
    """Mean-centered new bias, optionally an EMA with the old one (App. D).

    A common offset cannot change any top-k decision because every cutoff moves with it. It does change a
    fixed-threshold decision (dynamic k), whose bias is therefore used as solved (``center=False``).
    """
    new = bias_hat - bias_hat.mean(-1, keepdim=True) if center else bias_hat
    if ema:
        new = ema * bias + (1 - ema) * new
        new = new - new.mean(-1, keepdim=True) if center else new
    return new


def solve_bias_from_histogram(
    hist: torch.Tensor, bias: torch.Tensor, top_k: int, *, ema: float = 0.0, interpolate: bool = True,
    center: bool = True,
) -> torch.Tensor:
    """New bias from stacked histograms [L?, n, B]; a layer whose histogram is empty keeps its bias."""
    new = center_bias(histogram_quantile(hist, bias, top_k, interpolate=interpolate), bias, ema, center)
    empty = hist.sum((-2, -1)) == 0
    return torch.where(empty[..., None], bias, new)


def solve_bias_exact(
    required_bias: torch.Tensor, bias: torch.Tensor, top_k: int, *, ema: float = 0.0, center: bool = True
) -> torch.Tensor:
    """New bias from all required biases [m, n] of the step; no token means no update."""
    if required_bias.shape[0] == 0:
        return bias.clone()
    return center_bias(exact_quantile(required_bias, top_k), bias, ema, center)


def sign_update(bias: torch.Tensor, tokens_per_expert: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek loss-free balancing b += γ·sign(ℓ̄ − ℓ): SignSGD on QB's dual, kept as a baseline (App. C)."""
    load = tokens_per_expert.to(bias.dtype)
    return bias + gamma * torch.sign(load.mean(-1, keepdim=True) - load)


def all_reduce_sum(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Sum integer statistics over ranks with one collective for all of them (App. D).

    Every rank must call this every step, even with all-zero statistics, or the collective hangs.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensors
    flat = torch.cat([tensor.flatten().long() for tensor in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    chunks = flat.split([tensor.numel() for tensor in tensors])
    return [chunk.view(tensor.shape) for chunk, tensor in zip(chunks, tensors)]


# ---------------------------------------------------------------------------------------------------------
# The policy, and its Trainer callback
# ---------------------------------------------------------------------------------------------------------


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_exact_runs_single_process(estimator: str | None, world_size: int) -> None:
    """The exact estimator keeps this rank's r only; pooling them would need an all-gather of m×n floats."""
    if estimator == "exact" and world_size > 1:
        raise ValueError("estimator='exact' is a single-process reference; use 'histogram' with several ranks")


def _check_settings(update_rule: str, estimator: str, num_bins, ema: float, sign_gamma: float,
                    score_quantile_ema: float) -> None:
    for name, value, allowed in (("update_rule", update_rule, UPDATE_RULES), ("estimator", estimator, ESTIMATORS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if not (isinstance(num_bins, int) and num_bins >= 2):
        raise ValueError(f"num_bins must be an integer >= 2, got {num_bins!r}")
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ema must be in [0, 1), got {ema}")
    if update_rule == "sign" and not sign_gamma > 0:
        raise ValueError(f"sign_gamma must be > 0, got {sign_gamma}")
    if not 0.0 <= score_quantile_ema < 1.0:
        raise ValueError(f"score_quantile_ema must be in [0, 1), got {score_quantile_ema}")


def _check_routers(routers: dict[str, nn.Module]) -> None:
    if not routers:
        raise ValueError(
            "model has no MoE router (a module with `e_score_correction_bias` and `top_k`); is config.num_experts "
            "set and first_k_dense_replace < num_hidden_layers?"
        )
    for name, router in routers.items():
        if router.e_score_correction_bias.dtype != torch.float32:
            raise ValueError(
                f"{name}: e_score_correction_bias is {router.e_score_correction_bias.dtype}, but Quantile Balancing "
                "needs float32 (its per-step updates are below bf16 resolution). The model keeps it float32 under "
                "`.to(dtype)` and `from_pretrained(dtype=...)`; restore a cast one with "
                "`router.e_score_correction_bias = router.e_score_correction_bias.float()`."
            )


def _check_quantile_balancing_applies(config, routers: dict[str, nn.Module]) -> None:
    """QB needs sigmoid scores and a free top-(k+1) over all experts (the histogram range and the cutoff both assume
    them)."""
    activation = getattr(config, "moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ValueError(
            "Quantile Balancing bins r over [b_min - 1, b_max + 1], which needs sigmoid scores in (0, 1): "
            f"config.moe_router_activation_func must be 'sigmoid', got {activation!r}"
        )
    num_groups = getattr(config, "num_expert_group", None) or 1
    topk_group = getattr(config, "topk_group", None) or num_groups
    if num_groups > 1 and topk_group < num_groups:
        raise ValueError(
            "Quantile Balancing does not support group-limited routing: the cutoff needs a top-(k+1) over all "
            f"experts, got config.num_expert_group={num_groups}, config.topk_group={topk_group}"
        )
    for name, router in routers.items():
        if router.top_k + 1 > router.num_experts:
            raise ValueError(
                f"Quantile Balancing needs num_experts_per_token + 1 <= num_experts, got top_k={router.top_k}, "
                f"num_experts={router.num_experts}"
                + (f" for {name} (coarse_experts_per_token must be < num_coarse_experts)" if "." in name else "")
            )


def _check_sign_rule_applies(routers: dict[str, nn.Module]) -> None:
    """The sign rule moves biases toward the mean load, which a fixed selection threshold (dynamic k) cannot use."""
    threshold_routers = [name for name, router in routers.items() if hasattr(router, "selection_threshold")]
    if threshold_routers:
        raise ValueError(
            f"update_rule='sign' balances top-k routers only; {threshold_routers[0]} fires every expert above a fixed "
            "threshold (dynamic_experts_per_token), which update_rule='quantile' solves"
        )


class QuantileBalancing:
    """Updates every router bias of ``model`` once per optimizer step and computes load-balance metrics.

    ``attach(optimizer)`` puts a `RouterStatistics` hook on every router and runs `update` after each step of
    ``optimizer``: after the last micro-batch's forward and backward (so with gradient accumulation there is exactly
    one update per optimizer step) and before the next step's first forward (causality: a token's routes never depend
    on its own step). Any optimizer, any training loop: under ``Trainer`` a checkpoint saved at step t then holds the
    bias step t + 1 routes with, and resuming continues exactly.

    Args:
        model: the model to balance, used to validate the setup (``attach`` may be given another view of it, e.g.
            the PEFT model whose ``modules_to_save`` copies are the routers that train).
        enabled: False leaves the bias alone and computes no metrics; statistics are still cleared every step.
        update_rule: "quantile" (QB), "sign" (DeepSeek loss-free balancing, a baseline) or "none" (metrics only).
        estimator: "histogram" (default) or "exact", which keeps every r of the step and is a single-process
            reference.
        num_bins: histogram bins B of the required bias (K3 report Eq. 14); 1000 by default.
        ema: decay of an exponential moving average of the solved bias, in [0, 1); 0 disables it (App. D).
        score_quantile_ema: weight of the old knots when a quantile router's score CDF is refitted each step.
        sign_gamma: step size γ of the sign rule (DeepSeek-V3 uses 1e-3).
        per_layer_metrics: also report ``balance/layer_{i}/...`` besides the aggregates over layers.
        process_group: group the token stream is sharded over (default: WORLD when torch.distributed is up).

    After each update, ``latest_metrics`` holds the step's metrics and ``latest_loads`` its per-expert token counts of
    every layer, summed over ranks (read by ``kimi_k3.job.expert_load``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        enabled: bool = True,
        update_rule: str = "quantile",
        estimator: str = "histogram",
        num_bins: int = 1000,
        ema: float = 0.0,
        sign_gamma: float = 1e-3,
        per_layer_metrics: bool = True,
        process_group=None,
        score_quantile_ema: float = SCORE_QUANTILE_EMA,
    ):
        _check_settings(update_rule, estimator, num_bins, ema, sign_gamma, score_quantile_ema)
        routers = _all_routers(model)
        _check_routers(routers)
        if update_rule == "sign":
            _check_sign_rule_applies(routers)
        if update_rule == "quantile":
            _check_quantile_balancing_applies(model.config, routers)
            _check_exact_runs_single_process(estimator, _world_size())
            _warn_if_an_adapter_would_drop_the_bias(model)
        self.model = model
        self.enabled = enabled
        self.update_rule = update_rule
        self.estimator = estimator if update_rule == "quantile" else None  # the other rules read token counts only
        self.num_bins = num_bins
        self.ema = ema
        self.sign_gamma = sign_gamma
        self.per_layer_metrics = per_layer_metrics
        self.process_group = process_group
        self.score_quantile_ema = score_quantile_ema
        self.statistics: dict[str, RouterStatistics] = {}
        self.nested_routers: set[str] = set()
        self.latest_metrics: dict[str, float] = {}
        self.latest_loads: dict[str, torch.Tensor] = {}

    def attach(self, optimizer=None, model=None) -> Attachment:
        """Record the statistics of every router (of ``model``, default the one given at construction) and, with an
        ``optimizer``, update after each of its steps; the handle's ``remove()`` undoes both."""
        model = self.model if model is None else model
        if self.statistics:
            raise ValueError("this Quantile Balancing is already attached; remove that attachment first")
        _check_exact_runs_single_process(self.estimator, _world_size())
        attachment = Attachment("Quantile Balancing")
        with undone_on_failure(attachment):
            attachment.add(self.statistics.clear)
            padding = shared_padding(model, attachment)
            outer, inner = routers_by_level(model)
            self.nested_routers = set(inner)
            for name, router in {**outer, **inner}.items():
                self.statistics[name] = RouterStatistics(router, padding, self.estimator, self.num_bins)
                attachment.add(router.register_forward_hook(self.statistics[name].record))
            if optimizer is not None:
                attachment.run_after_each_step(optimizer, self.update)
        return attachment

    @torch.no_grad()
    def update(self) -> dict[str, float]:
        """Pool this step's statistics, update every router bias (and quantile routers' score CDFs), clear the
        statistics; return the metrics."""
        if not self.statistics:
            raise RuntimeError("Quantile Balancing updates from the statistics it records: attach it first")
        if not self.enabled:
            _reset(self.statistics)
            return {}
        pooled = self._pooled()
        new_biases = {}
        for names in _routers_balanced_together(self.statistics):
            group = [self.statistics[name] for name in names]
            biases = torch.stack([stats.router.e_score_correction_bias for stats in group])
            tokens, hist = (_stacked(pooled, names, field) for field in ("tokens", "histogram"))
            new_biases.update(zip(names, self._new_biases(group, biases, tokens, hist)))
        for name, stats in self.statistics.items():
            stats.router.e_score_correction_bias.copy_(new_biases[name])
            if stats.score_counts is not None:
                knots = stats.router.score_quantiles
                knots.copy_(refit_score_quantiles(knots, pooled[name]["score_counts"], self.score_quantile_ema))
        _reset(self.statistics)
        self.latest_metrics = self._metrics(pooled, new_biases)
        return self.latest_metrics

    def _metrics(self, pooled: dict, new_biases: dict[str, torch.Tensor]) -> dict[str, float]:
        """The MoE routers' metrics under ``balance/``, two-level routing's coarse routers' under ``balance/coarse/``;
        ``latest_loads`` keeps the MoE routers' token counts."""
        nested = self.nested_routers & self.statistics.keys()
        self.latest_loads = {name: pooled[name]["tokens"].cpu() for name in self.statistics if name not in nested}
        per_layer = {name: load_balance_metrics(pooled[name]["tokens"], new_biases[name]) for name in self.statistics}
        metrics = aggregate_over_layers({name: per_layer[name] for name in self.latest_loads},
                                        include_layers=self.per_layer_metrics)
        if nested:
            metrics.update(aggregate_over_layers({name: per_layer[name] for name in nested},
                                                 include_layers=self.per_layer_metrics, prefix="balance/coarse"))
        return metrics

    def _pooled(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per router: token counts [n], the histogram [n, B] (histogram estimator) and a quantile router's score
        counts, summed over ranks with one collective for all of them."""
        fields = []
        for name, stats in self.statistics.items():
            fields.append((name, "tokens", stats.tokens_per_expert))
            if self.estimator == "histogram":
                fields.append((name, "histogram", stats.histogram))
            if stats.score_counts is not None:
                fields.append((name, "score_counts", stats.score_counts))
        reduced = all_reduce_sum([tensor for _, _, tensor in fields], self.process_group)
        pooled = {name: {} for name in self.statistics}
        for (name, field, _), tensor in zip(fields, reduced):
            pooled[name][field] = tensor
        return pooled

    def _new_biases(self, statistics: list[RouterStatistics], biases, tokens, hist) -> torch.Tensor:
        """New biases [L, n] of routers that share (top_k, n) and selection rule, from their stacked statistics."""
        router = statistics[0].router
        center = getattr(router, "selection_threshold", None) is None
        if self.update_rule == "none":
            return biases
        if self.update_rule == "sign":
            return sign_update(biases, tokens, self.sign_gamma)
        if self.estimator == "histogram":
            return solve_bias_from_histogram(hist, biases, router.top_k, ema=self.ema, center=center)
        return torch.stack(
            [
                solve_bias_exact(stats.step_required_bias(), bias, router.top_k, ema=self.ema, center=center)
                for stats, bias in zip(statistics, biases)
            ]
        )


class QuantileBalancingCallback(PolicyCallback):
    """Quantile Balancing under ``Trainer``: the `QuantileBalancing` policy (same arguments) attached to the Trainer's
    model and optimizer for the run, its load-balance metrics (MaxVio, CV, min/mean, dead experts, bias spread, per
    layer and aggregated) added to every training-loss log, detached at the end of training.

    Pass it in ``Trainer(callbacks=[...])`` for printed logs and ``trainer_state.json`` (it warns when ``report_to``
    names integrations, which would miss the metrics); use ``attach(trainer)`` instead so that they receive them.
    """

    def __init__(self, model: nn.Module, **settings):
        super().__init__(QuantileBalancing(model, **settings))


def _warn_if_an_adapter_would_drop_the_bias(model: nn.Module) -> None:
    """A PEFT adapter saves only its own tensors, so the router biases Quantile Balancing moves would be lost with it
    unless the routers are saved with the adapter (``modules_to_save``)."""
    if not hasattr(model, "peft_config"):
        return
    names = [name for name, module in model.named_modules() if hasattr(module, "e_score_correction_bias")]
    if not any(".modules_to_save." in name for name in names):
        warnings.warn(
            "Quantile Balancing moves the router biases, but a PEFT adapter saves only its adapter weights: the "
            "balanced biases would be lost when it is reloaded. Save the routers with the adapter, "
            "LoraConfig(..., modules_to_save=['gate']) (their weights then train too unless you freeze "
            "`modules_to_save` parameters), or merge_and_unload() and save the whole model.",
            stacklevel=3,
        )


def _reset(statistics: dict[str, RouterStatistics]) -> None:
    for stats in statistics.values():
        stats.reset()


def _all_routers(model: nn.Module) -> dict[str, nn.Module]:
    """Every router Quantile Balancing updates: the MoE routers, then the routers nested in them."""
    outer, inner = routers_by_level(model)
    return {**outer, **inner}


def _routers_balanced_together(statistics: dict[str, RouterStatistics]) -> list[list[str]]:
    """Router names grouped by (top_k, n, selection rule): each group's biases are solved as one stacked tensor."""
    groups: dict[tuple, list[str]] = {}
    for name, stats in statistics.items():
        router = stats.router
        key = (router.top_k, router.num_experts, getattr(router, "selection_threshold", None))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _stacked(pooled: dict[str, dict[str, torch.Tensor]], names: list[str], field: str) -> torch.Tensor | None:
    tensors = [pooled[name].get(field) for name in names]
    return None if tensors[0] is None else torch.stack(tensors)

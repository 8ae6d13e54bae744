"""Quantile Balancing (QB), the router-bias update of Kimi K3 (training.md §1).

The router only records statistics in training forwards: token counts and, for every valid token, the
required bias r = α − s per expert (α = the token's (k+1)-th biased score), binned into a histogram. This
module owns the policy. Once per optimizer step it pools the statistics of all layers with a single SUM
all-reduce, solves b̂_j = (k/n)-quantile of r_{:,j}, mean-centers it and writes it into
``gate.e_score_correction_bias``.

Sign convention (training.md §1.2): routing is top-k of s + b, so b = −β of App. C, and a popular expert
ends up with a *negative* bias.
"""

import re
import warnings

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback

from modeling_kimi_k3 import histogram_range, required_bias_histogram

from .balance_metrics import aggregate_over_layers, load_balance_metrics

UPDATE_RULES = ("quantile", "sign", "none")
ESTIMATORS = ("histogram", "exact")


# ---------------------------------------------------------------------------------------------------------
# What the router records (training.md §1.4): the required biases (a reference for tests and simulations) and their
# histogram, binned by the model file's own functions, so that the solver reads exactly the router's bins
# ---------------------------------------------------------------------------------------------------------


def required_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes (top-k of s + b) and the required bias r = α − s of every expert, from one top-(k+1).

    α, the (k+1)-th biased score, is the cutoff an expert has to beat to enter the token's top-k (§1.2).
    """
    top = torch.topk(scores + bias, top_k + 1, dim=-1)
    cutoff = top.values[..., top_k:]
    return top.indices[..., :top_k], cutoff - scores


# ---------------------------------------------------------------------------------------------------------
# Solving the bias (pure functions)
# ---------------------------------------------------------------------------------------------------------


def histogram_quantile(
    hist: torch.Tensor, bias: torch.Tensor, top_k: int, *, interpolate: bool = True
) -> torch.Tensor:
    """Uncentered b̂_j = (k/n)-quantile of r_{:,j} read from pooled counts [..., n, B] (App. D, §1.4).

    q = m·k/n takes m from the histogram's own total, so a duplicated forward (activation-checkpointing
    recompute) scales q, c and h alike and leaves b̂ unchanged (§1.6.4). ``bias`` [..., n] must be the bias
    the counts were binned with. ``interpolate=False`` snaps to the left bin edge, an ablation that locks the
    update (§1.6.2). Meaningless for an empty histogram; ``solve_bias_from_histogram`` guards that.
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
    """Uncentered b̂_j = the (q+1)-th smallest r_{:,j}, i.e. −(the (q+1)-th largest margin), q = ⌊mk/n⌋ (§1.2).

    With this b̂_j at most q tokens have s + b̂ > α, and at least q + 1 have s + b̂ ≥ α (§5.2.3).
    """
    num_tokens, num_experts = required_bias.shape
    rank = min(num_tokens * top_k // num_experts + 1, num_tokens)
    return required_bias.kthvalue(rank, dim=0).values


def center_bias(bias_hat: torch.Tensor, bias: torch.Tensor, ema: float) -> torch.Tensor:
    """Mean-centered new bias, optionally an EMA with the old one (§1.4).

    A common offset cannot change any top-k decision because every cutoff moves with it (§1.2).
    """
    new = bias_hat - bias_hat.mean(-1, keepdim=True)
    if ema:
        new = ema * bias + (1 - ema) * new
        new = new - new.mean(-1, keepdim=True)
    return new


def solve_bias_from_histogram(
    hist: torch.Tensor, bias: torch.Tensor, top_k: int, *, ema: float = 0.0, interpolate: bool = True
) -> torch.Tensor:
    """New bias from stacked histograms [L?, n, B]; a layer whose histogram is empty keeps its bias (§1.6.6)."""
    new = center_bias(histogram_quantile(hist, bias, top_k, interpolate=interpolate), bias, ema)
    empty = hist.sum((-2, -1)) == 0
    return torch.where(empty[..., None], bias, new)


def solve_bias_exact(required_bias: torch.Tensor, bias: torch.Tensor, top_k: int, *, ema: float = 0.0) -> torch.Tensor:
    """New bias from all required biases [m, n] of the step; no token means no update (§1.6.6)."""
    if required_bias.shape[0] == 0:
        return bias.clone()
    return center_bias(exact_quantile(required_bias, top_k), bias, ema)


def sign_update(bias: torch.Tensor, tokens_per_expert: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek loss-free balancing b += γ·sign(ℓ̄ − ℓ): SignSGD on QB's dual, kept as a baseline (§1.3)."""
    load = tokens_per_expert.to(bias.dtype)
    return bias + gamma * torch.sign(load.mean(-1, keepdim=True) - load)


def all_reduce_sum(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Sum integer statistics over ranks with one collective for all of them (§1.7).

    Every rank must call this every step, even with all-zero statistics, or the collective hangs (§1.10).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensors
    flat = torch.cat([tensor.flatten().long() for tensor in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    chunks = flat.split([tensor.numel() for tensor in tensors])
    return [chunk.view(tensor.shape) for chunk, tensor in zip(chunks, tensors)]


# ---------------------------------------------------------------------------------------------------------
# Trainer callback
# ---------------------------------------------------------------------------------------------------------


def find_routers(model: nn.Module) -> dict[str, nn.Module]:
    """MoE routers keyed ``layer_{i}`` (or their module name outside ``layers``), found by their statistics."""
    routers = {}
    for name, module in model.named_modules():
        if hasattr(module, "tokens_per_expert") and hasattr(module, "e_score_correction_bias"):
            layer = re.search(r"layers\.(\d+)\.", name)
            routers[f"layer_{layer.group(1)}" if layer else name] = module
    return routers


def zero_statistics(routers: dict[str, nn.Module]) -> None:
    """Start a new step: the statistics of a step must cover exactly the forwards of that step."""
    for router in routers.values():
        router.tokens_per_expert.zero_()
        if hasattr(router, "qb_histogram"):
            router.qb_histogram.zero_()
        if hasattr(router, "qb_required_bias"):
            router.qb_required_bias.clear()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_exact_runs_single_process(estimator: str | None, world_size: int) -> None:
    """The exact estimator keeps this rank's r only; pooling them would need an all-gather of m×n floats."""
    if estimator == "exact" and world_size > 1:
        raise ValueError("estimator='exact' is a single-process reference; use 'histogram' with several ranks")


def _check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _check_routers(routers: dict[str, nn.Module]) -> None:
    if not routers:
        raise ValueError(
            "model has no MoE router recording balancing statistics (a module with `e_score_correction_bias` "
            "and `tokens_per_expert`); is config.num_experts set and first_k_dense_replace < num_hidden_layers?"
        )
    shapes = {(router.top_k, router.num_experts) for router in routers.values()}
    if len(shapes) > 1:
        raise ValueError(f"all routers must share (top_k, num_experts) to be updated together, got {shapes}")
    for name, router in routers.items():
        if router.e_score_correction_bias.dtype != torch.float32:
            raise ValueError(
                f"{name}: e_score_correction_bias is {router.e_score_correction_bias.dtype}, but Quantile Balancing "
                "needs float32 (its per-step updates are below bf16 resolution). The model keeps it float32 under "
                "`.to(dtype)` and `from_pretrained(dtype=...)`; restore a cast one with "
                "`router.e_score_correction_bias = router.e_score_correction_bias.float()`."
            )


def _check_quantile_balancing_applies(config, routers: dict[str, nn.Module]) -> None:
    """QB needs the histogram statistics and a free top-(k+1) over all experts (training.md §1.6.8)."""
    if getattr(config, "router_balancing", None) != "quantile_balancing":
        raise ValueError(
            "update_rule='quantile' needs config.router_balancing='quantile_balancing' (the routers then record "
            f"QB statistics), got {getattr(config, 'router_balancing', None)!r}"
        )
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
    router = next(iter(routers.values()))
    if router.top_k + 1 > router.num_experts:
        raise ValueError(
            f"Quantile Balancing needs num_experts_per_token + 1 <= num_experts, got top_k={router.top_k}, "
            f"num_experts={router.num_experts}"
        )


class QuantileBalancingCallback(TrainerCallback):
    """Updates every router bias once per optimizer step and logs load-balance metrics (training.md §1.10).

    The update runs in ``on_step_end``: after the last micro-batch's forward and ``optimizer.step()`` (so
    with gradient accumulation there is exactly one update per optimizer step) and before the next step's
    first forward (causality, §1.2). ``state.global_step`` then already names the step whose statistics are
    used, and ``_maybe_log_save_evaluate`` follows right away, so the logs carry this step's metrics and a
    checkpoint saved at step t holds the bias step t + 1 routes with: resuming continues exactly.

    Args:
        model: the model to be trained, used to validate the setup; each event then uses the Trainer's model.
        enabled: False leaves the bias alone and logs nothing; statistics are still cleared every step.
        update_rule: "quantile" (QB), "sign" (DeepSeek loss-free balancing, a baseline) or "none" (metrics only).
        estimator: "histogram" or "exact"; must equal ``config.qb_estimator`` (default: taken from it). "exact"
            keeps every r of the step and is a single-process reference.
        ema: decay of an exponential moving average of the solved bias, in [0, 1); 0 disables it (§1.4).
        sign_gamma: step size γ of the sign rule (DeepSeek-V3 uses 1e-3).
        per_layer_metrics: log ``balance/layer_{i}/...`` besides the aggregates over layers.
        process_group: group the token stream is sharded over (default: WORLD when torch.distributed is up).

    Pass it in ``Trainer(callbacks=[...])`` for printed logs and ``trainer_state.json``; use
    ``attach(trainer)`` instead so that ``report_to`` integrations receive the metrics as well.

    After each update, ``latest_metrics`` holds the step's logged metrics and ``latest_loads`` its per-expert token
    counts of every layer, summed over ranks (read by ``kimi_k3.expert_load``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        enabled: bool = True,
        update_rule: str = "quantile",
        estimator: str | None = None,
        ema: float = 0.0,
        sign_gamma: float = 1e-3,
        per_layer_metrics: bool = True,
        process_group=None,
    ):
        _check_choice("update_rule", update_rule, UPDATE_RULES)
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        if update_rule == "sign" and not sign_gamma > 0:
            raise ValueError(f"sign_gamma must be > 0, got {sign_gamma}")
        routers = find_routers(model)
        _check_routers(routers)
        if update_rule == "quantile":
            _check_quantile_balancing_applies(model.config, routers)
            estimator = self._check_estimator(estimator, model.config)
            _check_exact_runs_single_process(estimator, _world_size())
            _warn_if_an_adapter_would_drop_the_bias(model)
        self.enabled = enabled
        self.update_rule = update_rule
        self.estimator = estimator
        self.ema = ema
        self.sign_gamma = sign_gamma
        self.per_layer_metrics = per_layer_metrics
        self.process_group = process_group
        self.latest_metrics: dict[str, float] = {}
        self.latest_loads: dict[str, torch.Tensor] = {}

    @staticmethod
    def _check_estimator(estimator: str | None, config) -> str:
        recorded = getattr(config, "qb_estimator", "histogram")
        estimator = recorded if estimator is None else estimator
        _check_choice("estimator", estimator, ESTIMATORS)
        if estimator != recorded:
            raise ValueError(
                f"estimator={estimator!r} does not match config.qb_estimator={recorded!r}: the routers only record "
                "the statistics of config.qb_estimator; set it in the config before building the model"
            )
        return estimator

    def attach(self, trainer) -> "QuantileBalancingCallback":
        """Register right after DefaultFlowCallback, before the ``report_to`` integrations (hf-integration.md §3.3).

        Moves the callback there if it was already registered: two copies would update twice per step.
        """
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(1, self)
        return self

    @torch.no_grad()
    def update(self, model: nn.Module) -> dict[str, float]:
        """Pool this step's statistics, update every router bias, clear the statistics; return the metrics."""
        routers = find_routers(model)
        if not self.enabled:
            zero_statistics(routers)
            return {}
        tokens, hist = self._pooled_statistics(routers)
        biases = torch.stack([router.e_score_correction_bias for router in routers.values()])
        new_biases = self._new_biases(routers, biases, tokens, hist)
        for router, new_bias in zip(routers.values(), new_biases):
            router.e_score_correction_bias.copy_(new_bias)
        zero_statistics(routers)
        self.latest_loads = {name: tokens[i].cpu() for i, name in enumerate(routers)}
        per_layer = {name: load_balance_metrics(tokens[i], new_biases[i]) for i, name in enumerate(routers)}
        return aggregate_over_layers(per_layer, include_layers=self.per_layer_metrics)

    def _pooled_statistics(self, routers: dict[str, nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token counts [L, n] and, for the histogram estimator, histograms [L, n, B], summed over ranks at once."""
        stats = [torch.stack([router.tokens_per_expert for router in routers.values()])]
        if self.update_rule == "quantile" and self.estimator == "histogram":
            stats.append(torch.stack([router.qb_histogram for router in routers.values()]))
        stats = all_reduce_sum(stats, self.process_group)
        return stats[0], stats[1] if len(stats) > 1 else None

    def _new_biases(self, routers, biases, tokens, hist) -> torch.Tensor:
        top_k = next(iter(routers.values())).top_k
        if self.update_rule == "none":
            return biases
        if self.update_rule == "sign":
            return sign_update(biases, tokens, self.sign_gamma)
        if self.estimator == "histogram":
            return solve_bias_from_histogram(hist, biases, top_k, ema=self.ema)
        return torch.stack(
            [
                solve_bias_exact(_step_required_bias(router), bias, top_k, ema=self.ema)
                for router, bias in zip(routers.values(), biases)
            ]
        )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _check_exact_runs_single_process(self.estimator, args.world_size)
        if args.world_size > 1 and args.ddp_broadcast_buffers is not False:
            raise ValueError(
                "QuantileBalancingCallback needs TrainingArguments(ddp_broadcast_buffers=False): DDP otherwise copies "
                "rank 0's statistics buffers over every other rank's at each forward (hf-integration.md §3.3)"
            )
        zero_statistics(find_routers(model))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.latest_metrics = self.update(model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Only the training-loss log of a step; eval and end-of-training summaries have other keys.
        if logs is not None and "loss" in logs and self.latest_metrics:
            logs.update(self.latest_metrics)
            state.log_history[-1].update(self.latest_metrics)


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


def _step_required_bias(router: nn.Module) -> torch.Tensor:
    """All r [m, n] the router kept this step (``qb_estimator='exact'``)."""
    if not router.qb_required_bias:
        return router.e_score_correction_bias.new_empty(0, router.num_experts)
    return torch.cat(router.qb_required_bias)

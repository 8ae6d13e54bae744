"""Load-balance metrics for routed experts (MaxVio and CV as in Loss-Free Balancing, arXiv:2408.15664).

All metrics are ratios to the ideal load ℓ̄ = mk/n = mean_j ℓ_j, so they are unchanged when every count is
scaled by the same factor (e.g. a layer recomputed under activation checkpointing counts its tokens twice).
"""

import torch


def load_balance_metrics(tokens_per_expert: torch.Tensor, bias: torch.Tensor) -> dict[str, float]:
    """MaxVio, CV, min/mean, dead experts and bias spread of one MoE layer for one step.

    Returns an empty dict when no token was routed, so an empty step logs nothing rather than NaN.
    """
    load = tokens_per_expert.double()
    ideal = load.mean()
    if ideal == 0:
        return {}
    bias = bias.double()
    return {
        # MaxVio = max_j ℓ_j / ℓ̄ − 1 (Loss-Free Balancing, Eq. 4).
        "max_vio": (load.max() / ideal - 1).item(),
        "cv": (load.std(correction=0) / ideal).item(),
        "min_over_mean": (load.min() / ideal).item(),
        "dead_experts": int((tokens_per_expert == 0).sum()),
        "bias_std": bias.std(correction=0).item(),
        "bias_range": (bias.max() - bias.min()).item(),
    }


# How each per-layer metric is summarized over layers as its headline value: the worst layer, except dead
# experts, which are counted over all layers.
_HEADLINE = {
    "max_vio": max,
    "cv": max,
    "min_over_mean": min,
    "dead_experts": sum,
    "bias_std": max,
    "bias_range": max,
}


def aggregate_over_layers(
    per_layer: dict[str, dict[str, float]], *, include_layers: bool = True, prefix: str = "balance"
) -> dict[str, float]:
    """Headline and mean values across layers as ``{prefix}/{metric}[_mean]``, plus ``{prefix}/{layer}/{metric}``."""
    logs: dict[str, float] = {}
    if include_layers:
        for layer, metrics in per_layer.items():
            for name, value in metrics.items():
                logs[f"{prefix}/{layer}/{name}"] = value
    layers = [metrics for metrics in per_layer.values() if metrics]
    if not layers:
        return logs
    for name, headline in _HEADLINE.items():
        values = [metrics[name] for metrics in layers]
        logs[f"{prefix}/{name}"] = headline(values)
        logs[f"{prefix}/{name}_mean"] = sum(values) / len(values)
    return logs

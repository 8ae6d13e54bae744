"""The running score CDF of quantile-normalized routers, refitted from outside the model.

A quantile router (``variants_kimi_k3.KimiK3QuantileRouter``) selects by u = F_e(s), F_e the piecewise-linear CDF
through its ``score_quantiles`` knots [E, B + 1] (F_e(knots[e, j]) = j / B). The model only reads the knots. Between
optimizer steps the balancing callback refits them from what its router hook recorded, `score_bin_counts`: how many
real tokens scored inside each bin between the current knots. Those counts give the empirical CDF exactly at the
current knots; `refit_score_quantiles` reads its j / B quantiles by linear interpolation inside a bin and blends them
with the old knots (a running estimate over steps). On a fixed score distribution the bins converge to equal mass,
so u then matches each score's exact rank to within one bin width 1 / B.
"""

import torch

from kimi_k3.attachments.padding import masked_counts

# Weight of the old knots in each refit: an average over about ten optimizer steps of scores.
SCORE_QUANTILE_EMA = 0.9


def score_bin_counts(scores: torch.Tensor, knots: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Counts [E, B] (int64) of the scores [N, E] in each expert's bins between ``knots`` [E, B + 1], real tokens
    only."""
    num_experts, num_bins = knots.shape[0], knots.shape[1] - 1
    bins = (torch.searchsorted(knots.to(scores.dtype), scores.T.contiguous(), right=True) - 1).clamp_(0, num_bins - 1)
    slots = bins + torch.arange(num_experts, device=bins.device)[:, None] * num_bins
    return masked_counts(slots.T, token_mask, num_experts * num_bins).view(num_experts, num_bins)


def refit_score_quantiles(knots: torch.Tensor, counts: torch.Tensor, ema: float = SCORE_QUANTILE_EMA) -> torch.Tensor:
    """New knots: ema·old + (1 − ema)·(the j / B quantiles of the counted scores); the end knots stay where they are
    and an expert that saw no token keeps its knots."""
    num_bins = counts.shape[-1]
    total = counts.sum(-1, keepdim=True).double()
    cdf = torch.cat([torch.zeros_like(total), counts.double().cumsum(-1)], dim=-1) / total.clamp_min(1)
    levels = torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float64, device=counts.device).expand_as(cdf)
    right = torch.searchsorted(cdf, levels.contiguous()).clamp_(1, num_bins)
    left = right - 1
    rise = cdf.gather(1, right) - cdf.gather(1, left)
    fraction = ((levels - cdf.gather(1, left)) / rise.clamp_min(1e-300)).clamp_(0, 1)
    old = knots.double()
    fitted = old.gather(1, left) + fraction * (old.gather(1, right) - old.gather(1, left))
    fitted[:, 0], fitted[:, -1] = old[:, 0], old[:, -1]
    new = ema * old + (1 - ema) * fitted
    return torch.where(total > 0, new, old).to(knots.dtype)

"""The running score CDF of quantile-normalized routing: refitted from recorded bin counts it matches exact ranks to
within one bin, balances a skewed router with no bias update, and is refitted by the balancing callback."""

import torch

from kimi_k3.attachments.padding import masked_counts
from kimi_k3.policies.balance_metrics import load_balance_metrics
from kimi_k3.policies.quantile_balancing import QuantileBalancing
from kimi_k3.policies.score_quantiles import refit_score_quantiles, score_bin_counts
from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3TopkRouter
from tests.conftest import tiny_config
from variants_kimi_k3 import KimiK3QuantileRouter, KimiK3VariantForCausalLM, quantile_normalize, uniform_knots


def fitted(scores: torch.Tensor, num_bins: int, steps: int) -> torch.Tensor:
    """Knots after ``steps`` refits on the same scores, each from the counts between the previous knots."""
    knots = uniform_knots(scores.shape[1], num_bins)
    for _ in range(steps):
        knots = refit_score_quantiles(knots, score_bin_counts(scores, knots, None), ema=0.0)
    return knots


def test_refitted_cdf_matches_the_exact_rank_of_every_score_within_one_bin_width():
    generator = torch.Generator().manual_seed(0)
    num_tokens, num_bins = 4000, 16
    # Six experts with different score distributions: narrow and wide, low and high.
    logits = torch.randn(num_tokens, 6, generator=generator) * torch.linspace(0.2, 3, 6) + torch.linspace(-2, 2, 6)
    scores = torch.sigmoid(logits)
    u = quantile_normalize(scores, fitted(scores, num_bins, steps=8))
    exact = (scores[None] <= scores[:, None]).float().mean(1)  # F_e(s) = share of expert e's scores <= s
    assert (u - exact).abs().max() < 1 / num_bins
    assert (u - scores).abs().max() > 1 / num_bins  # it is the refit, not the identity, that matches


def test_refit_keeps_the_end_knots_monotone_knots_and_an_unseen_experts_knots():
    knots = uniform_knots(3, 8)
    counts = torch.tensor([[0, 0, 5, 9, 0, 1, 0, 0], [0] * 8, [1] * 8])
    new = refit_score_quantiles(knots, counts, ema=0.5)
    assert torch.equal(new[:, 0], knots[:, 0]) and torch.equal(new[:, -1], knots[:, -1])
    assert (new.diff(dim=-1) >= 0).all()
    assert torch.equal(new[1], knots[1]) and torch.allclose(new[2], knots[2])


def skewed_tokens(count: int, seed: int) -> torch.Tensor:
    tokens = torch.randn(count, 32, generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = 1.0  # a constant feature: the router's first column offsets each expert's logits
    return tokens


def test_quantile_routing_balances_a_skewed_router_without_any_bias_update():
    config = tiny_config(router_score_normalization="quantile", router_score_quantile_bins=32)
    quantile, released = KimiK3QuantileRouter(config), KimiK3TopkRouter(config)
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)) * 0.3
    weight[:, 0] = torch.linspace(-2, 2, 8)
    with torch.no_grad():
        quantile.weight.copy_(weight), released.weight.copy_(weight)
        seen = skewed_tokens(4096, seed=1)
        quantile.score_quantiles.copy_(fitted(quantile.scores(quantile(seen)[0]), 32, steps=8))
        held_out = skewed_tokens(4096, seed=2)
        max_vio = {name: load_balance_metrics(masked_counts(router(held_out)[2], None, 8),
                                              router.e_score_correction_bias)["max_vio"]
                   for name, router in (("quantile", quantile), ("released", released))}
    assert quantile.e_score_correction_bias.abs().max() == 0
    assert max_vio["quantile"] < max_vio["released"] / 4, max_vio


def test_quantile_balancing_refits_the_knots_from_real_tokens_and_they_are_saved(tmp_path):
    torch.manual_seed(0)
    model = KimiK3VariantForCausalLM(tiny_config(router_score_normalization="quantile", router_score_quantile_bins=8)).train()
    balancing = QuantileBalancing(model, update_rule="none", score_quantile_ema=0.0)
    balancing.attach()
    router, statistics = model.model.layers[1].block_sparse_moe.gate, balancing.statistics["layer_1"]
    ids = torch.randint(3, 97, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # padding is not counted
    model(ids, attention_mask=mask)
    assert statistics.score_counts.sum() == (32 - 5) * model.config.num_experts
    expected = refit_score_quantiles(router.score_quantiles, statistics.score_counts.clone(), ema=0.0)
    balancing.update()
    assert torch.equal(router.score_quantiles, expected) and not torch.equal(expected, uniform_knots(8, 8))
    assert router.e_score_correction_bias.abs().max() == 0  # update_rule="none": the CDF alone moved
    model.save_pretrained(tmp_path)
    reloaded = KimiK3VariantForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.model.layers[1].block_sparse_moe.gate.score_quantiles, expected)

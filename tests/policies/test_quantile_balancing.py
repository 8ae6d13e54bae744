"""Quantile Balancing: solve functions, synthetic-router convergence (the K3 report's Table A setting), the policy
on the real router, and its Trainer callback."""

import copy

import pytest
import torch
import torch.distributed as dist
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from transformers import Trainer, TrainerCallback, TrainingArguments

from kimi_k3.attachments.seams import find_routers
from kimi_k3.policies.balance_metrics import aggregate_over_layers, load_balance_metrics
from kimi_k3.policies.quantile_balancing import (
    QuantileBalancing,
    QuantileBalancingCallback,
    all_reduce_sum,
    exact_quantile,
    histogram_quantile,
    histogram_range,
    required_bias,
    required_bias_histogram,
    required_bias_of_routes,
    sign_update,
    solve_bias_exact,
    solve_bias_from_histogram,
)
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config
from variants_kimi_k3 import KimiK3VariantForCausalLM

# ---------------------------------------------------------------------------------------------------------
# A synthetic router: z_ij = μ_j + u_i·v_j + 0.5·ε_ij, s = σ(z)
# ---------------------------------------------------------------------------------------------------------


SYNTHETIC_N, SYNTHETIC_K, SYNTHETIC_M = 64, 8, 8192  # Table A, first row (q = 1024)


def synthetic_batches(steps: int, sigma: float = 1.0) -> list[torch.Tensor]:
    """A stream of fresh score batches [m, n] from fixed expert factors (seed 0) and a token stream (seed 1)."""
    experts = torch.Generator().manual_seed(0)
    popularity = torch.randn(SYNTHETIC_N, generator=experts) * sigma
    factors = torch.randn(SYNTHETIC_N, 8, generator=experts) / 8**0.5
    tokens = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        token_factors = torch.randn(SYNTHETIC_M, 8, generator=tokens)
        noise = torch.randn(SYNTHETIC_M, SYNTHETIC_N, generator=tokens)
        batches.append(torch.sigmoid(popularity + token_factors @ factors.T + 0.5 * noise))
    return batches


def loads(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.bincount(routes.flatten(), minlength=num_experts)


def balance_stream(update, batches: list[torch.Tensor]) -> list[dict]:
    """Route each fresh batch with the current bias, measure it, then update the bias from that same batch.

    Causal as in training: the bias solved from batch t is first used for batch t + 1.
    """
    bias = torch.zeros(SYNTHETIC_N)
    history = []
    for scores in batches:
        routes, r = required_bias(scores, bias, SYNTHETIC_K)
        load = loads(routes, SYNTHETIC_N)
        history.append(load_balance_metrics(load, bias))
        bias = update(bias, r, load, SYNTHETIC_K)
    return history


def qb_exact(bias, r, load, k):
    return solve_bias_exact(r, bias, k)


def qb_histogram(num_bins, interpolate=True):
    def update(bias, r, load, k):
        hist = required_bias_histogram(r, bias, num_bins)
        return solve_bias_from_histogram(hist, bias, k, interpolate=interpolate)

    return update


def sign_rule(gamma):
    return lambda bias, r, load, k: sign_update(bias, load, gamma)


def steady_cv(history) -> float:
    """Mean CV from update 10 on, where QB has reached its noise floor (Table A: t10 ≈ steady state)."""
    return sum(step["cv"] for step in history[10:]) / len(history[10:])


@pytest.fixture(scope="module")
def batches():
    return synthetic_batches(steps=30)


@pytest.fixture(scope="module")
def streams(batches):
    """QB runs need 20 updates to show their steady state; the sign rule is read at update 29."""
    return {
        "exact": balance_stream(qb_exact, batches[:20]),
        "hist1000": balance_stream(qb_histogram(1000), batches[:20]),
        "hist100": balance_stream(qb_histogram(100), batches[:20]),
        "sign": balance_stream(sign_rule(1e-3), batches),
    }


def small_batch(m=512, n=16, k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(m, n, generator=gen)
    bias = 0.1 * torch.randn(n, generator=gen)
    return scores, bias, k


# ---------------------------------------------------------------------------------------------------------
# Solve functions
# ---------------------------------------------------------------------------------------------------------


def test_required_bias_uses_top_k_plus_one_cutoff_of_biased_scores():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.4]])
    bias = torch.tensor([0.0, 0.7, 0.0, 0.0])
    routes, r = required_bias(scores, bias, top_k=2)
    # biased scores 0.9, 0.8, 0.5, 0.4: routes {0, 1}, cutoff α = 0.5
    assert sorted(routes[0].tolist()) == [0, 1]
    torch.testing.assert_close(r, 0.5 - scores, rtol=0, atol=0)


def test_exact_quantile_is_the_sorted_column_order_statistic():
    scores, bias, k = small_batch()
    _, r = required_bias(scores, bias, k)
    q = r.shape[0] * k // r.shape[1]
    margins = -r
    assert torch.equal(exact_quantile(r, k), r.sort(dim=0).values[q])
    assert torch.equal(exact_quantile(r, k), -margins.sort(dim=0, descending=True).values[q])


def test_exact_bias_puts_q_tokens_above_the_old_cutoffs():
    scores, bias, k = small_batch(m=4096, n=8, k=2)
    _, r = required_bias(scores, bias, k)
    bias_hat = exact_quantile(r, k)
    cutoff = (r + scores)[:, :1]
    q = 4096 * 2 // 8
    above = (scores + bias_hat > cutoff).sum(0)
    at_or_above = (scores + bias_hat >= cutoff).sum(0)
    assert (above <= q).all() and (at_or_above >= q + 1).all()
    # Tokens whose (k+1)-th choice is expert j have r = b_j up to rounding (an atom); off the atom
    # the count is exact.
    off_atom = (bias_hat - bias).abs() > 1e-6
    assert off_atom.sum() >= 4
    assert (above[off_atom] == q).all()


def test_mean_centering_keeps_routes_and_zero_mean():
    scores, bias, k = small_batch()
    _, r = required_bias(scores, bias, k)
    bias_hat = exact_quantile(r, k)
    centered = solve_bias_exact(r, bias, k)
    assert abs(centered.mean().item()) < 1e-6
    fresh = torch.rand(256, 16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(
        required_bias(fresh, bias_hat, k)[0].sort(-1).values, required_bias(fresh, centered, k)[0].sort(-1).values
    )


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_popular_expert_gets_negative_bias_and_loses_load(estimator):
    n, k = 8, 2
    gen = torch.Generator().manual_seed(0)
    popular = torch.zeros(n)
    popular[0] = 0.3

    def batch():
        return torch.rand(2048, n, generator=gen) * 0.6 + popular

    bias = torch.zeros(n)
    routes, r = required_bias(batch(), bias, k)
    load_before = loads(routes, n)[0]
    if estimator == "exact":
        bias = solve_bias_exact(r, bias, k)
    else:
        bias = solve_bias_from_histogram(required_bias_histogram(r, bias, 1000), bias, k)
    assert bias[0] < 0
    load_after = loads(required_bias(batch(), bias, k)[0], n)[0]
    assert load_after < 0.5 * load_before
    assert abs(load_after.item() - 2048 * k / n) < 0.1 * 2048 * k / n


def test_histogram_quantile_within_one_bin_of_exact():
    scores, bias, k = small_batch(m=4096, n=32, k=4)
    _, r = required_bias(scores, bias, k)
    for num_bins in (1000, 100):
        hist = required_bias_histogram(r, bias, num_bins)
        _, width = histogram_range(bias, num_bins)
        error = (histogram_quantile(hist, bias, k) - exact_quantile(r, k)).abs().max()
        assert error <= width.item()


def test_histogram_counts_every_token_once_per_expert_inside_the_range():
    scores, bias, k = small_batch()
    _, r = required_bias(scores, bias, k)
    hist = required_bias_histogram(r, bias, 1000)
    lo, width = histogram_range(bias, 1000)
    assert (hist.sum(-1) == scores.shape[0]).all()
    assert r.min() >= lo and r.max() <= lo + 1000 * width


def test_duplicated_statistics_leave_the_bias_unchanged():
    """Activation-checkpointing recompute records a layer twice; q comes from ΣH, so b must not move."""
    scores, bias, k = small_batch(m=1000, n=16, k=3)
    _, r = required_bias(scores, bias, k)
    hist = required_bias_histogram(r, bias, 1000)
    assert torch.equal(solve_bias_from_histogram(2 * hist, bias, k), solve_bias_from_histogram(hist, bias, k))
    assert torch.equal(solve_bias_exact(torch.cat([r, r]), bias, k), solve_bias_exact(r, bias, k))


def test_empty_statistics_keep_the_bias_without_nan():
    bias = torch.tensor([0.2, -0.1, -0.1, 0.0])
    hist = torch.zeros(2, 4, 100, dtype=torch.long)
    scores = torch.rand(64, 4, generator=torch.Generator().manual_seed(0))
    hist[1] = required_bias_histogram(required_bias(scores, bias, 1)[1], bias, 100)
    new = solve_bias_from_histogram(hist, torch.stack([bias, bias]), top_k=1)
    assert torch.equal(new[0], bias) and not torch.equal(new[1], bias)
    assert torch.isfinite(new).all()
    assert torch.equal(solve_bias_exact(torch.empty(0, 4), bias, 1), bias)


def test_stacked_layers_solve_like_single_layers():
    layers = [small_batch(seed=seed) for seed in range(3)]
    hists, biases = [], []
    for scores, bias, k in layers:
        hists.append(required_bias_histogram(required_bias(scores, bias, k)[1], bias, 1000))
        biases.append(bias)
    stacked = solve_bias_from_histogram(torch.stack(hists), torch.stack(biases), 3)
    for i in range(3):
        assert torch.equal(stacked[i], solve_bias_from_histogram(hists[i], biases[i], 3))


def test_ema_blends_old_bias_and_recenters():
    old = torch.tensor([0.3, -0.1, -0.2])
    r = torch.tensor([[0.0, 0.5, 1.0], [0.1, 0.6, 0.9], [0.2, 0.7, 0.8]])
    plain = solve_bias_exact(r, old, 1)
    smoothed = solve_bias_exact(r, old, 1, ema=0.5)
    expected = 0.5 * old + 0.5 * plain
    torch.testing.assert_close(smoothed, expected - expected.mean())


def test_sign_update_moves_each_bias_by_gamma_toward_the_mean_load():
    bias = torch.zeros(4)
    new = sign_update(bias, torch.tensor([4, 3, 1, 0]), gamma=1e-3)
    torch.testing.assert_close(new, torch.tensor([-1e-3, -1e-3, 1e-3, 1e-3]))
    assert torch.equal(sign_update(bias, torch.zeros(4, dtype=torch.long), 1e-3), bias)


def test_all_reduce_sum_is_identity_without_a_process_group():
    stats = [torch.arange(6).view(2, 3), torch.ones(2, 3, 4, dtype=torch.long)]
    assert all(torch.equal(a, b) for a, b in zip(all_reduce_sum(stats), stats))


def test_load_balance_metrics_of_the_figure_5_toy():
    metrics = load_balance_metrics(torch.tensor([4, 3, 1, 0]), torch.tensor([0.1, 0.0, -0.1, 0.0]))
    assert metrics["max_vio"] == pytest.approx(1.0)
    assert metrics["cv"] == pytest.approx(10**0.5 / 4)
    assert metrics["min_over_mean"] == 0.0
    assert metrics["dead_experts"] == 1
    assert metrics["bias_std"] == pytest.approx(0.005**0.5)
    assert metrics["bias_range"] == pytest.approx(0.2)
    assert load_balance_metrics(torch.zeros(4, dtype=torch.long), torch.zeros(4)) == {}


def test_aggregate_over_layers_reports_worst_layer_and_mean():
    logs = aggregate_over_layers(
        {
            "layer_1": load_balance_metrics(torch.tensor([4, 3, 1, 0]), torch.zeros(4)),
            "layer_2": load_balance_metrics(torch.tensor([2, 2, 2, 2]), torch.zeros(4)),
        }
    )
    assert logs["balance/max_vio"] == pytest.approx(1.0)
    assert logs["balance/max_vio_mean"] == pytest.approx(0.5)
    assert logs["balance/min_over_mean"] == 0.0
    assert logs["balance/dead_experts"] == 1
    assert logs["balance/layer_2/cv"] == 0.0


# ---------------------------------------------------------------------------------------------------------
# Synthetic-router convergence
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["exact", "hist1000"])
def test_quantile_balancing_converges_in_a_few_updates(streams, estimator):
    history = streams[estimator]
    assert history[0]["cv"] > 1.0  # b = 0: skewed popularity
    assert history[1]["cv"] <= 0.15
    assert all(step["cv"] <= 0.06 for step in history[3:])
    assert all(step["dead_experts"] == 0 for step in history[1:])


def test_sign_rule_is_still_unbalanced_after_29_updates(streams):
    assert streams["sign"][29]["cv"] > 1.0
    assert streams["exact"][10]["max_vio"] / streams["sign"][10]["max_vio"] < 0.1


def test_histogram_with_1000_bins_balances_like_exact_and_100_bins_worse(streams):
    exact, fine, coarse = (steady_cv(streams[name]) for name in ("exact", "hist1000", "hist100"))
    assert abs(fine - exact) <= 0.1 * exact
    assert coarse > 1.2 * exact


def test_left_edge_snapping_balances_worse_than_interpolation(streams, batches):
    """Without in-bin interpolation the update is piecewise constant in the counts and locks."""
    interpolated = steady_cv(streams["hist100"])
    snapped = steady_cv(balance_stream(qb_histogram(100, interpolate=False), batches[:20]))
    assert snapped > 2 * interpolated


# ---------------------------------------------------------------------------------------------------------
# The real router and the callback
# ---------------------------------------------------------------------------------------------------------


def train_forward(model, input_ids, attention_mask=None, backward=False):
    """A training forward (the router records with grad enabled in train mode), optionally with its backward."""
    model.train()
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
    if backward:
        out.loss.backward()


def batch_ids(batch=2, length=16, seed=0, vocab=97):
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model(config):
    return KimiK3ForCausalLM(config)


def attached(model, **settings) -> QuantileBalancing:
    """The policy recording on ``model``, updated by hand (no optimizer)."""
    policy = QuantileBalancing(model, **settings)
    policy.attach()
    return policy


def test_real_router_routes_top_k_of_biased_scores_with_bias_free_weights(model):
    statistics = attached(model).statistics["layer_1"]
    router = find_routers(model)["layer_1"]
    router.train()
    hidden = torch.randn(40, model.config.hidden_size, requires_grad=True)
    router.e_score_correction_bias.copy_(0.05 * torch.randn(router.num_experts))
    bias = router.e_score_correction_bias.clone()
    _, weights, indices = router(hidden)
    scores = torch.sigmoid(hidden.detach() @ router.weight.detach().T)
    expected_routes, r = required_bias(scores, bias, router.top_k)
    assert torch.equal(indices.sort(-1).values, expected_routes.sort(-1).values)
    picked = scores.gather(1, indices)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))
    # Recording pinned to the reference: the recorded histogram is required_bias_histogram of r.
    assert torch.equal(statistics.histogram, required_bias_histogram(r, bias, statistics.num_bins))
    # A common offset selects the same experts and gives bit-identical weights; b never gets a gradient.
    router.e_score_correction_bias.add_(0.3)
    _, shifted_weights, shifted_indices = router(hidden)
    assert torch.equal(shifted_indices.sort(-1).values, indices.sort(-1).values)
    assert torch.equal(shifted_weights.gather(1, shifted_indices.argsort(-1)), weights.gather(1, indices.argsort(-1)))
    weights.sum().backward()
    assert not router.e_score_correction_bias.requires_grad and router.e_score_correction_bias.grad is None
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" not in dict(model.named_parameters())


def test_update_solves_the_pooled_histogram_and_clears_statistics(model):
    policy = attached(model)
    routers, statistics = find_routers(model), policy.statistics
    train_forward(model, batch_ids(seed=0))
    train_forward(model, batch_ids(seed=1))  # a second micro-batch of the same optimizer step
    hist = torch.stack([stats.histogram.clone() for stats in statistics.values()])
    bias = torch.stack([router.e_score_correction_bias.clone() for router in routers.values()])
    metrics = policy.update()
    expected = solve_bias_from_histogram(hist, bias, model.config.num_experts_per_token)
    for i, (router, stats) in enumerate(zip(routers.values(), statistics.values())):
        assert torch.equal(router.e_score_correction_bias, expected[i])
        assert abs(router.e_score_correction_bias.mean().item()) < 1e-6
        assert stats.histogram.sum() == 0 and stats.tokens_per_expert.sum() == 0
    assert (hist.sum(-1) == 2 * 2 * 16).all()  # both micro-batches, every token once per expert
    assert metrics["balance/dead_experts"] >= 0 and metrics["balance/layer_1/max_vio"] > 0


def test_exact_estimator_solves_all_kept_required_biases(model, monkeypatch):
    policy = attached(model, estimator="exact")
    router, statistics = find_routers(model)["layer_1"], policy.statistics["layer_1"]
    train_forward(model, batch_ids())
    r = statistics.step_required_bias()
    expected = solve_bias_exact(r, router.e_score_correction_bias.clone(), router.top_k)
    policy.update()
    assert torch.equal(router.e_score_correction_bias, expected)
    assert r.shape == (2 * 16, router.num_experts) and statistics.required_biases == []
    built_in_one_process = QuantileBalancing(model, estimator="exact")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="single-process"):
        built_in_one_process.attach()  # attached under several ranks


def test_activation_checkpointing_recompute_gives_identical_bias(model):
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable({"use_reentrant": False})
    hists = []
    for candidate in (model, checkpointed):
        policy = attached(candidate)
        train_forward(candidate, batch_ids(batch=1), backward=True)
        hists.append(policy.statistics["layer_1"].histogram.clone())
        policy.update()
    assert hists[1].sum() == 2 * hists[0].sum()  # the recompute records every checkpointed layer again
    for plain, recomputed in zip(find_routers(model).values(), find_routers(checkpointed).values()):
        assert torch.equal(plain.e_score_correction_bias, recomputed.e_score_correction_bias)


def test_eval_and_no_grad_forwards_leave_statistics_and_bias_frozen(model):
    policy = attached(model)
    routers, statistics = find_routers(model), policy.statistics
    for router in routers.values():
        router.e_score_correction_bias.copy_(0.01 * torch.randn(router.num_experts))
    before = [router.e_score_correction_bias.clone() for router in routers.values()]
    model.eval()
    model(input_ids=batch_ids())
    model.train()
    with torch.no_grad():
        model(input_ids=batch_ids())
    assert all(stats.histogram.sum() == 0 and stats.tokens_per_expert.sum() == 0 for stats in statistics.values())
    assert policy.update() == {}  # empty step: no update, no NaN, nothing to log
    assert all(torch.equal(router.e_score_correction_bias, b) for router, b in zip(routers.values(), before))


def test_padding_is_routed_but_not_counted(model):
    statistics = attached(model).statistics["layer_2"]
    router = find_routers(model)["layer_2"]
    routed = []
    handle = router.register_forward_hook(lambda module, args, out: routed.append(out[2].shape[0]))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    train_forward(model, batch_ids(), attention_mask=mask)
    handle.remove()
    assert routed == [32]
    assert (statistics.histogram.sum(-1) == 26).all()
    assert statistics.tokens_per_expert.sum() == 26 * router.top_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cutoff_from_the_routes_equals_the_top_k_plus_one_reference(dtype):
    """The hook reads α as the best biased score outside the router's top-k: bitwise the (k+1)-th of a top-(k+1),
    whatever order the routes come in."""
    generator = torch.Generator().manual_seed(0)
    scores, bias = torch.rand(257, 31, generator=generator, dtype=dtype), 0.05 * torch.randn(31, dtype=dtype)
    routes, expected = required_bias(scores, bias, 5)
    shuffled = routes.gather(1, torch.rand(routes.shape, generator=generator).argsort(-1))
    assert torch.equal(required_bias_of_routes(scores, bias, shuffled), expected)


def test_padding_rows_are_dropped_without_boolean_indexing():
    """The masked histogram (spare bin, no host sync) equals the histogram of the valid rows alone; NaN rows (a
    diverged step) are left out the same way."""
    scores, bias = torch.rand(300, 12), 0.1 * torch.randn(12)
    _, r = required_bias(scores, bias, 3)
    mask = torch.rand(300) > 0.3
    assert torch.equal(required_bias_histogram(r, bias, 50, mask), required_bias_histogram(r[mask], bias, 50))
    assert required_bias_histogram(r, bias, 50, torch.zeros(300, dtype=torch.bool)).sum() == 0
    diverged = r.clone()
    diverged[~mask] = float("nan")
    assert torch.equal(required_bias_histogram(diverged, bias, 50), required_bias_histogram(r[mask], bias, 50))


@pytest.mark.parametrize("num_experts, num_bins, dtype", [(12, 50, torch.float32), (17, 1 << 20, torch.float64)],
                         ids=["few-bins", "beyond-2^24-bins"])
def test_histogram_counts_each_required_bias_in_its_bin_by_the_definition(num_experts, num_bins, dtype):
    """Against bin = clamp(floor((r - low) / width), 0, B - 1), one expert at a time: the histogram numbers the bins of
    all experts together as floats, which float32 holds exactly up to 2^24 and float64 beyond (the second case)."""
    generator = torch.Generator().manual_seed(5)
    scores, bias = torch.rand(200, num_experts, generator=generator), 0.1 * torch.randn(num_experts, generator=generator)
    _, r = required_bias(scores, bias, 3)
    low, width = histogram_range(bias, num_bins)
    expected = torch.stack([torch.bincount(((r[:, j].to(dtype) - low) / width).floor().clamp(0, num_bins - 1).long(),
                                           minlength=num_bins) for j in range(num_experts)])
    assert torch.equal(required_bias_histogram(r, bias, num_bins), expected)


def test_save_and_reload_keep_the_bias_bit_exact_without_statistics(model, tmp_path):
    policy = attached(model)
    train_forward(model, batch_ids())
    policy.update()
    train_forward(model, batch_ids(seed=3))  # statistics pending at save time
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        keys = list(saved.keys())
    assert sum(key.endswith("e_score_correction_bias") for key in keys) == len(find_routers(model))
    assert not any("histogram" in key or "tokens_per_expert" in key for key in keys)
    reloaded = KimiK3ForCausalLM.from_pretrained(tmp_path)
    assert list(reloaded.buffers()) == [router.e_score_correction_bias for router in find_routers(reloaded).values()]
    for name, router in find_routers(model).items():
        loaded = find_routers(reloaded)[name]
        assert loaded.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(loaded.e_score_correction_bias, router.e_score_correction_bias)


def test_sign_and_none_rules_are_baselines_and_disabled_does_nothing(model):
    router = find_routers(model)["layer_1"]
    sign = QuantileBalancing(model, update_rule="sign", sign_gamma=1e-2)
    with sign.attach():
        train_forward(model, batch_ids())
        load = sign.statistics["layer_1"].tokens_per_expert.clone()
        sign.update()
    expected = 1e-2 * torch.sign(load.double().mean() - load).float()
    assert torch.equal(router.e_score_correction_bias, expected)
    for rule, enabled, logs_metrics in (("none", True, True), ("quantile", False, False)):
        policy = QuantileBalancing(model, update_rule=rule, enabled=enabled)
        with policy.attach():
            train_forward(model, batch_ids(seed=4))
            metrics = policy.update()
            assert policy.statistics["layer_1"].tokens_per_expert.sum() == 0
        assert torch.equal(router.e_score_correction_bias, expected)
        assert ("balance/max_vio" in metrics) == logs_metrics


def test_a_removed_attachment_records_nothing_and_another_policy_records_alone(model):
    first = QuantileBalancing(model)
    attachment = first.attach()
    first_statistics = first.statistics["layer_1"]
    attachment.remove()  # what the end of a Trainer run does
    second = attached(model)
    train_forward(model, batch_ids())
    router = find_routers(model)["layer_1"]
    assert second.statistics["layer_1"].tokens_per_expert.sum() == 2 * 16 * router.top_k
    assert first_statistics.tokens_per_expert.sum() == 0 and first.statistics == {}
    with pytest.raises(RuntimeError, match="attach it first"):
        first.update()


def test_one_all_reduce_per_step_even_for_an_empty_step(model, tmp_path, monkeypatch):
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        policy = attached(model)
        train_forward(model, batch_ids())
        policy.update()
        policy.update()
    finally:
        dist.destroy_process_group()
    layers, n, bins = len(find_routers(model)), model.config.num_experts, policy.num_bins
    assert calls == [layers * n * (bins + 1)] * 2


def test_callback_rejects_setups_quantile_balancing_cannot_handle(model):
    with pytest.raises(ValueError, match="no MoE router"):
        QuantileBalancingCallback(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="estimator"):
        QuantileBalancingCallback(model, estimator="median")
    for bins in (1, 2.5):
        with pytest.raises(ValueError, match="num_bins"):
            QuantileBalancingCallback(model, num_bins=bins)
    with pytest.raises(ValueError, match="update_rule"):
        QuantileBalancingCallback(model, update_rule="aux_loss")
    with pytest.raises(ValueError, match="ema"):
        QuantileBalancingCallback(model, ema=1.0)
    softmax_config = copy.deepcopy(model.config)
    softmax_config.moe_router_activation_func = "softmax"
    softmax_router = KimiK3ForCausalLM(softmax_config)
    with pytest.raises(ValueError, match="moe_router_activation_func must be 'sigmoid'"):
        QuantileBalancingCallback(softmax_router)
    QuantileBalancingCallback(softmax_router, update_rule="sign")
    with pytest.raises(StrictDataclassError, match="Group-limited routing is not supported"):
        model.config.num_expert_group = 4  # the config refuses it itself; the policy checks configs that bypassed it
    model.config.__dict__.update(num_expert_group=4, topk_group=2)
    with pytest.raises(ValueError, match="group-limited"):
        QuantileBalancingCallback(model)
    model.config.__dict__.update(num_expert_group=1, topk_group=1)
    for router in find_routers(model).values():
        router.top_k = router.num_experts
    with pytest.raises(ValueError, match="num_experts_per_token \\+ 1"):
        QuantileBalancingCallback(model)


def test_callback_requires_fp32_bias(model):
    model.to(torch.bfloat16)
    QuantileBalancingCallback(model)  # `.to` keeps the bias float32
    router = find_routers(model)["layer_1"]
    router.e_score_correction_bias = router.e_score_correction_bias.bfloat16()
    with pytest.raises(ValueError, match="needs float32") as error:
        QuantileBalancingCallback(model)
    assert ".float()" in str(error.value) and ".md" not in str(error.value)


def test_trainer_updates_once_per_optimizer_step_and_logs_metrics(model, tmp_path, capsys):
    balancing = QuantileBalancingCallback(model)
    layer = find_routers(model)["layer_1"]

    def statistics():  # attached for the run, at the start of training
        return balancing.policy.statistics["layer_1"]

    class Probe(TrainerCallback):
        """Sees the statistics after each micro-batch and just before / after the optimizer step (and its hook)."""

        def __init__(self):
            self.substep_tokens, self.steps, self.reported = [], [], []

        def on_substep_end(self, args, state, control, **kwargs):
            self.substep_tokens.append(int(statistics().histogram[0].sum()))
            assert torch.equal(layer.e_score_correction_bias, self.bias_at_step_start)

        def on_step_begin(self, args, state, control, **kwargs):
            self.bias_at_step_start = layer.e_score_correction_bias.clone()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.pending = (statistics().histogram.clone(), layer.e_score_correction_bias.clone())

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.steps.append((*self.pending, layer.e_score_correction_bias.clone(), int(statistics().histogram.sum())))

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.reported.append(dict(logs))

    data = [{"input_ids": ids, "labels": ids} for ids in batch_ids(batch=6, length=16)]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no",
        learning_rate=1e-3, seed=0,
    )
    probe = Probe()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[probe])
    # A stand-in for a report_to integration: those sit right after DefaultFlowCallback, before user callbacks.
    reporter = Probe()
    trainer.callback_handler.callbacks.insert(1, reporter)
    balancing.attach(trainer)
    trainer.train()

    assert probe.substep_tokens == [16] * 3  # after the first micro-batch of each step
    assert len(probe.steps) == 3
    for hist, bias_before, bias_after, left_over in probe.steps:
        assert hist[0].sum() == 32  # both micro-batches pooled
        assert torch.equal(bias_after, solve_bias_from_histogram(hist, bias_before, layer.top_k))
        assert left_over == 0
    train_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(train_logs) == 3 and all("balance/max_vio" in entry for entry in train_logs)
    reported = [logs for logs in reporter.reported if "loss" in logs]
    assert len(reported) == 3 and all("balance/layer_1/cv" in logs for logs in reported)
    assert "balance/max_vio" in capsys.readouterr().out
    assert balancing.attachment is None and not layer._forward_hooks  # detached at the end of training


# ---------------------------------------------------------------------------------------------------------
# The routing variants (variants_kimi_k3.py)
# ---------------------------------------------------------------------------------------------------------
def test_dynamic_k_mean_active_count_settles_within_five_percent_of_k_inside_the_bounds():
    torch.manual_seed(0)
    config = tiny_config(dynamic_experts_per_token=True, min_experts_per_token=1, max_experts_per_token=4)
    model = KimiK3VariantForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    balancing = QuantileBalancing(model)
    balancing.attach(optimizer)
    means, generator = [], torch.Generator().manual_seed(0)
    for step in range(16):
        ids = torch.randint(3, 97, (8, 32), generator=generator)
        model(ids, labels=ids).loss.backward()
        if step >= 10:  # after the first updates: each expert fires on a k/n share
            means += [stats.tokens_per_expert.sum().item() / ids.numel() for stats in balancing.statistics.values()]
        optimizer.step(), optimizer.zero_grad()
    assert abs(sum(means) / len(means) - 2) < 0.05 * 2, means
    router = find_routers(model)["layer_1"]
    _, _, routes = router(torch.randn(500, config.hidden_size))
    counts = (routes < config.num_experts).sum(-1)
    assert counts.min() >= 1 and counts.max() <= 4
    assert router.e_score_correction_bias.mean() < -0.1  # solved as is, not mean-centered
    with pytest.raises(ValueError, match="update_rule='sign' balances top-k routers only"):
        QuantileBalancing(model, update_rule="sign")


def test_two_level_routing_balances_the_coarse_routers_and_reports_them_apart():
    model = KimiK3VariantForCausalLM(tiny_config(num_coarse_experts=4, coarse_experts_per_token=2))
    balancing = QuantileBalancing(model, estimator="exact")
    balancing.attach()
    assert "layer_1.coarse_gate" in balancing.statistics
    coarse = model.model.layers[1].block_sparse_moe.gate.coarse_gate
    with torch.no_grad():
        coarse.weight[0] += 0.5  # a popular group
    ids = batch_ids(batch=4)
    train_forward(model, ids)
    before = balancing.statistics["layer_1.coarse_gate"].tokens_per_expert.clone()
    metrics = balancing.update()
    train_forward(model, ids)
    after = balancing.statistics["layer_1.coarse_gate"].tokens_per_expert
    assert (after.max() - after.min()) < (before.max() - before.min()) and coarse.e_score_correction_bias[0] < 0
    assert "balance/coarse/max_vio" in metrics and set(balancing.latest_loads) == set(find_routers(model))
    with pytest.raises(ValueError, match="coarse_experts_per_token must be < num_coarse_experts"):
        QuantileBalancing(KimiK3VariantForCausalLM(tiny_config(num_coarse_experts=1, coarse_experts_per_token=1)))

import pytest
import torch

from kimi_k3.attachments.seams import find_routers
from kimi_k3.policies.auxiliary_balance_loss import AuxiliaryBalanceLoss, sequence_balance_loss
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config
from variants_kimi_k3 import KimiK3VariantForCausalLM


def balance_loss_from_the_formula(scores, top_k, lengths) -> float:
    """DeepSeek-V3 Eq. 17-20 term by term in Python floats: for each sequence, f_i from a top-k of the raw scores s
    and P_i from s' = s / Σ_j s_j over its first ``lengths[b]`` tokens, then Σ_i f_i P_i, averaged over sequences."""
    batch, _, experts = scores.shape
    total = 0.0
    for b in range(batch):
        tokens = range(lengths[b])
        fraction, probability = [0.0] * experts, [0.0] * experts
        for t in tokens:
            row = [float(scores[b, t, i]) for i in range(experts)]
            chosen = sorted(range(experts), key=lambda i: -row[i])[:top_k]
            for i in range(experts):
                fraction[i] += experts / (top_k * lengths[b]) * (i in chosen)
                probability[i] += row[i] / sum(row) / lengths[b]
        total += sum(f * p for f, p in zip(fraction, probability))
    return total / batch


@pytest.mark.parametrize("batch, seq, experts, top_k", [(1, 1, 4, 1), (3, 7, 8, 2), (2, 13, 16, 5)])
def test_sequence_balance_loss_equals_deepseek_v3_formula_term_by_term(batch, seq, experts, top_k):
    generator = torch.Generator().manual_seed(batch * 100 + seq)
    scores = torch.rand(batch, seq, experts, generator=generator, dtype=torch.float64) * 0.98 + 0.01
    lengths = [seq - (b % 3) if seq > 2 else seq for b in range(batch)]  # odd lengths: padded tail of some rows
    mask = torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]
    routes = torch.topk(scores, top_k, dim=-1).indices
    loss = sequence_balance_loss(scores, routes, experts, mask)
    assert loss.item() == pytest.approx(balance_loss_from_the_formula(scores, top_k, lengths), rel=1e-12)


def test_perfectly_balanced_routes_with_uniform_scores_give_one():
    experts, top_k = 4, 2
    routes = torch.tensor([[[0, 1], [2, 3]]])  # every expert once in two tokens
    loss = sequence_balance_loss(torch.full((1, 2, experts), 0.5, dtype=torch.float64), routes, experts)
    assert loss.item() == pytest.approx(1.0, rel=1e-15)


def test_gradient_reaches_the_router_only_through_the_mean_probability():
    scores = torch.rand(2, 5, 6, dtype=torch.float64, requires_grad=True)
    routes = torch.topk(scores.detach(), 2, dim=-1).indices
    sequence_balance_loss(scores, routes, 6).backward()
    fraction = torch.nn.functional.one_hot(routes, 6).sum(-2).double().sum(1) * 6 / (2 * 5)  # f [B, n]
    total = scores.detach().sum(-1, keepdim=True)
    # d/ds_{t,j} of Σ_i f_i · (1/T) Σ_t s_{t,i}/S_t = (f_j − Σ_i f_i s_{t,i}/S_t) / (T · S_t), averaged over B = 2.
    weighted = (fraction[:, None, :] * scores.detach()).sum(-1, keepdim=True) / total
    expected = (fraction[:, None, :] - weighted) / (5 * total) / 2
    # Sums of a few dozen fp64 terms: a few ulps of the largest entry.
    torch.testing.assert_close(scores.grad, expected, rtol=0, atol=64 * torch.finfo(torch.float64).eps *
                               expected.abs().max().item())


def test_attached_loss_adds_alpha_times_every_layers_term_in_training_forwards_only():
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(tiny_config()).double()
    model.set_experts_implementation("eager")  # grouped_mm kernels have no fp64 path
    input_ids = torch.randint(3, 97, (2, 9))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, 6:] = 0
    recorded = []
    handles = [router.register_forward_hook(lambda r, a, out: recorded.append(out)) for router in
               find_routers(model).values()]
    model.train()
    plain = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
    alpha = 0.25
    with AuxiliaryBalanceLoss(model, alpha).attach():
        with_loss = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
        model.eval()
        evaluated = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
    for handle in handles:
        handle.remove()
    lengths = [9, 6]
    layers = recorded[len(recorded) // 3 : 2 * len(recorded) // 3]  # the forward with the loss attached
    expected = sum(balance_loss_from_the_formula(logits.detach().sigmoid().view(2, 9, -1), model.config.num_experts_per_token,
                                                 lengths) for logits, _, _ in layers)
    # The model returns its loss in fp32 whatever the weights: the sum is exact to that rounding of both losses.
    rounding = 4 * torch.finfo(with_loss.dtype).eps * (abs(plain.item()) + abs(with_loss.item()))
    assert with_loss.item() - plain.item() == pytest.approx(alpha * expected, abs=rounding)
    assert evaluated.item() == pytest.approx(model(input_ids, attention_mask=attention_mask, labels=input_ids).loss.item())


def test_alpha_and_routing_variants_are_refused_in_one_line():
    with pytest.raises(ValueError, match="alpha .* must be > 0, got 0"):
        AuxiliaryBalanceLoss(KimiK3ForCausalLM(tiny_config()), 0.0)
    with pytest.raises(ValueError, match="selects by selection_threshold"):
        AuxiliaryBalanceLoss(KimiK3VariantForCausalLM(tiny_config(dynamic_experts_per_token=True)), 1e-4)

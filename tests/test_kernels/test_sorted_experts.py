"""The sorted routed experts, attached from outside at every fused experts module, are as accurate as transformers'
``grouped_mm`` backend against the float64 per-expert reference (output and every gradient, fp32 and bf16, with an
unused expert, odd token counts and k = 1), repeat bit for bit under deterministic algorithms, stay out of inference, the
``eager`` reference and expert parallelism, and come off with their handle."""

import pytest
import torch

from kimi_k3.attachments.handle import attribute_owners
from kimi_k3.attachments.seams import find_routed_experts
from kimi_k3.kernels import sorted_experts as sorted_experts_module
from kimi_k3.kernels.sorted_experts import use_sorted_experts
from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3SparseMoeBlock
from tests.conftest import CallCounter, tiny_config
from tests.numerics import assert_as_accurate
from variants_kimi_k3 import KimiK3VariantForCausalLM


def experts_module(implementation: str = "grouped_mm", dtype: torch.dtype = torch.float32, seed: int = 0):
    """The routed experts of a tiny MoE block with N(0, 0.3) weights on ``implementation``."""
    torch.manual_seed(seed)
    config = tiny_config()
    config._experts_implementation = implementation  # what a model sets up; a bare block would run the eager loop
    experts = KimiK3SparseMoeBlock(config).experts.train()
    for parameter in experts.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return experts.to(dtype)


def routing(tokens: int, num_experts: int, top_k: int, unused: int, seed: int = 1):
    """Distinct experts per token (never ``unused``) and positive float64 routing weights."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=generator)
    scores[:, unused] = -1.0
    index = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, dtype=torch.float64, generator=generator) + 0.1
    return index, weights


def forward_and_grads(experts, hidden, index, weights):
    hidden, weights = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = experts(hidden, index, weights)
    grad_output = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tensors = (hidden, weights, experts.gate_up_proj, experts.down_proj)
    return out, torch.autograd.grad(out, tensors, grad_output.to(out.dtype))


@pytest.mark.parametrize("tokens,top_k,dtype", [(37, 3, torch.float32), (64, 2, torch.float32), (5, 1, torch.float32),
                                               (41, 3, torch.bfloat16)])
def test_sorted_experts_are_as_accurate_as_the_grouped_mm_backend(tokens, top_k, dtype, monkeypatch):
    counter = CallCounter(monkeypatch, sorted_experts_module, "sorted_experts")
    plain = experts_module(dtype=dtype)
    attached = experts_module(dtype=dtype)
    use_sorted_experts(attached)
    exact_experts = experts_module("eager", torch.float64)
    hidden = torch.randn(tokens, plain.hidden_dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    index, weights = routing(tokens, plain.num_experts, top_k, unused=plain.num_experts - 1)

    # Routing weights are fp32 in every dtype (the router's sigmoid runs in fp32).
    out, grads = forward_and_grads(attached, hidden.to(dtype), index, weights.float())
    trusted_out, trusted_grads = forward_and_grads(plain, hidden.to(dtype), index, weights.float())
    exact_out, exact_grads = forward_and_grads(exact_experts, hidden, index, weights)

    assert counter.calls == 1  # the attached module ran the sorted experts, the plain one the backend
    assert_as_accurate(out, trusted_out, exact_out, what="output")
    for name, grad, trusted, exact in zip(("hidden", "weights", "gate_up_proj", "down_proj"), grads, trusted_grads,
                                          exact_grads):
        assert_as_accurate(grad, trusted, exact, what=f"gradient of {name}")
    assert not grads[2][-1].any() and not grads[3][-1].any()  # the unused expert gets no gradient


def test_sorted_experts_repeat_bit_for_bit_under_deterministic_algorithms():
    experts = experts_module()
    use_sorted_experts(experts)
    hidden = torch.randn(50, experts.hidden_dim, generator=torch.Generator().manual_seed(3))
    index, weights = routing(50, experts.num_experts, 3, unused=0)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = (forward_and_grads(experts, hidden, index, weights.float()) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    assert torch.equal(first[0], second[0]) and all(map(torch.equal, first[1], second[1]))


def test_sorted_experts_serve_training_forwards_of_grouped_mm_only(monkeypatch):
    counter = CallCounter(monkeypatch, sorted_experts_module, "sorted_experts")
    hidden = torch.randn(9, tiny_config().routed_expert_hidden_size, requires_grad=True)
    index, weights = routing(9, tiny_config().num_experts, 2, unused=0)
    weights = weights.float()

    experts = experts_module()
    with use_sorted_experts(experts):
        experts(hidden, index, weights)
        assert counter.calls == 1
        with torch.no_grad():
            experts(hidden, index, weights)  # inference keeps the model's implementation
        experts._is_expert_parallel = True  # sentinel rows: the backend masks them
        experts(hidden, index, weights)
    assert counter.calls == 1

    eager = experts_module("eager")
    with use_sorted_experts(eager):
        eager(hidden, index, weights)  # the per-expert reference stays the reference
    experts._is_expert_parallel = False
    experts(hidden, index, weights)  # removed
    assert counter.calls == 1


def test_sorted_experts_attach_to_every_fused_experts_module_and_come_off():
    model = KimiK3ForCausalLM(tiny_config())
    modules = find_routed_experts(model)
    assert modules
    attachment = use_sorted_experts(model)
    assert all(attribute_owners(experts) == {"forward": "sorted experts"} for experts in modules.values())
    with pytest.raises(ValueError, match="sorted experts cannot set KimiK3Experts.forward: sorted experts holds it"):
        use_sorted_experts(model)
    attachment.remove()
    assert all("forward" not in vars(experts) and not attribute_owners(experts) for experts in modules.values())


def test_dynamic_k_experts_which_regroup_their_routes_first_are_left_alone():
    config = tiny_config(dynamic_experts_per_token=True, min_experts_per_token=1, max_experts_per_token=3)
    model = KimiK3VariantForCausalLM(config)
    attachment = use_sorted_experts(model)
    assert find_routed_experts(model) and not any(attribute_owners(module) for module in model.modules())
    ids = torch.randint(3, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    attachment.remove()

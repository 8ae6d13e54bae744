"""The fused Block AttnRes kernels, attached from outside at the model's ``attention_residual`` seam, equal the model's
eager `block_attention_residual` (alone and through a whole model, forward and every gradient), serve every site
(decoder layers and the output mix), stay out of inference, small mixes and modules that are not plain, and come off
with their handle."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from transformers.testing_utils import CaptureLogger

from kimi_k3.attachments.handle import attribute_owners
from kimi_k3.attachments.seams import find_attention_residual_sites
from kimi_k3.kernels import compiled, fused_attention_residual
from kimi_k3.kernels.compiled import CompiledFunction
from kimi_k3.kernels.fused_attention_residual import (
    SHARED_KERNELS,
    AttentionResidualKernels,
    attention_residual,
    fused_attention_residual as fused,
    use_fused_attention_residuals,
)
from kimi_k3.kernels.training import use_fused_kernels
from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3PseudoQuery, KimiK3RMSNorm, block_attention_residual
from tests.conftest import CallCounter, tiny_config
from tests.numerics import assert_as_accurate, float64_copy


def site_modules(hidden: int, dtype: torch.dtype, seed: int = 0) -> tuple[KimiK3PseudoQuery, KimiK3RMSNorm]:
    """A pseudo-query and a norm with N(0, 1) weights (trained ones are far from the init's zeros and ones)."""
    torch.manual_seed(seed)
    proj, norm = KimiK3PseudoQuery(hidden), KimiK3RMSNorm(hidden, eps=1e-5)
    for parameter in (*proj.parameters(), *norm.parameters()):
        torch.nn.init.normal_(parameter)
    return proj.to(dtype), norm.to(dtype)


def site_inputs(shape: tuple[int, ...], blocks: int, dtype: torch.dtype, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    block_sum = torch.randn(*shape, dtype=torch.float64, generator=generator) * 3
    bank = torch.randn(*shape[:-1], blocks, shape[-1], dtype=torch.float64, generator=generator) * 3
    return block_sum.to(dtype).requires_grad_(), bank.to(dtype).requires_grad_()


def assert_accurate(actual, trusted, exact, what: str) -> None:
    """As accurate as the eager reference in the working precision; in float64, where the reference is the exact
    result itself, within the fixed float64 bound (the compiled sums round in another order)."""
    if actual.dtype == torch.float64:
        torch.testing.assert_close(actual, exact, rtol=1e-12, atol=1e-12 * exact.abs().max().item(), msg=what)
    else:
        assert_as_accurate(actual, trusted, exact, what=what)


def value_and_grads(mix, block_sum, bank, proj, norm):
    """The mix and the gradients of its four tensors for a fixed random output gradient."""
    out = mix(block_sum, bank, proj, norm)
    grad_output = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tensors = (block_sum, bank, norm.weight, proj.weight)
    return out, torch.autograd.grad(out, tensors, grad_output.to(out.dtype))


def test_what_the_kernels_compile_is_the_model_reference_fp64():
    """`attention_residual` (here run eagerly) is the model's `block_attention_residual` with stand-ins for its two
    modules: bit-identical forward, and autograd through the fused function equals autograd through the modules."""
    proj, norm = site_modules(24, torch.float64)
    block_sum, bank = site_inputs((3, 7, 24), 3, torch.float64)
    assert torch.equal(attention_residual(block_sum, bank, norm.weight, proj.weight, norm.variance_epsilon),
                       block_attention_residual(block_sum, bank, proj, norm))
    kernels = AttentionResidualKernels()
    for kernel in kernels.all():
        kernel.failed = True  # the eager functions: float64 has no vectorised CPU kernel to compare
    out, grads = value_and_grads(lambda *args: fused(*args, kernels), block_sum, bank, proj, norm)
    expected_out, expected_grads = value_and_grads(block_attention_residual, block_sum, bank, proj, norm)
    assert torch.equal(out, expected_out)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    assert all(kernel.compiled is None for kernel in kernels.all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_attention_residual_equals_the_reference_forward_and_backward(dtype):
    """Compiled ≡ eager, the mix and the gradients of the partial sum, the snapshots and both weights, at odd shapes and
    several numbers of blocks (one compilation, dynamic shapes): as close to float64 as the eager mix in ``dtype``."""
    for shape, blocks in [((3, 7, 24), 1), ((2, 45, 40), 3), ((1, 5, 40), 4)]:
        proj, norm = site_modules(shape[-1], dtype)
        block_sum, bank = site_inputs(shape, blocks, dtype)
        out, grads = value_and_grads(fused, block_sum, bank, proj, norm)
        expected_out, expected_grads = value_and_grads(block_attention_residual, block_sum, bank, proj, norm)
        exact_proj, exact_norm = site_modules(shape[-1], dtype)
        exact_proj, exact_norm = exact_proj.double(), exact_norm.double()
        exact_inputs = (tensor.detach().double().requires_grad_() for tensor in (block_sum, bank))
        exact_out, exact_grads = value_and_grads(block_attention_residual, *exact_inputs, exact_proj, exact_norm)
        assert out.dtype == dtype
        assert_accurate(out, expected_out, exact_out, what="mix")
        for name, grad, expected, exact in zip(("partial sum", "bank", "norm weight", "query"), grads, expected_grads,
                                               exact_grads):
            assert grad.dtype == expected.dtype
            assert_accurate(grad, expected, exact, what=f"gradient of the {name}")
    assert all(kernel.compiled is not None and not kernel.failed for kernel in SHARED_KERNELS.all())


def tiny_model(seed: int = 0) -> KimiK3ForCausalLM:
    """The tiny config's model in training mode, its AttnRes weights N(0, 1) so that every mix is far from uniform."""
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(tiny_config()).train()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_res_" in name:
                parameter.normal_()
    return model


def model_loss_and_grads(model, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_a_model_trains_through_every_fused_site_and_matches_the_eager_model(monkeypatch):
    """Every decoder layer's two mixes (the first layer has no snapshot to mix before its attention) and the output
    mix take the kernels; the loss and every parameter's gradient are as accurate as the eager model's."""
    spy = CallCounter(monkeypatch, fused_attention_residual, "fused_attention_residual")
    input_ids = torch.randint(3, tiny_config().vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    model = tiny_model()
    with use_fused_attention_residuals(model, min_elements=1):
        loss, grads = model_loss_and_grads(model, input_ids)
    layers = tiny_config().num_hidden_layers
    assert spy.calls == (layers - 1) + layers + 1  # before attention (not layer 0), before the feed-forward, output
    expected_loss, expected_grads = model_loss_and_grads(tiny_model(), input_ids)
    exact_loss, exact_grads = model_loss_and_grads(float64_copy(tiny_model()), input_ids)
    assert spy.calls == 2 * layers
    assert_as_accurate(loss, expected_loss, exact_loss, what="loss")
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert_as_accurate(grads[name], expected_grads[name], exact_grads[name], what=name)


def test_fused_attention_residuals_attach_to_every_site_and_their_handle_gives_back_the_reference():
    model = tiny_model()
    sites = find_attention_residual_sites(model)
    assert sorted(sites) == sorted(["model", *(f"model.layers.{i}" for i in range(tiny_config().num_hidden_layers))])
    attachment = use_fused_attention_residuals(model)
    assert all(attribute_owners(site) == {"attention_residual": "fused Block AttnRes"} for site in sites.values())
    refusal = "fused Block AttnRes cannot set KimiK3Model.attention_residual: fused Block AttnRes holds it"
    with pytest.raises(ValueError, match=refusal):
        use_fused_attention_residuals(model)
    attachment.remove()
    assert all("attention_residual" not in vars(site) and not attribute_owners(site) for site in sites.values())
    assert not find_attention_residual_sites(KimiK3ForCausalLM(tiny_config(attn_res_block_size=None)))


def test_the_reference_runs_for_inference_small_mixes_and_modules_that_are_not_plain(monkeypatch):
    """No grad, a mix below ``min_elements``, or a norm with a forward hook (which must run, as it does in the model's
    reference) keep the eager mix."""
    spy = CallCounter(monkeypatch, fused_attention_residual, "fused_attention_residual")
    model = tiny_model()
    input_ids = torch.randint(3, tiny_config().vocab_size, (1, 9))
    with use_fused_attention_residuals(model):  # 9 tokens: far below FUSED_MIN_ELEMENTS
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    with use_fused_attention_residuals(model, min_elements=1), torch.no_grad():
        model(input_ids=input_ids)
    assert spy.calls == 0
    seen = []
    model.model.layers[1].mlp_res_norm.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with use_fused_attention_residuals(model, min_elements=1):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert len(seen) == 1 and spy.calls == 2 * tiny_config().num_hidden_layers - 1


@pytest.mark.parametrize("situ,attention_residuals", [(True, True), (False, True), (True, False)])
def test_the_jobs_kernels_attach_as_asked_and_come_off_with_one_handle(situ, attention_residuals):
    model = tiny_model()
    layer = model.model.layers[1]
    attachment = use_fused_kernels(model, situ=situ, attention_residuals=attention_residuals)
    assert attribute_owners(layer.block_sparse_moe.experts.glu) == ({"forward": "fused SiTU-GLU"} if situ else {})
    assert attribute_owners(layer) == ({"attention_residual": "fused Block AttnRes"} if attention_residuals else {})
    attachment.remove()
    assert not any(attribute_owners(module) for module in model.modules())


def failing_backward_compiler():
    """A ``torch.compile`` backend whose forward compiles (the traced graph, run as it is) and backward does not."""

    def backward(graph, example_inputs):
        raise RuntimeError("this backend compiles no backward")

    return aot_autograd(fw_compiler=lambda graph, example_inputs: make_boxed_func(graph.forward), bw_compiler=backward)


def test_a_backward_that_cannot_be_compiled_falls_back_in_the_forward_call():
    """The backward is compiled together with the forward, so a backward compiler's failure makes the forward call
    fall back to the eager mix (one warning; the same mix and gradients) instead of failing inside ``backward()``, where
    nothing could fall back; which is what happens to a kernel compiled without that."""

    def mix_with_fresh_graph(*args):  # new code objects: nothing cached to reuse
        return attention_residual(*args)

    def undifferentiated_mix(*args):
        return attention_residual(*args)

    proj, norm = site_modules(24, torch.float32)
    block_sum, bank = site_inputs((2, 9, 24), 2, torch.float32)
    kernel = CompiledFunction(mix_with_fresh_graph, differentiable=True, backend=failing_backward_compiler())
    with CaptureLogger(compiled.logger) as captured:
        out, grads = value_and_grads(lambda b, k, p, n: kernel(b, k, n.weight, p.weight, n.variance_epsilon),
                                     block_sum, bank, proj, norm)
    expected_out, expected_grads = value_and_grads(block_attention_residual, block_sum, bank, proj, norm)
    assert kernel.failed and captured.out.count("torch.compile of `mix_with_fresh_graph` failed") == 1
    assert torch.equal(out, expected_out) and all(torch.equal(a, b) for a, b in zip(grads, expected_grads))

    lazy = CompiledFunction(undifferentiated_mix, backend=failing_backward_compiler())
    out = lazy(block_sum, bank, norm.weight, proj.weight, norm.variance_epsilon)
    with pytest.raises(Exception, match="this backend compiles no backward"):
        out.sum().backward()

"""Per-Head Muon's elementwise passes: the compiled loops round exactly as the eager expressions, at any length and
layout, and both stay within rounding of a float64 evaluation."""

import pytest
import torch
from torch._dynamo.utils import counters

from kimi_k3.optim import elementwise
from kimi_k3.optim.elementwise import (
    COMPILED,
    advance_momentum_,
    decay_and_add_,
    momentum_and_nesterov_update_,
    nesterov_update,
)
from kimi_k3.optim.muon import PerHeadMuon
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config

FP32_EPS = torch.finfo(torch.float32).eps
# Odd lengths put elements in the vector loop's tail at different offsets; the strided case reads every other element.
LENGTHS = (1, 7, 33, 1000, 65_537)


def _tensors(length, strided, seed, count=3, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    if not strided:
        return [(torch.randn(length, generator=generator) * 10 ** torch.randint(-3, 3, (1,), generator=generator))
                .to(dtype) for _ in range(count)]
    return [torch.randn(length, 2, generator=generator)[:, 0].to(dtype) for _ in range(count)]


def _compiled(function, *args):
    kernel = COMPILED[function]
    result = kernel(*args)
    assert kernel.compiled is not None and not kernel.failed, "the compiled loop did not run"
    return result


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("length", LENGTHS)
def test_compiled_passes_round_exactly_as_eager(length, strided, param_dtype):
    """A bf16 parameter (its momentum and gradient bf16 too) rounds after every operation in both paths."""
    buffer, grad, param = _tensors(length, strided, seed=length, dtype=param_dtype)
    eager_buffer, compiled_buffer = buffer.clone(), buffer.clone()
    if strided:  # in-place results must land in the strided memory itself
        eager_buffer = torch.randn(length, 2)[:, 0].to(param_dtype).copy_(buffer)
        compiled_buffer = torch.randn(length, 2)[:, 0].to(param_dtype).copy_(buffer)
    advance_momentum_(eager_buffer, grad, 0.95)
    _compiled(advance_momentum_, compiled_buffer, grad, 0.95)
    assert torch.equal(eager_buffer, compiled_buffer)

    for dtype in (torch.bfloat16, torch.float32):
        eager = nesterov_update(grad, eager_buffer, 0.95, dtype)
        compiled = _compiled(nesterov_update, grad, compiled_buffer, 0.95, dtype)
        assert compiled.dtype == dtype and torch.equal(eager, compiled)
        one_pass_buffer = buffer.clone()
        one_pass = _compiled(momentum_and_nesterov_update_, one_pass_buffer, grad, 0.95, dtype)
        assert torch.equal(one_pass_buffer, compiled_buffer) and torch.equal(one_pass, compiled)
        eager_param, compiled_param = param.clone(), param.clone()
        decay_and_add_(eager_param, eager, 1 - 3e-3 * 0.1, -3e-3 * 0.2 * 16)
        _compiled(decay_and_add_, compiled_param, compiled, 1 - 3e-3 * 0.1, -3e-3 * 0.2 * 16)
        assert torch.equal(eager_param, compiled_param)


def test_passes_are_within_rounding_of_float64():
    buffer, grad, param = _tensors(65_537, False, seed=0)
    wide = [t.double() for t in (buffer, grad, param)]
    momentum, decay, alpha = 0.95, 1 - 3e-3 * 0.1, -0.07
    # Each output is at most three roundings away: two fp32 operations, then the final dtype.
    _compiled(advance_momentum_, buffer, grad, momentum)
    exact_buffer = wide[0] * momentum + wide[1]
    bound = 2 * FP32_EPS * (wide[0].abs() * momentum + wide[1].abs())
    assert ((buffer.double() - exact_buffer).abs() <= bound).all()

    update = _compiled(nesterov_update, grad, buffer, momentum, torch.bfloat16)
    exact_update = wide[1] + buffer.double() * momentum
    bound = torch.finfo(torch.bfloat16).eps / 2 * exact_update.abs() * (1 + 4 * FP32_EPS) \
        + 2 * FP32_EPS * (wide[1].abs() + buffer.double().abs() * momentum)
    assert ((update.double() - exact_update).abs() <= bound).all()

    _compiled(decay_and_add_, param, update, decay, alpha)
    exact_param = wide[2] * decay + update.double() * alpha
    bound = 2 * FP32_EPS * (wide[2].abs() * decay + update.double().abs() * abs(alpha))
    assert ((param.double() - exact_param).abs() <= bound).all()


def test_a_new_learning_rate_every_step_does_not_recompile():
    """The scheduler changes ``alpha`` and ``decay`` every step: they are arguments of the loop, not constants."""
    param, update = torch.randn(4096), torch.randn(4096).bfloat16()
    _compiled(decay_and_add_, param, update, 0.999, -1e-3)
    graphs = counters["stats"]["unique_graphs"]
    for step in range(1, 6):
        _compiled(decay_and_add_, param, update, 1 - step * 1e-4, -step * 1e-3)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_muon_step_is_bitwise_the_same_compiled_or_eager(monkeypatch):
    """Whichever parameters run compiled (all, or none), the step gives the same bits: neither the size threshold nor
    a failed compilation (or a mix of DTensor layouts, which runs eager) can change a parameter's trajectory."""
    # Kernels of this test's own, so that what other tests compiled does not count as this step's compiled passes.
    kernels = elementwise.compiled_passes()
    monkeypatch.setattr(elementwise, "COMPILED", kernels)
    results = []
    for threshold in (0, float("inf")):
        monkeypatch.setattr(elementwise, "COMPILED_MIN_ELEMENTS", threshold)
        torch.manual_seed(0)
        model = KimiK3ForCausalLM(tiny_config())
        optimizer = PerHeadMuon.for_model(model, lr=1e-2, weight_decay=0.1)
        for step in range(2):
            generator = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(compiled, eager) for compiled, eager in zip(*results))
    # The single-process step runs momentum with the update, and decay with the update (the sharded step the rest).
    assert all(kernels[function].compiled is not None and not kernels[function].failed
               for function in (momentum_and_nesterov_update_, decay_and_add_))

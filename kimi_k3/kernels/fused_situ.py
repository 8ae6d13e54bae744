"""Fused SiTU-GLU for training, attached to a Kimi K3 model from outside.

The model computes SiTU-GLU with its eager reference (`modeling_kimi_k3.situ_and_mul`), so a folder loaded with
``trust_remote_code`` alone trains, with the same results up to rounding. Eager SiTU-GLU is a dozen memory-bound
elementwise passes forward and backward; here each direction is one compiled loop over the elements. The forward is
the reference compiled, writes the output and keeps the inputs; the backward evaluates tanh, sigmoid and tanh again
from them and writes both input gradients from the derivative (`situ_and_mul_gradients`), which is what autograd
computes through the reference, in one loop. `use_fused_situ(model)` swaps this in at the model's activation seam,
every ``KimiK3GLUActivation``, the way transformers' kernel hub (``kernelize``) replaces the forward of a layer that
keeps its torch reference as the body. The routed experts hand their activation the concatenated ``[gate ‖ up]``: the
kernels read its two halves in place, and the backward writes the gradient in that layout.

Inside the compiled loops tanh comes from ``exp`` (`tanh_from_exp`): inductor's CPU code evaluates ``tanh`` with
SLEEF's 1-ulp ``tanhf`` (torch 2.13), several times slower per element than eager ``torch.tanh`` (`benchmarks/
bench_situ.py`, "tanh"; benchmarks/records/2026-12-03_situ_tanh_from_exp_xeon-amx.md), slow enough that the fused pair lost to eager's dozen
passes at the default model's sizes; with ``exp``, which it vectorises well, the pair beats them from about 2^17
outputs with AVX-512 kernels and 2^19 with AVX2 ones.
"""

from dataclasses import dataclass, field, fields
from functools import partial

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from kimi_k3.attachments.handle import Attachment, undone_on_failure
from kimi_k3.attachments.seams import find_situ_activations
from kimi_k3.kernels.compiled import CompiledFunction, isa_safe_compile_caches
from modeling_kimi_k3 import situ_and_mul, upcast

__all__ = [
    "SHARED_KERNELS", "SiTUKernels", "fused_min_elements", "use_fused_situ", "fused_situ_glu", "fused_situ_and_mul",
    "CompiledFunction", "isa_safe_compile_caches",
]

# The smallest activation (elements of its output) worth the compiled kernels, by where they run. On a CPU the pair
# evaluates the transcendentals twice (forward, then again in the backward), which below these sizes costs more than
# eager's dozen passes over tensors that stay in cache, and compiling it costs seconds per process; the crossover
# follows the vector width (`benchmarks/bench_situ.py`, "by activation size"; measured in
# benchmarks/records/2026-12-03_situ_tanh_from_exp_xeon-amx.md). Elsewhere a launch is what it saves.
FUSED_MIN_ELEMENTS_AVX512 = 2**17
FUSED_MIN_ELEMENTS_AVX2_OR_NARROWER = 2**19
FUSED_MIN_ELEMENTS_ACCELERATOR = 2**17


def fused_min_elements(device_type: str) -> int:
    """The activation size from which SiTU-GLU runs compiled on ``device_type``, chosen from the CPU's vector
    kernels (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` restricts)."""
    if device_type != "cpu":
        return FUSED_MIN_ELEMENTS_ACCELERATOR
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        return FUSED_MIN_ELEMENTS_AVX512
    return FUSED_MIN_ELEMENTS_AVX2_OR_NARROWER


# Maclaurin coefficients of tanh, x to x¹³: below |x| = 1/4 the first omitted term is under 10⁻¹¹ of the result.
TANH_SERIES = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075)
TANH_SERIES_BELOW = 0.25


def tanh_from_exp(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) from one ``exp``, for float32 (and narrower, computed in it): ``(1 - e)/(1 + e)`` with
    ``e = exp(-2|x|)``, the sign of ``x``; below |x| = 1/4, where ``1 - e`` would cancel, its Maclaurin series.
    Its relative error is what its own roundings allow, under 3.5 float32 epsilons (at |x| = 1/4, where the exp
    form is worst conditioned; 1.5 measured), bounded over the float32 range in `tests/test_kernels/test_fused_situ.py`;
    ±inf give ±1 and NaN stays NaN."""
    magnitude = x.abs()
    e = torch.exp(-2 * magnitude)
    from_exp = torch.copysign((1 - e) / (1 + e), x)
    square = x * x
    series = TANH_SERIES[-1]
    for coefficient in reversed(TANH_SERIES[:-1]):
        series = series * square + coefficient
    return torch.where(magnitude < TANH_SERIES_BELOW, x * series, from_exp)


def kernel_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh of the kernels: `tanh_from_exp` where inductor compiles them for a CPU (float32 and narrower),
    ``torch.tanh`` where they run eagerly (a compiler failure, a dispatch mode, float64 references), which is faster
    there and exact, and on accelerators, whose compiled tanh is not SLEEF's."""
    if torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype != torch.float64:
        return tanh_from_exp(x)
    return torch.tanh(x)


def situ_output(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """The forward kernel: the reference with the kernels' tanh."""
    return situ_and_mul(gate, up, beta, linear_beta, tanh=kernel_tanh)


def situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU of ``[gate ‖ up]`` concatenated on the last dim, gate first (the experts' fused layout)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return situ_and_mul(gate, up, beta, linear_beta)


def situ_glu_output(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """The forward kernel of the concatenated layout."""
    gate, up = gate_up.chunk(2, dim=-1)
    return situ_output(gate, up, beta, linear_beta)


def situ_and_mul_gradients(gate: torch.Tensor, up: torch.Tensor, grad_output: torch.Tensor, beta: float,
                           linear_beta: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `situ_and_mul` for ``gate`` and ``up``, in fp32 as the reference, in their dtype.

    With t₁ = tanh(g/β₁), s = σ(g), a = β₁t₁s and c = β₂tanh(u/β₂) (c = u uncapped), out = a·c, so
    ∂out/∂g = c·((1 - t₁²)s + a(1 - s)) and ∂out/∂u = a(1 - tanh²(u/β₂)) (a uncapped): autograd's products through
    the reference (``tanh_backward``, ``sigmoid_backward``), written out so that inductor makes one loop of them."""
    dtype = gate.dtype
    gate, up, grad_output = upcast(gate), upcast(up), upcast(grad_output)
    capped_gate, sigmoid = kernel_tanh(gate / beta), torch.sigmoid(gate)
    activated_gate = beta * capped_gate * sigmoid
    gate_slope = (1 - capped_gate * capped_gate) * sigmoid + activated_gate * (1 - sigmoid)
    if linear_beta is None:
        capped_up, up_slope = up, 1.0
    else:
        capped_up = kernel_tanh(up / linear_beta)
        capped_up, up_slope = linear_beta * capped_up, 1 - capped_up * capped_up
    return (grad_output * capped_up * gate_slope).to(dtype), (grad_output * activated_gate * up_slope).to(dtype)


def situ_glu_gradient(gate_up: torch.Tensor, grad_output: torch.Tensor, beta: float,
                      linear_beta: float | None) -> torch.Tensor:
    """The same for `situ_glu`: the gradient of ``[gate ‖ up]``, written in that layout by the same loop."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat(situ_and_mul_gradients(gate, up, grad_output, beta, linear_beta), dim=-1)


@dataclass
class SiTUKernels:
    """The compiled forward and backward kernels, for separate inputs and for the concatenated experts layout; only
    those a process runs are compiled.

    Compiling costs seconds, so every model attached with the default set (`SHARED_KERNELS`) shares one compilation
    cache per process; pass another set to `use_fused_situ` to keep its compilation (or its failure) apart.
    """

    output: CompiledFunction = field(default_factory=lambda: CompiledFunction(situ_output, static_widths=True))
    concatenated_output: CompiledFunction = field(
        default_factory=lambda: CompiledFunction(situ_glu_output, static_widths=True))
    gradients: CompiledFunction = field(
        default_factory=lambda: CompiledFunction(situ_and_mul_gradients, static_widths=True))
    concatenated_gradient: CompiledFunction = field(
        default_factory=lambda: CompiledFunction(situ_glu_gradient, static_widths=True))

    def all(self) -> tuple[CompiledFunction, ...]:
        return tuple(getattr(self, kernel.name) for kernel in fields(self))


SHARED_KERNELS = SiTUKernels()


class FusedSiTUGLU(torch.autograd.Function):
    """SiTU-GLU whose forward and backward are each one compiled elementwise kernel of ``kernels``.

    Keeping the inputs and evaluating the transcendentals again in the backward beat writing the partial derivatives
    out in the forward, on AVX-512 and AVX2 kernels alike (`benchmarks/bench_situ.py`): fewer memory passes for the
    same memory held. The kernels are plain functions compiled without autograd, so a compiler failure, in either
    direction, is caught and falls back to the eager function. ``gate`` is either the concatenated ``[gate ‖ up]``
    (``up=None``: the gradient comes in that layout) or the gate alone.
    """

    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta, kernels: SiTUKernels):
        ctx.beta, ctx.linear_beta, ctx.kernels = beta, linear_beta, kernels
        ctx.save_for_backward(gate, up)
        if up is None:
            return kernels.concatenated_output(gate, beta, linear_beta)
        return kernels.output(gate, up, beta, linear_beta)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        gate, up = ctx.saved_tensors
        if up is None:
            grads = ctx.kernels.concatenated_gradient(gate, grad_output, ctx.beta, ctx.linear_beta), None
        else:
            grads = ctx.kernels.gradients(gate, up, grad_output, ctx.beta, ctx.linear_beta)
        return *grads, None, None, None


def fused_situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float | None,
                   kernels: SiTUKernels = SHARED_KERNELS) -> torch.Tensor:
    return FusedSiTUGLU.apply(gate_up, None, beta, linear_beta, kernels)


def fused_situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None,
                       kernels: SiTUKernels = SHARED_KERNELS) -> torch.Tensor:
    return FusedSiTUGLU.apply(gate, up, beta, linear_beta, kernels)


def fuses(gate: torch.Tensor, up: torch.Tensor | None, min_elements: int | None) -> bool:
    """Only training forwards (the backward is where most of the time goes) of activations with at least
    ``min_elements`` outputs; ``None``: as many as pay on their device (`fused_min_elements`). ``up=None``: ``gate`` is
    the experts' ``[gate ‖ up]``, two inputs per output."""
    if min_elements is None:
        min_elements = fused_min_elements(gate.device.type)
    outputs = gate.numel() if up is not None else gate.numel() // 2
    return gate.requires_grad and torch.is_grad_enabled() and outputs >= min_elements


def fused_activation_forward(module: nn.Module, min_elements: int | None, kernels: SiTUKernels, gate: torch.Tensor,
                             up: torch.Tensor | None = None) -> torch.Tensor:
    """``KimiK3GLUActivation.forward`` through `FusedSiTUGLU`, or the module's own reference where it does not pay."""
    if not fuses(gate, up, min_elements):
        return type(module).forward(module, gate, up)
    if up is None:
        return fused_situ_glu(gate, module.beta, module.linear_beta, kernels)
    return fused_situ_and_mul(gate, up, module.beta, module.linear_beta, kernels)


def use_fused_situ(model: nn.Module, min_elements: int | None = None,
                   kernels: SiTUKernels = SHARED_KERNELS) -> Attachment:
    """Route every SiTU-GLU activation of ``model`` through `FusedSiTUGLU` with ``kernels`` in training forwards whose
    activation has at least ``min_elements`` outputs (by default `fused_min_elements` of the activation's device);
    ``remove()`` on the returned handle gives the modules back their own reference. Works on the installed classes and
    on ``trust_remote_code`` copies alike.
    """
    attachment = Attachment("fused SiTU-GLU")
    with undone_on_failure(attachment):
        for activation in find_situ_activations(model).values():
            forward = partial(fused_activation_forward, activation, min_elements, kernels)
            attachment.set_attribute(activation, "forward", forward)
    return attachment

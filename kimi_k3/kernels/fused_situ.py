"""Fused SiTU-GLU for training, attached to a Kimi K3 model from outside.

The model computes SiTU-GLU with its eager reference (`modeling_kimi_k3.situ_and_mul`), so a folder loaded with
``trust_remote_code`` alone trains, with the same results up to rounding. Eager SiTU-GLU is a dozen memory-bound
elementwise passes forward and backward; here the forward is one compiled loop over the elements that writes the output
and the two partial derivatives, ∂out/∂gate and ∂out/∂up, and the backward multiplies those by the output's gradient.
The derivatives take the place of the inputs autograd would keep (the same memory), so the tanh, sigmoid and tanh of
every element are evaluated once instead of again in the backward. `use_fused_situ(model)` swaps this in at the model's
activation seam, every ``KimiK3GLUActivation``, the way transformers' kernel hub (``kernelize``) replaces the forward
of a layer that keeps its torch reference as the body. The routed experts hand their activation the concatenated
``[gate ‖ up]``: the kernel runs on its two halves, and the backward writes the gradient straight into that layout.
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
    "FUSED_MIN_ELEMENTS", "SHARED_KERNELS", "SiTUKernels", "use_fused_situ", "fused_situ_glu", "fused_situ_and_mul",
    "CompiledFunction", "isa_safe_compile_caches",
]

# Activations smaller than this are not worth a kernel launch through the compiled wrapper (decoding, tiny models).
FUSED_MIN_ELEMENTS = 2**18


def situ_and_mul_with_derivatives(
    gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`situ_and_mul` and its elementwise partial derivatives (∂out/∂g, ∂out/∂u), all in the inputs' dtype.

    With t = tanh(g/β₁), σ = σ(g) and c = β₂·tanh(u/β₂): ∂/∂g = c·σ·((1 − t²) + β₁·t·(1 − σ)),
    ∂/∂u = β₁·t·σ·(1 − tanh²(u/β₂)) (∂/∂u = β₁·t·σ when the up branch is uncapped).
    """
    dtype = gate.dtype
    gate, up = upcast(gate), upcast(up)
    gate_tanh, gate_sigmoid = torch.tanh(gate / beta), torch.sigmoid(gate)
    if linear_beta is None:
        capped_up, capped_up_slope = up, 1.0
    else:
        up_tanh = torch.tanh(up / linear_beta)
        capped_up, capped_up_slope = linear_beta * up_tanh, 1 - up_tanh * up_tanh
    activated_gate = beta * gate_tanh * gate_sigmoid
    gate_slope = gate_sigmoid * ((1 - gate_tanh * gate_tanh) + beta * gate_tanh * (1 - gate_sigmoid))
    return ((activated_gate * capped_up).to(dtype), (capped_up * gate_slope).to(dtype),
            (activated_gate * capped_up_slope).to(dtype))


def situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU of ``[gate ‖ up]`` concatenated on the last dim, gate first (the experts' fused layout)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return situ_and_mul(gate, up, beta, linear_beta)


@dataclass
class SiTUKernels:
    """The compiled kernel of SiTU-GLU with its derivatives (`situ_and_mul_with_derivatives`), for separate inputs
    and for the halves of the concatenated experts layout alike (inductor specialises it per layout).

    Compiling costs seconds, so every model attached with the default set (`SHARED_KERNELS`) shares one compilation
    cache per process; pass another set to `use_fused_situ` to keep its compilation (or its failure) apart.
    """

    with_derivatives: CompiledFunction = field(
        default_factory=lambda: CompiledFunction(situ_and_mul_with_derivatives))

    def all(self) -> tuple[CompiledFunction, ...]:
        return tuple(getattr(self, kernel.name) for kernel in fields(self))


SHARED_KERNELS = SiTUKernels()


class FusedSiTUGLU(torch.autograd.Function):
    """SiTU-GLU whose forward is one compiled elementwise kernel of ``kernels`` that also writes the partial
    derivatives, and whose backward multiplies them by the output's gradient.

    The kernel is a plain function compiled without autograd, so a compiler failure is caught and falls back to the
    eager function. ``gate`` is either the concatenated ``[gate ‖ up]`` (``up=None``: the gradient is written in that
    layout, with no split/cat) or the gate alone.
    """

    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta, kernels: SiTUKernels):
        ctx.concatenated = up is None
        if ctx.concatenated:
            # Contiguous copies: over the strided halves inductor writes tanh and sigmoid out in loops of their own
            # instead of one loop (fwd+bwd at [65,536, 768], 2 cores: 302 ms on the halves, 264 ms with the copies).
            gate, up = (half.contiguous() for half in gate.chunk(2, dim=-1))
        out, gate_slope, up_slope = kernels.with_derivatives(gate, up, beta, linear_beta)
        ctx.save_for_backward(gate_slope, up_slope)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        gate_slope, up_slope = ctx.saved_tensors
        if not ctx.concatenated:
            return grad_output * gate_slope, grad_output * up_slope, None, None, None
        grad = grad_output.new_empty(*grad_output.shape[:-1], 2 * grad_output.shape[-1])
        grad_gate, grad_up = grad.chunk(2, dim=-1)
        torch.mul(grad_output, gate_slope, out=grad_gate)
        torch.mul(grad_output, up_slope, out=grad_up)
        return grad, None, None, None, None


def fused_situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float | None,
                   kernels: SiTUKernels = SHARED_KERNELS) -> torch.Tensor:
    return FusedSiTUGLU.apply(gate_up, None, beta, linear_beta, kernels)


def fused_situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None,
                       kernels: SiTUKernels = SHARED_KERNELS) -> torch.Tensor:
    return FusedSiTUGLU.apply(gate, up, beta, linear_beta, kernels)


def fuses(activation: torch.Tensor, min_elements: int) -> bool:
    """Only training forwards (the backward is where most of the time goes) of large activations."""
    return activation.requires_grad and torch.is_grad_enabled() and activation.numel() >= min_elements


def fused_activation_forward(module: nn.Module, min_elements: int, kernels: SiTUKernels, gate: torch.Tensor,
                             up: torch.Tensor | None = None) -> torch.Tensor:
    """``KimiK3GLUActivation.forward`` through `FusedSiTUGLU`, or the module's own reference where it does not pay."""
    if not fuses(gate, min_elements):
        return type(module).forward(module, gate, up)
    if up is None:
        return fused_situ_glu(gate, module.beta, module.linear_beta, kernels)
    return fused_situ_and_mul(gate, up, module.beta, module.linear_beta, kernels)


def use_fused_situ(model: nn.Module, min_elements: int = FUSED_MIN_ELEMENTS,
                   kernels: SiTUKernels = SHARED_KERNELS) -> Attachment:
    """Route every SiTU-GLU activation of ``model`` through `FusedSiTUGLU` with ``kernels`` in training forwards whose
    activation has at least ``min_elements`` elements; ``remove()`` on the returned handle gives the modules back
    their own reference. Works on the installed classes and on ``trust_remote_code`` copies alike.
    """
    attachment = Attachment("fused SiTU-GLU")
    with undone_on_failure(attachment):
        for activation in find_situ_activations(model).values():
            forward = partial(fused_activation_forward, activation, min_elements, kernels)
            attachment.set_attribute(activation, "forward", forward)
    return attachment

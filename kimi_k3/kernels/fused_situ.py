"""Fused SiTU-GLU for training, attached to a Kimi K3 model from outside.

The model computes SiTU-GLU with its eager reference (`modeling_kimi_k3.situ_and_mul`), so a folder loaded with
``trust_remote_code`` alone trains, with the same results up to rounding. Eager SiTU-GLU is a dozen memory-bound
elementwise passes forward and backward; here each direction is one compiled loop over the elements. The forward writes
the output and keeps the inputs; the backward is the compiled ``torch.func.vjp`` of the reference, which inductor turns
into one loop that evaluates tanh, sigmoid and tanh again and writes both input gradients. `use_fused_situ(model)` swaps
this in at the model's activation seam, every ``KimiK3GLUActivation``, the way transformers' kernel hub (``kernelize``)
replaces the forward of a layer that keeps its torch reference as the body. The routed experts hand their activation
the concatenated ``[gate ‖ up]``: the kernels read its two halves in place, and the backward writes the gradient in
that layout.
"""

from dataclasses import dataclass, field, fields
from functools import partial

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from kimi_k3.attachments.handle import Attachment, undone_on_failure
from kimi_k3.attachments.seams import find_situ_activations
from kimi_k3.kernels.compiled import CompiledFunction, isa_safe_compile_caches
from modeling_kimi_k3 import situ_and_mul

__all__ = [
    "SHARED_KERNELS", "SiTUKernels", "fused_min_elements", "use_fused_situ", "fused_situ_glu", "fused_situ_and_mul",
    "CompiledFunction", "isa_safe_compile_caches",
]

# The smallest activation (elements of its output) worth the compiled kernels, by where they run. On a CPU the pair
# evaluates the transcendentals twice (forward, then again in the backward), which below these sizes costs more than
# eager's dozen passes over tensors that stay in cache, and compiling it costs seconds per process; the crossover
# follows the vector width (`benchmarks/bench_situ.py`, "by activation size"). Elsewhere a launch is what it saves.
FUSED_MIN_ELEMENTS_AVX512 = 2**20
FUSED_MIN_ELEMENTS_AVX2_OR_NARROWER = 2**21
FUSED_MIN_ELEMENTS_ACCELERATOR = 2**17


def fused_min_elements(device_type: str) -> int:
    """The activation size from which SiTU-GLU runs compiled on ``device_type``, chosen from the CPU's vector
    kernels (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` restricts)."""
    if device_type != "cpu":
        return FUSED_MIN_ELEMENTS_ACCELERATOR
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        return FUSED_MIN_ELEMENTS_AVX512
    return FUSED_MIN_ELEMENTS_AVX2_OR_NARROWER


def situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU of ``[gate ‖ up]`` concatenated on the last dim, gate first (the experts' fused layout)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return situ_and_mul(gate, up, beta, linear_beta)


def situ_and_mul_gradients(gate: torch.Tensor, up: torch.Tensor, grad_output: torch.Tensor, beta: float,
                           linear_beta: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd's gradients of `situ_and_mul` for ``gate`` and ``up``, through ``torch.func.vjp``: compiled, the
    reference's forward and backward are one graph, and inductor makes one loop of it (a hand-written derivative
    formula left tanh and sigmoid in loops of their own)."""
    _, vjp = torch.func.vjp(partial(situ_and_mul, beta=beta, linear_beta=linear_beta), gate, up)
    return vjp(grad_output)


def situ_glu_gradient(gate_up: torch.Tensor, grad_output: torch.Tensor, beta: float,
                      linear_beta: float | None) -> torch.Tensor:
    """The same for `situ_glu`: the gradient of ``[gate ‖ up]``, written in that layout by the same loop."""
    _, vjp = torch.func.vjp(partial(situ_glu, beta=beta, linear_beta=linear_beta), gate_up)
    return vjp(grad_output)[0]


@dataclass
class SiTUKernels:
    """The compiled forward and backward kernels, for separate inputs and for the concatenated experts layout; only
    those a process runs are compiled.

    Compiling costs seconds, so every model attached with the default set (`SHARED_KERNELS`) shares one compilation
    cache per process; pass another set to `use_fused_situ` to keep its compilation (or its failure) apart.
    """

    output: CompiledFunction = field(default_factory=lambda: CompiledFunction(situ_and_mul))
    concatenated_output: CompiledFunction = field(default_factory=lambda: CompiledFunction(situ_glu))
    gradients: CompiledFunction = field(default_factory=lambda: CompiledFunction(situ_and_mul_gradients))
    concatenated_gradient: CompiledFunction = field(default_factory=lambda: CompiledFunction(situ_glu_gradient))

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

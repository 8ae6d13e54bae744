"""Quantization-aware training of the routed experts: train what ships (MXFP4 experts, report §4.1.4).

K3 ships its routed experts as MXFP4 and was trained for it from SFT onward: expert weights in MXFP4, the experts'
activations in MXFP8, everything else (attention, latent projections, shared experts, routers) in high precision.
:func:`attach_qat` reproduces that on a model from outside, with hooks on each fused experts module and its activation:

- each forward sees ``gate_up_proj`` / ``down_proj`` fake-quantized to MXFP4 with the exporter's own scale rule and
  round-to-nearest-even grid, so the trained forward equals the exported model's forward bit for bit;
- the gradient passes straight through (identity) to the fp32 master weights, which the optimizer (Per-Head Muon or
  AdamW) keeps updating; parameters, optimizer groups and ``state_dict`` are untouched, so ``save_pretrained`` and
  Trainer checkpoints hold the master weights and resume as usual;
- optionally the experts' two input activations (the latent tokens entering w1/w3 and the SiTU-GLU output entering
  w2) are fake-quantized to MXFP8 (E4M3 elements, one E8M0 scale per 32 features, OCP MX v1.0 scale rule), again
  with a straight-through gradient. The released format has no activation quantization; this only simulates MXFP8
  serving kernels, so a model trained with it exports losslessly only for weights.

The fake-quantized weights are bound to the module for the duration of its forward (an instance attribute
shadowing the parameter, removed afterwards; the attachment holds both names, so no other feature sets them), which
is why gradient checkpointing's recompute, DDP and FSDP2 (which unshard parameters before the layer's forward) see
them too. ``torch.nn.utils.parametrize`` would do the same but renames the parameters in the state dict
(``parametrizations.gate_up_proj.original``), which breaks the checkpoint names that ``save_pretrained`` and the
released-layout conversion rely on. The SiTU-GLU output is quantized by a hook on the experts' activation module,
whatever kernel computes it.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from checkpoint_format_kimi_k3 import (
    MXFP4_GROUP_SIZE,
    dequantize_mxfp4,
    power_of_two,
    quantize_mxfp4,
    smallest_fitting_exponents,
)
from kimi_k3.attachments.handle import Attachment, undone_on_failure
from kimi_k3.attachments.seams import EXPERT_WEIGHTS, experts_activation, find_routed_experts
from kimi_k3.kernels.compiled import CompiledFunction

__all__ = [
    "ACTIVATION_FORMATS",
    "WEIGHT_FORMATS",
    "ExpertQAT",
    "attach_qat",
    "check_mxfp4_widths",
    "fake_quantize_mxfp4",
    "fake_quantize_mxfp4_eager",
    "fake_quantize_mxfp4_reference",
    "fake_quantize_mxfp8",
    "find_routed_experts",
    "qat_bytes_per_expert_weight",
    "weights_on_mxfp4_grid",
]

WEIGHT_FORMATS = ("mxfp4",)
ACTIVATION_FORMATS = ("none", "mxfp8")
# E4M3 (OCP FP8, "fn": no infinities): largest normal 448 = 1.75 · 2^8, so emax_elem = 8 in the MX scale rule.
_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
_E4M3_EMAX = 8
_E8M0_MIN_EXPONENT, _E8M0_MAX_EXPONENT = -127, 127
# Below this many elements a weight is quantized eagerly: not worth a compilation (tiny test models).
COMPILE_MIN_ELEMENTS = 2**18


# ---------------------------------------------------------------------------------------------------------------------
# Fake quantizers: value -> the value the quantized format stores, same shape and dtype
# ---------------------------------------------------------------------------------------------------------------------
def fake_quantize_mxfp4_reference(weight: torch.Tensor) -> torch.Tensor:
    """What the released checkpoint stores for ``weight``: unpack(pack(weight)), through the exporter's codec."""
    return dequantize_mxfp4(*quantize_mxfp4(weight), dtype=weight.dtype)


def fake_quantize_mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """The MXFP4 value of every weight: :func:`fake_quantize_mxfp4_eager` as one compiled kernel for large weights.

    Eager, the quantizer is about ten memory-bound passes over the weight; inductor fuses them into one loop (much
    faster on CPU at the default model's expert sizes, see benchmarks/bench_qat.py). Small weights and compiler
    failures take the eager version, which gives the same bits.
    """
    if weight.numel() < COMPILE_MIN_ELEMENTS:
        return fake_quantize_mxfp4_eager(weight)
    return COMPILED_MXFP4(weight)


def fake_quantize_mxfp4_eager(weight: torch.Tensor) -> torch.Tensor:
    """Bitwise :func:`fake_quantize_mxfp4_reference`, computed on values instead of codes (no packing, no gather).

    Same scale per group of 32 (the smallest power of two X with max|w| <= 6X) and the same ties-to-even rounding:
    on each binade of the E2M1 grid the value is round(|x| / step) · step, and the even code is the even multiple.
    """
    if weight.shape[-1] % MXFP4_GROUP_SIZE:
        raise ValueError(
            f"MXFP4 groups {MXFP4_GROUP_SIZE} input features; a weight of shape {list(weight.shape)} has "
            f"{weight.shape[-1]}."
        )
    groups = weight.float().unflatten(-1, (-1, MXFP4_GROUP_SIZE))
    scales = power_of_two(smallest_fitting_exponents(groups.abs().amax(-1)) - 127)[..., None]
    scaled = groups / scales
    magnitude = scaled.abs()
    step = torch.full_like(magnitude, 0.5).masked_fill_(magnitude >= 2, 1.0).masked_fill_(magnitude >= 4, 2.0)
    quantized = magnitude.div_(step).round_().mul_(step).copysign_(scaled)
    # The exporter sets the sign bit for negative values only: -0.0 is stored as +0 (tiny negatives as -0).
    quantized.masked_fill_(scaled == 0, 0.0)
    return quantized.mul_(scales).flatten(-2).to(weight.dtype)


COMPILED_MXFP4 = CompiledFunction(fake_quantize_mxfp4_eager, skip_hint="QAT then uses the eager fake-quantizer")


def fake_quantize_mxfp8(activation: torch.Tensor) -> torch.Tensor:
    """MXFP8 (E4M3) round trip along the last dimension, OCP MX v1.0 §6.3 rule.

    Per group of 32: shared exponent floor(log2 max|v|) − 8, clamped to the E8M0 range; elements v / X converted to
    E4M3 with round-to-nearest-even, saturating at ±448 (a group maximum in [448, 512) · X would overflow otherwise).
    """
    if activation.shape[-1] % MXFP4_GROUP_SIZE:
        raise ValueError(
            f"MXFP8 groups {MXFP4_GROUP_SIZE} features; an activation of shape {list(activation.shape)} has "
            f"{activation.shape[-1]}."
        )
    groups = activation.float().unflatten(-1, (-1, MXFP4_GROUP_SIZE))
    _, exponent = torch.frexp(groups.abs().amax(-1, keepdim=True))  # max = m · 2^e, m in [0.5, 1)
    shared = (exponent - 1 - _E4M3_EMAX).clamp(_E8M0_MIN_EXPONENT, _E8M0_MAX_EXPONENT)
    scales = power_of_two(shared)
    elements = (groups / scales).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (elements * scales).flatten(-2).to(activation.dtype)


class _StraightThrough(torch.autograd.Function):
    """y = quantize(x) forward, dy/dx = identity backward (the straight-through estimator)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return quantize(tensor)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None


def straight_through(tensor: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return _StraightThrough.apply(tensor, quantize)


# ---------------------------------------------------------------------------------------------------------------------
# Attaching QAT to a model
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class ExpertQAT:
    """Handle of an attached QAT mode; :meth:`remove` restores the plain forward."""

    weights: str
    activations: str
    experts: dict[str, nn.Module]
    attachment: Attachment

    def remove(self) -> None:
        self.attachment.remove()


def attach_qat(model: nn.Module, weights: str = "mxfp4", activations: str = "none") -> ExpertQAT:
    """Fake-quantize every routed expert of ``model`` in all its forwards (training and evaluation).

    Raises ``ValueError`` before touching the model for an unknown format, a model without routed experts, or
    experts whose input widths (``routed_expert_hidden_size`` for w1/w3, ``moe_intermediate_size`` for w2) are not
    multiples of the MXFP4 group of 32.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"QAT weight format must be one of {list(WEIGHT_FORMATS)}, got {weights!r}.")
    if activations not in ACTIVATION_FORMATS:
        raise ValueError(f"QAT activation format must be one of {list(ACTIVATION_FORMATS)}, got {activations!r}.")
    if any(hasattr(module, "gate_up_basis") for module in model.modules()):
        raise ValueError(
            f"QAT {weights} fake-quantizes each routed expert's own weight tensors; shared-basis experts "
            "(expert_basis_size) build theirs from a basis, which QAT does not support."
        )
    experts = find_routed_experts(model)
    if not experts:
        raise ValueError(
            f"QAT {weights} quantizes routed experts, and this model has none (num_experts="
            f"{getattr(getattr(model, 'config', None), 'num_experts', None)}); every other weight stays in high "
            "precision."
        )
    check_mxfp4_widths(experts, f"QAT {weights}")
    attachment = Attachment(f"QAT {weights}")
    with undone_on_failure(attachment):
        for module in experts.values():
            for weight_name in EXPERT_WEIGHTS:
                attachment.claim_attribute(module, weight_name)
            attachment.add(lambda module=module: _unbind(module))  # a forward that never reached its end
            attachment.add(module.register_forward_pre_hook(_binding_hook(activations == "mxfp8"), with_kwargs=True))
            attachment.add(module.register_forward_hook(_unbinding_hook, always_call=True))
            if activations == "mxfp8":
                attachment.add(experts_activation(module).register_forward_hook(_quantize_output_mxfp8))
    return ExpertQAT(weights, activations, experts, attachment)


@contextmanager
@torch.no_grad()
def weights_on_mxfp4_grid(model: nn.Module) -> Iterator[None]:
    """The routed experts' parameters hold their MXFP4 values inside the block, their fp32 masters again after it.

    Saving inside it writes the model a QAT forward computes: the plain forward of the saved weights equals the
    fake-quantized forward, and re-quantizing them (the released layout) is lossless, as MXFP4 is idempotent.
    """
    masters = []
    for module in find_routed_experts(model).values():
        for weight_name in EXPERT_WEIGHTS:
            parameter = module._parameters[weight_name]
            masters.append((parameter, parameter.detach().clone()))
            parameter.copy_(fake_quantize_mxfp4(parameter))
    try:
        yield
    finally:
        for parameter, master in masters:
            parameter.copy_(master)


def check_mxfp4_widths(experts: dict[str, nn.Module], purpose: str) -> None:
    """Refuse experts whose input widths MXFP4 cannot group (``purpose`` starts the message)."""
    for name, module in experts.items():
        for weight_name in EXPERT_WEIGHTS:
            width = module._parameters[weight_name].shape[-1]
            if width % MXFP4_GROUP_SIZE:
                field = "routed_expert_hidden_size" if weight_name == "gate_up_proj" else "moe_intermediate_size"
                raise ValueError(
                    f"{purpose}: {name}.{weight_name} has {width} input features ({field}); MXFP4 groups need a "
                    f"multiple of {MXFP4_GROUP_SIZE}, so its routed experts cannot be exported in the released layout."
                )


def _binding_hook(quantize_inputs: bool):
    def bind(module: nn.Module, args: tuple, kwargs: dict):
        for weight_name in EXPERT_WEIGHTS:
            # Read the parameter as it is now: FSDP2 has just swapped in the unsharded one.
            module.__dict__[weight_name] = straight_through(module._parameters[weight_name], fake_quantize_mxfp4)
        if not quantize_inputs:
            return None
        if args:
            return (straight_through(args[0], fake_quantize_mxfp8), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": straight_through(kwargs["hidden_states"], fake_quantize_mxfp8)}

    return bind


def _unbinding_hook(module: nn.Module, args: tuple, output) -> None:
    _unbind(module)


def _unbind(module: nn.Module) -> None:
    for weight_name in EXPERT_WEIGHTS:
        module.__dict__.pop(weight_name, None)


def _quantize_output_mxfp8(activation: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The SiTU-GLU output as w2 reads it: fake-quantized to MXFP8."""
    return straight_through(output, fake_quantize_mxfp8)


def qat_bytes_per_expert_weight(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Memory of one fused expert weight under MXFP4 QAT, for planning.

    ``master``: the trained parameter (its optimizer state comes on top, as without QAT). ``fake_quantized``: the
    dequantized copy each forward binds, same shape and dtype as the master; the expert matmul saves it for
    backward, so it lives from the layer's forward to its backward (per micro-batch, or only during the recompute
    under gradient checkpointing). Transient quantizer buffers (a few elements-sized fp32 tensors) come and go within
    the forward. ``exported``: packed E2M1 codes and E8M0 scales, what the released layout stores.
    """
    numel = 1
    for size in shape:
        numel *= size
    return {
        "master": numel * dtype.itemsize,
        "fake_quantized": numel * dtype.itemsize,
        "exported": numel // 2 + numel // MXFP4_GROUP_SIZE,
    }

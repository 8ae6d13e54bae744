"""Fused Block Attention Residuals for training, attached from outside at the model's AttnRes seam.

Each AttnRes site (two per decoder layer, one before the final norm; Attention Residuals, arXiv:2603.15031) mixes the
block snapshots and the running partial sum: a concatenation, an RMSNorm, a pseudo-query dot product, a softmax over
the blocks and a weighted sum. Eagerly that is about fifteen memory passes over ``[batch, tokens, blocks, hidden]``
forward and twice as many backward, and on the default model it was the largest group of elementwise work in the
training step. Here it is the model's own `modeling_kimi_k3.block_attention_residual`, run with stand-ins for its norm
and pseudo-query modules that carry their weights as tensors, compiled for training: AOTAutograd derives the backward
and chooses what to keep from the forward, and inductor fuses each direction into a few loops. (The
compiled ``torch.func.vjp`` of the mix, which recomputes it from the inputs as `kimi_k3.kernels.fused_situ` does for
SiTU-GLU, was slower here: `benchmarks/bench_attention_residual.py`.) The backward is compiled together with
the forward, so a failure to compile either falls back to the reference. `use_fused_attention_residuals(model)` swaps
the kernel in at every module's ``attention_residual`` (the decoder layers and the model's output mix), the way
`kimi_k3.kernels.fused_situ` serves the activation modules.

A site keeps the model's reference, where the norm and the pseudo-query run their own forwards, whenever those modules
are not the plain ones (hooks on them, a PEFT adapter wrapping them), their tensors are not plain tensors (tensor
parallelism's ``DTensor``), or the call is not a training forward of at least ``min_elements`` elements.
"""

from dataclasses import dataclass, field, fields
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from kimi_k3.attachments.handle import Attachment, undone_on_failure
from kimi_k3.attachments.seams import PSEUDO_QUERY, RMS_NORM, find_attention_residual_sites
from kimi_k3.kernels.compiled import CompiledFunction
from modeling_kimi_k3 import KimiK3PseudoQuery, KimiK3RMSNorm, block_attention_residual

__all__ = ["FUSED_MIN_ELEMENTS", "SHARED_KERNELS", "AttentionResidualKernels", "use_fused_attention_residuals",
           "attention_residual", "fused_attention_residual"]

# Partial sums smaller than this are mixed by the reference (a compiled call costs about as much as its eager passes).
FUSED_MIN_ELEMENTS = 2**16
SKIP_HINT = "train with --no_fused_attention_residuals to skip the attempt"


class StandIn(NamedTuple):
    """What the norm's and the pseudo-query's forwards read from ``self``, given as tensors (a form dynamo traces)."""

    weight: torch.Tensor
    variance_epsilon: float | None = None


def attention_residual(block_sum: torch.Tensor, bank: torch.Tensor, norm_weight: torch.Tensor,
                       query_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`block_attention_residual` with its norm's weight and the pseudo-query's ``[1, hidden]`` weight as tensors: the
    model's code, run on stand-ins for the two modules, so that what is compiled is the reference itself."""
    norm = partial(KimiK3RMSNorm.forward, StandIn(norm_weight, eps))
    query = partial(KimiK3PseudoQuery.forward, StandIn(query_weight))
    return block_attention_residual(block_sum, bank, query, norm)


@dataclass
class AttentionResidualKernels:
    """The compiled mix, shared by every site of every model attached with `SHARED_KERNELS`: one compilation per
    process (dynamic shapes cover every number of blocks)."""

    mix: CompiledFunction = field(
        default_factory=lambda: CompiledFunction(attention_residual, SKIP_HINT, differentiable=True))

    def all(self) -> tuple[CompiledFunction, ...]:
        return tuple(getattr(self, kernel.name) for kernel in fields(self))


SHARED_KERNELS = AttentionResidualKernels()


def fused_attention_residual(block_sum: torch.Tensor, bank: torch.Tensor, proj: nn.Module, norm: nn.Module,
                             kernels: AttentionResidualKernels = SHARED_KERNELS) -> torch.Tensor:
    return kernels.mix(block_sum, bank, norm.weight, proj.weight, norm.variance_epsilon)


def plain_module(module: nn.Module, class_name: str) -> bool:
    """The model's own module, running its own forward: no hooks, no adapter around it, no forward swapped in."""
    return (type(module).__name__ == class_name and "forward" not in vars(module)
            and not (module._forward_hooks or module._forward_pre_hooks))


def fuses(block_sum: torch.Tensor, bank: torch.Tensor, proj: nn.Module, norm: nn.Module, min_elements: int) -> bool:
    tensors = (block_sum, bank, norm.weight, proj.weight)
    plain_tensors = all(type(tensor) in (torch.Tensor, nn.Parameter) for tensor in tensors)
    return (torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)
            and block_sum.numel() >= min_elements and plain_tensors
            and plain_module(proj, PSEUDO_QUERY) and plain_module(norm, RMS_NORM))


def fused_site_forward(min_elements: int, kernels: AttentionResidualKernels, block_sum: torch.Tensor,
                       bank: torch.Tensor, proj: nn.Module, norm: nn.Module) -> torch.Tensor:
    """An ``attention_residual`` through the compiled mix of ``kernels``, or the model's reference where it does not
    apply."""
    if not fuses(block_sum, bank, proj, norm, min_elements):
        return block_attention_residual(block_sum, bank, proj, norm)
    return fused_attention_residual(block_sum, bank, proj, norm, kernels)


def use_fused_attention_residuals(model: nn.Module, min_elements: int = FUSED_MIN_ELEMENTS,
                                  kernels: AttentionResidualKernels = SHARED_KERNELS) -> Attachment:
    """Route every Block AttnRes of ``model`` through the compiled mix of ``kernels`` in training forwards whose
    partial sum has at least ``min_elements`` elements; ``remove()`` on the returned handle gives the modules back
    the model's reference. Works on the installed classes and on ``trust_remote_code`` copies alike; a model without
    AttnRes (``attn_res_block_size=None``) has no site and is left as it is.
    """
    attachment = Attachment("fused Block AttnRes")
    with undone_on_failure(attachment):
        for site in find_attention_residual_sites(model).values():
            attachment.set_attribute(site, "attention_residual", partial(fused_site_forward, min_elements, kernels))
    return attachment

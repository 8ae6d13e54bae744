"""Routed experts for training with gathers whose backward is a gather, attached from outside.

transformers' ``grouped_mm`` experts backend (the default for the model's fused expert tensors) sorts the (token,
expert) pairs by expert, takes the token rows with advanced indexing, runs the two grouped GEMMs and restores the
pairs' order with advanced indexing again. The backward of advanced indexing is an accumulating ``index_put_``, which
under torch's deterministic algorithms (``full_determinism``, as `kimi-k3-train` runs) sorts its indices on every
call. Here the rows are taken with ``index_select`` and each token's k outputs are summed back with ``index_add``,
whose backwards are an ``index_add`` and an ``index_select``: the same grouped GEMMs between them, and each token's
outputs still summed in fp32 in one fixed order (its pairs sorted by expert, stably), so runs repeat bit for bit, and
the default training step and a MoE block at K3 sparsity take less time (``benchmarks/step_profile.py``,
``benchmarks/bench_moe.py``; benchmarks/records/2026-12-03_sorted_experts_xeon-amx.md).

`use_sorted_experts(model)` swaps this in at every routed-experts module whose forward is transformers' experts
dispatch itself (not dynamic k's, which regroups the routes first), for forwards on the ``grouped_mm`` implementation
that record gradients; the module's own implementation runs everywhere else (inference, the per-expert ``eager``
reference, expert parallelism, whose sentinel rows the backend handles).
"""

from functools import partial

import torch
from torch import nn
from transformers.integrations.moe import _grouped_linear

from kimi_k3.attachments.handle import Attachment, undone_on_failure
from kimi_k3.attachments.seams import find_routed_experts
from modeling_kimi_k3 import upcast

__all__ = ["REPLACED_IMPLEMENTATION", "sorted_experts", "use_sorted_experts"]

REPLACED_IMPLEMENTATION = "grouped_mm"


def sorted_experts(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' output [tokens, hidden] for ``top_k_index``/``top_k_weights`` [tokens, k]: the
    computation of transformers' ``grouped_mm`` experts, with ``index_select``/``index_add`` gathers."""
    num_tokens, top_k = top_k_index.shape
    expert_of_pair, pair_order = torch.sort(top_k_index.reshape(-1), stable=True)
    token_of_row = pair_order // top_k
    offsets = torch.bincount(expert_of_pair, minlength=experts.num_experts).cumsum(0, dtype=torch.int32)
    rows = hidden_states.index_select(0, token_of_row)
    rows = _grouped_linear(rows, experts.gate_up_proj, offsets, is_transposed=experts.is_transposed)
    rows = _grouped_linear(experts._apply_gate(rows), experts.down_proj, offsets, is_transposed=experts.is_transposed)
    rows = upcast(rows) * top_k_weights.reshape(-1).index_select(0, pair_order).unsqueeze(-1)
    combined = rows.new_zeros(num_tokens, rows.shape[-1]).index_add(0, token_of_row, rows)  # in fp32, as released
    return combined.to(hidden_states.dtype)


def applies(experts: nn.Module) -> bool:
    """Training forwards of the ``grouped_mm`` backend outside expert parallelism (whose sentinel rows it masks)."""
    return (torch.is_grad_enabled() and experts.config._experts_implementation == REPLACED_IMPLEMENTATION
            and not experts._is_expert_parallel)


def sorted_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward through `sorted_experts` where it `applies`, its own implementation elsewhere."""
    if not applies(experts):
        return type(experts).forward(experts, hidden_states, top_k_index, top_k_weights)
    return sorted_experts(experts, hidden_states, top_k_index, top_k_weights)


def dispatches_by_implementation(experts: nn.Module) -> bool:
    """The module's forward is the dispatch of transformers' ``use_experts_implementation`` (which keeps the body it
    wraps as ``__wrapped__``), not a subclass's forward that prepares the routes before dispatching."""
    return hasattr(type(experts).forward, "__wrapped__")


def use_sorted_experts(model: nn.Module) -> Attachment:
    """Route the training forwards of every fused routed-experts module of ``model`` that `dispatches_by_implementation`
    through `sorted_experts`; ``remove()`` on the returned handle gives the modules back their own forward. Works on
    the installed classes and on ``trust_remote_code`` copies alike; shared-basis experts (no fused tensors) and dynamic
    k's experts are left as they are."""
    attachment = Attachment("sorted experts")
    with undone_on_failure(attachment):
        for experts in find_routed_experts(model).values():
            if dispatches_by_implementation(experts):
                attachment.set_attribute(experts, "forward", partial(sorted_experts_forward, experts))
    return attachment

"""The sequence-wise auxiliary balance loss of DeepSeek-V3 (arXiv:2412.19437 §2.1.2, Eq. 17-20), a baseline against
which K3's Quantile Balancing is compared (the ablation suite's ``balancing`` rows).

For each sequence of T tokens and each MoE layer of N_r experts, K_r of them routed per token::

    L_Bal = α Σ_i f_i P_i,   f_i = N_r / (K_r T) · Σ_t 1[expert i is among token t's routes],
                             P_i = 1/T · Σ_t s'_{i,t},   s'_{i,t} = s_{i,t} / Σ_j s_{j,t}

averaged over the batch's sequences and summed over layers. f counts, so the gradient reaches the router through P
only. The routes are those the router took: top-k of s + b. DeepSeek-V3 writes top-k of s, which is the same while the
bias is left at zero (``--router_balancing none``); beside a bias rule the routes follow the bias, as they do there.

As for the other policies, the model records nothing: :class:`AuxiliaryBalanceLoss` hooks every router and the model
from outside, and adds α·Σ L_Bal to the loss the model returns in a training forward with gradients. Padding tokens
(a 2-D ``attention_mask``) are not counted, so T is each sequence's number of real tokens. (Not
``Trainer(compute_loss_func=...)`` over the model's ``router_logits``: that function sees no attention mask, so it
cannot tell padding from masked labels, it takes over the language-model loss, and it exists only under ``Trainer``,
where this policy acts the same in a plain loop.)
"""

import torch
import torch.nn.functional as F
from torch import nn

from kimi_k3.attachments.handle import Attachment, undone_on_failure
from kimi_k3.attachments.padding import shared_padding
from kimi_k3.attachments.seams import routers_by_level
from kimi_k3.policies.callback import PolicyCallback

# DeepSeek-V3's α for its sequence-wise loss (§4.2: "0.0001, just to avoid extreme imbalance within any single
# sequence").
DEEPSEEK_V3_ALPHA = 1e-4


def sequence_balance_loss(
    scores: torch.Tensor, routes: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Σ_i f_i P_i of one MoE layer, averaged over sequences, without α.

    ``scores`` [B, T, n] are the affinities s (sigmoid of the router logits), ``routes`` [B, T, k] the experts each
    token went to, ``token_mask`` [B, T] True for real tokens (None: all). A sequence without real tokens adds 0.
    """
    top_k = routes.shape[-1]
    real = torch.ones(routes.shape[:2], dtype=scores.dtype, device=scores.device)
    if token_mask is not None:
        real = token_mask.to(scores.dtype)
    lengths = real.sum(-1, keepdim=True)  # T of each sequence [B, 1]
    routed = F.one_hot(routes, num_experts).sum(-2).to(scores.dtype)  # 1[i routed] [B, T, n]
    fraction = num_experts / (top_k * lengths.clamp(min=1)) * (routed * real[..., None]).sum(1)
    normalized = scores / scores.sum(-1, keepdim=True)
    probability = (normalized * real[..., None]).sum(1) / lengths.clamp(min=1)
    return (fraction * probability).sum(-1).mean()


def _check_top_k_routers(routers: dict[str, nn.Module]) -> None:
    if not routers:
        raise ValueError("the auxiliary balance loss balances MoE routers, and the model has none (num_experts)")
    for name, router in routers.items():
        variant = [attribute for attribute in ("selection_threshold", "selection_scores") if hasattr(router, attribute)]
        if variant:
            raise ValueError(
                f"the auxiliary balance loss follows DeepSeek-V3's top-k of sigmoid scores; {name} selects by "
                f"{variant[0]} (a routing variant of variants_kimi_k3.py), which it does not define"
            )
        if getattr(router, "score_function", "sigmoid") != "sigmoid":
            raise ValueError(
                f"the auxiliary balance loss needs sigmoid router scores (moe_router_activation_func), {name} uses "
                f"{router.score_function!r}"
            )


class AuxiliaryBalanceLoss:
    """Adds ``alpha`` · Σ_layers `sequence_balance_loss` to the loss of every training forward of ``model``.

    ``attach(optimizer)`` hooks the routers (their logits and routes) and the model (its returned ``loss``); with an
    optimizer, ``latest_metrics`` holds ``balance/aux_loss``: Σ_layers Σ_i f_i P_i without α, averaged over the last
    step's forwards (1 per layer when every expert gets its share). The recompute of activation checkpointing runs
    outside the model's forward and adds nothing.
    """

    def __init__(self, model: nn.Module, alpha: float = DEEPSEEK_V3_ALPHA):
        if not alpha > 0:
            raise ValueError(f"alpha of the auxiliary balance loss must be > 0, got {alpha}")
        _check_top_k_routers(routers_by_level(model)[0])
        if routers_by_level(model)[1]:
            raise ValueError("the auxiliary balance loss does not cover two-level routing's coarse routers")
        self.model, self.alpha = model, float(alpha)
        self.terms: list[torch.Tensor] = []
        self.in_forward = False
        self.step_terms: list[float] = []
        self.latest_metrics: dict[str, float] = {}
        self.attached = False

    def attach(self, optimizer=None, model=None) -> Attachment:
        model = self.model if model is None else model
        if self.attached:
            raise ValueError("this auxiliary balance loss is already attached; remove that attachment first")
        attachment = Attachment("auxiliary balance loss")
        with undone_on_failure(attachment):
            self.attached = True
            attachment.add(self._detached)
            padding = shared_padding(model, attachment)
            for router in routers_by_level(model)[0].values():
                attachment.add(router.register_forward_hook(lambda router, args, outputs: self._record(
                    router, outputs, padding)))
            attachment.add(model.register_forward_pre_hook(self._start))
            attachment.add(model.register_forward_hook(self._add_to_loss))
            if optimizer is not None:
                attachment.run_after_each_step(optimizer, self._end_step)
        return attachment

    def _detached(self) -> None:
        self.attached, self.terms, self.in_forward = False, [], False

    def _start(self, model, args) -> None:
        self.terms, self.in_forward = [], model.training and torch.is_grad_enabled()

    def _record(self, router, outputs, padding) -> None:
        if not (self.in_forward and router.training and torch.is_grad_enabled()):
            return
        logits, _, routes = outputs
        batch_shape = padding.batch_shape
        if batch_shape is None or batch_shape[0] * batch_shape[1] != routes.shape[0]:
            batch_shape = (1, routes.shape[0])  # tokens not from one forward's batch: one sequence
        mask = padding.rows(routes.shape[0])
        self.terms.append(sequence_balance_loss(
            logits.sigmoid().view(*batch_shape, -1), routes.view(*batch_shape, -1), router.num_experts,
            None if mask is None else mask.view(batch_shape),
        ))  # fmt: skip

    def _add_to_loss(self, model, args, outputs):
        terms, self.terms, self.in_forward = self.terms, [], False
        loss = getattr(outputs, "loss", None)
        if not terms or loss is None:
            return None
        balance = torch.stack(terms).sum()
        outputs["loss"] = loss + (self.alpha * balance).to(loss.dtype)
        self.step_terms.append(balance.item())
        return outputs

    def _end_step(self) -> None:
        if self.step_terms:
            self.latest_metrics = {"balance/aux_loss": sum(self.step_terms) / len(self.step_terms)}
        self.step_terms = []


class AuxiliaryBalanceLossCallback(PolicyCallback):
    """The auxiliary balance loss under ``Trainer``: attached for the run, ``balance/aux_loss`` in every training log."""

    def __init__(self, model: nn.Module, alpha: float = DEEPSEEK_V3_ALPHA):
        super().__init__(AuxiliaryBalanceLoss(model, alpha))

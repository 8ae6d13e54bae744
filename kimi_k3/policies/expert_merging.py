"""Periodic merging of similar routed experts, acting on the model from outside (an opt-in Stable LatentMoE idea).

Every ``every_n_steps`` optimizer steps, in each MoE layer (`merge_similar_experts`): the most similar pair of routed
experts (a, b), by the cosine similarity of their weights, is merged if the similarity reaches the threshold. a,
the more loaded of the two, becomes their load-weighted average; b's freed slot is re-initialised as a split of the
layer's most loaded expert c: a copy of c's weights plus small noise, with a copy of c's router row (and of
everything else the router keeps per expert: its bias, a quantile router's score CDF, a routing-modulated attention
gate's column). a keeps its router row and bias, so no token routed elsewhere changes its route. The optimizer state
of both slots is reset. Up to ``max_merges_per_layer`` disjoint pairs per layer and round.

The loads are Quantile Balancing's counts of the step (summed over ranks), and the noise comes from a generator
seeded by the step and the layer, so every rank merges alike and a resumed run merges as the uninterrupted one did;
the merge history is saved with every checkpoint. Shared-basis experts merge and split their coefficient rows (an
average of coefficients is the average of the materialised weights).
"""

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.utils import logging

from kimi_k3.attachments.seams import find_routers
from kimi_k3.policies.callback import ResumableCallback
from kimi_k3.policies.quantile_balancing import QuantileBalancing

logger = logging.get_logger(__name__)

# Standard deviation of the split's noise, relative to that of the copied expert's weights.
SPLIT_NOISE_SCALE = 1e-2


@dataclass(frozen=True)
class Merge:
    step: int
    layer: str
    kept: int
    merged: int  # the freed slot, re-initialised as a split of `split_from`
    similarity: float
    split_from: int


def expert_weights(experts: nn.Module) -> list[nn.Parameter]:
    """The parameters that hold one row per routed expert: the coefficients of shared-basis experts, else the
    fused expert tensors."""
    if hasattr(experts, "gate_up_coefficients"):
        return [experts.gate_up_coefficients, experts.down_coefficients]
    return [experts.gate_up_proj, experts.down_proj]


def expert_similarity(experts: nn.Module) -> torch.Tensor:
    """Cosine similarity [E, E] of the experts' (materialised) weights, gate/up and down together."""
    weights = torch.cat([experts.gate_up_proj.flatten(1), experts.down_proj.flatten(1)], dim=1).double()
    unit = weights / weights.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return unit @ unit.T


def routing_slices(layer: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """(tensor, expert dim) of everything the router side keeps per expert in ``layer``."""
    router = layer.block_sparse_moe.gate
    slices = [(router.weight, 0), (router.e_score_correction_bias, 0)]
    if hasattr(router, "score_quantiles"):
        slices.append((router.score_quantiles, 0))
    routing_weight = getattr(getattr(layer.self_attn, "g_proj", None), "routing_weight", None)
    if routing_weight is not None:
        slices.append((routing_weight, 1))
    return slices


def most_similar_pairs(similarity: torch.Tensor, threshold: float, max_pairs: int) -> list[tuple[int, int, float]]:
    """Up to ``max_pairs`` disjoint pairs (i < j) of similarity >= ``threshold``, most similar first."""
    remaining = similarity.clone().fill_diagonal_(float("-inf"))
    pairs = []
    while len(pairs) < max_pairs:
        best = int(remaining.argmax())
        first, second = divmod(best, remaining.shape[1])
        value = float(remaining[first, second])
        if value < threshold:
            break
        pairs.append((min(first, second), max(first, second), value))
        for expert in (first, second):
            remaining[expert, :] = remaining[:, expert] = float("-inf")
    return pairs


@torch.no_grad()
def merge_similar_experts(layer: nn.Module, loads: torch.Tensor, similarity_threshold: float, max_merges: int,
                          generator: torch.Generator, optimizer: torch.optim.Optimizer | None = None) -> list[dict]:
    """Merge and split experts of one decoder layer in place (see the module docstring); returns what was done."""
    experts = layer.block_sparse_moe.experts
    weights, routing = expert_weights(experts), routing_slices(layer)
    if any(isinstance(tensor, DTensor) for tensor in [*weights, *(tensor for tensor, _ in routing)]):
        raise ValueError("expert merging edits whole expert rows in place; it does not run on FSDP-sharded experts")
    loads = loads.double().clone()
    done = []
    for first, second, similarity in most_similar_pairs(expert_similarity(experts), similarity_threshold, max_merges):
        kept, merged = (first, second) if loads[first] >= loads[second] else (second, first)
        total = loads[kept] + loads[merged]
        share = float(loads[merged] / total) if total > 0 else 0.5
        for weight in weights:
            # kept + share·(merged − kept): two equal experts merge into exactly themselves.
            weight[kept] += share * (weight[merged] - weight[kept])
        loads[kept], loads[merged] = total, -1.0
        source = int(loads.argmax())
        for weight in weights:
            # Drawn by the CPU generator (`_generator`): the same noise wherever the experts live.
            noise = torch.randn(weight[source].shape, generator=generator, dtype=torch.float64).to(weight.device)
            noise *= SPLIT_NOISE_SCALE * weight[source].double().std()
            weight[merged] = weight[source] + noise.to(weight.dtype)
        for tensor, dim in routing:
            tensor.select(dim, merged).copy_(tensor.select(dim, source))
        loads[merged] = loads[source] = loads[source] / 2
        _reset_optimizer_state(optimizer, [(w, 0) for w in weights] + routing, (kept, merged))
        done.append({"kept": kept, "merged": merged, "similarity": similarity, "split_from": source})
    return done


def _reset_optimizer_state(optimizer, slices: list[tuple[torch.Tensor, int]], experts: tuple[int, ...]) -> None:
    """Zero the per-element optimizer state (momenta, second moments) of the given expert slices."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the Trainer's optimizer
    if optimizer is None:
        return
    for tensor, dim in slices:
        for value in optimizer.state.get(tensor, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == tensor.shape:
                for expert in experts:
                    value.select(dim, expert).zero_()


def _generator(seed: int, step: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + layer) % 2**63)


MERGING_ARGUMENTS = ("every_n_steps", "similarity_threshold", "max_merges_per_layer")


def check_merging_arguments(every_n_steps: int, similarity_threshold: float, max_merges_per_layer: int,
                            names: tuple[str, str, str] = MERGING_ARGUMENTS) -> None:
    """One-line refusals of impossible settings, naming each argument as ``names`` spells it."""
    if not (isinstance(every_n_steps, int) and every_n_steps >= 1):
        raise ValueError(f"{names[0]} must be an integer >= 1, got {every_n_steps!r}")
    if not -1.0 <= similarity_threshold <= 1.0:
        raise ValueError(f"{names[1]} is a cosine similarity in [-1, 1], got {similarity_threshold}")
    if not (isinstance(max_merges_per_layer, int) and max_merges_per_layer >= 1):
        raise ValueError(f"{names[2]} must be an integer >= 1, got {max_merges_per_layer!r}")


class ExpertMergingCallback(ResumableCallback):
    """Merges similar routed experts every ``every_n_steps`` optimizer steps (see the module docstring).

    ``balancing`` (attached to the same optimizer) produces the step's loads inside the optimizer step, before this
    callback's ``on_step_end``. ``history`` lists every merge;
    it is saved with each checkpoint and restored on resume, and each merge round's count joins the next training log
    as ``expert_merging/merges``.
    """

    def __init__(self, balancing: QuantileBalancing, every_n_steps: int, similarity_threshold: float,
                 max_merges_per_layer: int = 1, seed: int = 0):
        check_merging_arguments(every_n_steps, similarity_threshold, max_merges_per_layer)
        self.balancing = balancing
        self.every_n_steps = every_n_steps
        self.similarity_threshold = similarity_threshold
        self.max_merges_per_layer = max_merges_per_layer
        self.seed = seed
        self.history: list[Merge] = []
        self.latest_metrics: dict[str, float] = {}

    def merge(self, model: nn.Module, step: int, optimizer=None) -> list[Merge]:
        """One merge round over every MoE layer of ``model`` with Quantile Balancing's latest loads."""
        routers = find_routers(model)
        missing = sorted(set(routers) - set(self.balancing.latest_loads))
        if missing:
            raise ValueError(
                f"expert merging needs Quantile Balancing's loads of this step; none for {missing[:3]}"
            )
        done = []
        for index, (name, layer) in enumerate(_moe_layers(model, routers).items()):
            merges = merge_similar_experts(layer, self.balancing.latest_loads[name], self.similarity_threshold,
                                           self.max_merges_per_layer, _generator(self.seed, step, index), optimizer)
            done += [Merge(step=step, layer=name, **merge) for merge in merges]
        for merge in done:
            logger.info(f"step {step}: merged expert {merge.merged} into {merge.kept} of {merge.layer} (cosine "
                        f"{merge.similarity:.4f}); slot {merge.merged} re-initialised as a split of {merge.split_from}")
        self.history += done
        return done

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            merges = self.merge(model, state.global_step, optimizer)
            self.latest_metrics = {"expert_merging/merges": float(len(merges))}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs and self.latest_metrics:
            logs.update(self.latest_metrics)
            state.log_history[-1].update(self.latest_metrics)
            self.latest_metrics = {}

    def attributes(self) -> dict:
        return {"history": [asdict(merge) for merge in self.history]}

    def restore(self, attributes: dict, step: int) -> None:
        self.history = [Merge(**merge) for merge in attributes.get("history", []) if merge["step"] <= step]


def _moe_layers(model: nn.Module, routers: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The decoder layer of each router, keyed like the routers."""
    by_router = {id(router): name for name, router in routers.items()}
    return {by_router[id(layer.block_sparse_moe.gate)]: layer for layer in model.modules()
            if hasattr(layer, "block_sparse_moe") and id(layer.block_sparse_moe.gate) in by_router}

"""Where training code meets a Kimi K3 model: every module a policy, quantizer or kernel acts on, found in one place.

The model declares three seams (``modeling_kimi_k3.py``): every SiTU-GLU runs through a ``KimiK3GLUActivation``
module, the routed experts' too (their ``_apply_gate``, transformers' experts protocol, hands the activation module
the concatenated ``[gate ‖ up]``), so a kernel attaches to one kind of module; every Block AttnRes mix goes through
its module's ``attention_residual`` (decoder layers, and the model for the output mix); and each MLA layer passes its
queries and keys to its ``query_key_observer``. Routers and routed experts are found by the tensors their policies
read and write. Every rule matches the installed classes and ``trust_remote_code`` copies of them alike, inside
any wrapper (DDP, PEFT, accelerate).
"""

import re

import torch
from torch import nn

SITU_ACTIVATION = "KimiK3GLUActivation"
PSEUDO_QUERY = "KimiK3PseudoQuery"
RMS_NORM = "KimiK3RMSNorm"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
NESTED_ROUTER = "coarse_gate"


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module holding ``embed_tokens`` and ``layers`` (``KimiK3Model``) inside ``model`` and any wrapper of it."""
    for module in model.modules():
        if hasattr(module, "embed_tokens") and isinstance(getattr(module, "layers", None), nn.ModuleList):
            return module
    raise ValueError(f"{type(model).__name__} holds no decoder stack (a module with `embed_tokens` and `layers`).")


def layer_key(name: str) -> str:
    """``layer_{i}`` for a module inside decoder layer i, else the module's own name."""
    layer = re.search(r"layers\.(\d+)\.", name)
    return f"layer_{layer.group(1)}" if layer else name


def find_routers(model: nn.Module) -> dict[str, nn.Module]:
    """MoE routers keyed ``layer_{i}``, found by the bias Quantile Balancing writes and their ``top_k``.

    Under a PEFT ``modules_to_save`` wrapper the trained copy, which comes after the original, is the one kept.
    """
    return routers_by_level(model)[0]


def routers_by_level(model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """(`find_routers`, the routers nested in them): a router's ``coarse_gate`` (two-level routing's coarse level,
    ``variants_kimi_k3.py``) is a router too, keyed by its outer router's key, e.g. ``layer_1.coarse_gate``."""
    routers = [(name, module) for name, module in model.named_modules() if _is_router(module)]
    nested = {
        id(getattr(module, NESTED_ROUTER)) for _, module in routers if _is_router(getattr(module, NESTED_ROUTER, None))
    }
    outer = {layer_key(name): module for name, module in routers if id(module) not in nested}
    inner = {
        f"{key}.{NESTED_ROUTER}": getattr(module, NESTED_ROUTER)
        for key, module in outer.items()
        if _is_router(getattr(module, NESTED_ROUTER, None))
    }
    return outer, inner


def _is_router(module) -> bool:
    return hasattr(module, "e_score_correction_bias") and hasattr(module, "top_k")


def find_mla_layers(model: nn.Module) -> dict[str, nn.Module]:
    """MLA attention layers keyed ``layer_{i}``: the modules with a ``query_key_observer`` seam."""
    return {layer_key(name): module for name, module in model.named_modules() if hasattr(module, "query_key_observer")}


def find_routed_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Fused routed-experts modules by name: 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    return {
        name: module
        for name, module in model.named_modules()
        if all(isinstance(getattr(module, "_parameters", {}).get(weight), torch.Tensor) for weight in EXPERT_WEIGHTS)
        and module._parameters["gate_up_proj"].ndim == 3
    }


def find_expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every routed-experts module by name, however it holds its weights (fused 3-D parameters, or the shared basis of
    ``variants_kimi_k3.py`` they are materialised from): the ``experts`` beside a router. For code that watches what
    the experts compute; code that rewrites their weights wants `find_routed_experts`."""
    return {
        f"{name}.experts" if name else "experts": module.experts
        for name, module in model.named_modules()
        if _is_router(getattr(module, "gate", None)) and isinstance(getattr(module, "experts", None), nn.Module)
    }


def find_situ_activations(model: nn.Module) -> dict[str, nn.Module]:
    """Every SiTU-GLU activation module by name (dense MLP, shared and routed experts); none when ``hidden_act`` names
    another activation."""
    return {
        name: module
        for name, module in model.named_modules()
        if type(module).__name__ == SITU_ACTIVATION and getattr(module, "act_fn", None) is None
    }


def find_attention_residual_sites(model: nn.Module) -> dict[str, nn.Module]:
    """Every module that mixes Block AttnRes through its ``attention_residual`` (the decoder layers, and the model
    for its output mix), by name: those holding a pseudo-query; none when ``attn_res_block_size`` is None."""
    return {
        name: module
        for name, module in model.named_modules()
        if callable(getattr(module, "attention_residual", None))
        and any(type(child).__name__ == PSEUDO_QUERY for child in module.children())
    }


def experts_activation(experts: nn.Module) -> nn.Module:
    """The activation module a routed-experts module applies between its two projections (its ``glu``)."""
    return experts.glu

"""What a Kimi K3 training run updates, read from the model itself: built on the meta device (the released 2.78T model
in under a second, no memory for its weights), grouped by the optimizer's own :func:`kimi_k3.optim.muon.build_param_groups`,
and with the parameters a backward reaches found by one backward of a narrow copy of the config.

The parallelism plan (:mod:`kimi_k3.planning.plan`) counts and shards these specs; nothing here re-describes how the
model classes size their tensors.
"""

import copy
import functools
import json
import math
from dataclasses import dataclass

import torch

from checkpoint_format_kimi_k3 import EXPERT_LAYOUT
from configuration_kimi_k3 import KimiK3Config
from kimi_k3.optim.muon import build_param_groups, row_pattern
from variants_kimi_k3 import causal_lm_class

# Attention projections LoRA adapts by default (peft ``target_modules`` names, matched on the module's last name).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its FSDP2 unit ("root" or "layers.<i>"), whether it is a stacked-expert tensor (split by
    expert parallelism), which half of Per-Head Muon updates it, and whether backward ever gives it a gradient.
    ``block_pattern`` is ``kimi_k3.optim.muon.row_pattern`` of its Muon group (None: whole matrices)."""

    name: str
    shape: tuple[int, ...]
    unit: str
    optimizer: str
    expert: bool = False
    trainable: bool = True
    receives_grad: bool = True
    block_pattern: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def build_model(config, device: str, lora_rank: int = 0):
    """``KimiK3ForCausalLM`` in training mode; with ``lora_rank``, peft's adapters on the attention projections. The
    model gets its own copy of ``config``: load-time sharding records the distributed setup in the model's config."""
    with torch.device(device):
        model = causal_lm_class(config)(copy.deepcopy(config)).train()
    if lora_rank:
        from peft import LoraConfig, inject_adapter_in_model

        model = inject_adapter_in_model(LoraConfig(r=lora_rank, target_modules=list(DEFAULT_LORA_TARGETS)), model)
    return model


def is_stacked_expert(name: str) -> bool:
    """The fused ``[E, ...]`` expert tensors, which expert parallelism splits along E."""
    module, weight = name.rsplit(".", 2)[-2:]
    return module == "experts" and weight in EXPERT_LAYOUT


def fsdp_unit(name: str) -> str:
    """The FSDP2 unit of a parameter: its decoder layer, or the root (embeddings, final norms, ``lm_head``)."""
    parts = name.split(".")
    return f"layers.{parts[2]}" if parts[:2] == ["model", "layers"] else "root"


@dataclass(frozen=True)
class Inventory:
    """The parameters of a model (in model order), the updated Muon ones in ``PerHeadMuon``'s step order (its groups',
    in order), and the elements and bytes of its buffers, which every rank keeps whole (the routers' fp32 bias)."""

    specs: tuple[ParamSpec, ...]
    muon_step_order: tuple[ParamSpec, ...]
    buffer_elements: int
    buffer_bytes: int


def model_inventory(config, lora_rank: int = 0) -> Inventory:
    """The :class:`Inventory` of ``KimiK3ForCausalLM(config)``; with ``lora_rank`` > 0 the base is frozen and peft's
    adapters (AdamW) are the trainable parameters. Cached per config: a search plans many layouts of one model."""
    return _inventory(config.to_json_string(), lora_rank)


@functools.lru_cache(maxsize=8)
def _inventory(config_json: str, lora_rank: int) -> Inventory:
    config = KimiK3Config.from_dict(json.loads(config_json))
    model = build_model(config, "meta", lora_rank)
    reached = parameters_reached_by_backward(config, lora_rank)
    muon_groups = [] if lora_rank else [group for group in build_param_groups(model) if group["use_muon"]]
    patterns = {name: row_pattern(group) for group in muon_groups for name in group["param_names"]}
    specs = {name: ParamSpec(name, tuple(p.shape), fsdp_unit(name), "muon" if name in patterns else "adamw",
                             is_stacked_expert(name), trainable=p.requires_grad, receives_grad=name in reached,
                             block_pattern=patterns.get(name))
             for name, p in model.named_parameters()}
    step_order = tuple(specs[name] for group in muon_groups for name in group["param_names"] if name in reached)
    buffers = list(model.buffers())
    return Inventory(tuple(specs.values()), step_order, sum(b.numel() for b in buffers),
                     sum(b.numel() * b.element_size() for b in buffers))


def parameters_reached_by_backward(config, lora_rank: int = 0) -> set[str]:
    """Names of the trainable parameters one training backward gives a gradient, from a narrow copy of ``config``
    (same layers, layer types and options; tiny widths) run for real on the CPU. (Layer 0's self-attention AttnRes
    projection and norm, for one, never get one: they weigh earlier blocks, and layer 0 has none.)"""
    narrow = narrow_config(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: several threads only contend, worst on a busy machine
    try:
        torch.manual_seed(0)
        model = build_model(narrow, "cpu", lora_rank)
        for p in model.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
        input_ids = torch.randint(narrow.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    finally:
        torch.set_num_threads(threads)
    return {name for name, p in model.named_parameters() if p.grad is not None}


def narrow_config(config):
    """``config`` with every width shrunk; the layer pattern, which projections exist and the switches are kept."""
    values = config.to_dict()
    values.update(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                  qk_nope_head_dim=8, qk_rope_head_dim=4 if config.qk_rope_head_dim else 0, v_head_dim=8,
                  kv_lora_rank=16, q_lora_rank=None if config.q_lora_rank is None else 16,
                  linear_num_heads=2, linear_head_dim=8, dtype="float32")
    values.pop("linear_attn_config")  # the release's nesting of the KDA fields narrowed above and `layer_types`
    if config.num_experts is not None:
        top_k = min(config.num_experts_per_token, 2)
        values.update(num_experts=top_k + 2, num_experts_per_token=top_k, moe_intermediate_size=8,
                      routed_expert_hidden_size=None if config.routed_expert_hidden_size is None else 16)
        values.update(_narrow_variant_fields(config, values["num_experts"], top_k))
    for key in ("mlp_layer_types", "auto_map", "architectures", "model_type", "transformers_version"):
        values.pop(key, None)
    return type(config)(**values)


def _narrow_variant_fields(config, num_experts: int, top_k: int) -> dict:
    """The variant sizes that still fit ``num_experts`` narrowed experts (two-level routing: two groups of k + 1)."""
    values = {}
    if config.expert_basis_size is not None:
        values["expert_basis_size"] = min(config.expert_basis_size, num_experts)
    if config.num_coarse_experts is not None:
        values.update(num_experts=2 * (top_k + 1), num_coarse_experts=2, coarse_experts_per_token=1)
    if config.dynamic_experts_per_token:
        values.update(min_experts_per_token=1, max_experts_per_token=num_experts)
    return values

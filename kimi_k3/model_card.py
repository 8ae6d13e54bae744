"""Our own model card (``README.md``) for a trained Kimi K3 folder.

``model.push_to_hub`` would replace README.md with the hub's card or the generic "Model Card for Model ID" template
(hf-integration.md §1.5), so the card is rendered here from the package's ``templates/model_card.md`` and uploaded
with the folder.
"""

import os
from dataclasses import asdict, dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

import torch
from huggingface_hub import ModelCard, ModelCardData

from configuration_kimi_k3 import KimiK3Config
from modeling_kimi_k3 import KimiK3ForCausalLM

# Package data, so the template ships in the wheel and is found in any install, not only in a source checkout.
TEMPLATE_PATH = files("kimi_k3") / "templates" / "model_card.md"
TAGS = ["custom_code", "kimi_k3", "moe", "text-generation"]
# Columns of the per-layer load-balance table: metric key of balance_metrics.load_balance_metrics -> header.
BALANCE_COLUMNS = {
    "max_vio": "MaxVio",
    "cv": "CV",
    "min_over_mean": "min / mean",
    "dead_experts": "dead experts",
    "bias_range": "bias range",
}


@dataclass
class TrainingSummary:
    """What a run did and reached; every field is printed in the card."""

    data: str
    train_tokens: int
    eval_tokens: int
    block_size: int
    steps: int
    global_batch_size: int
    optimizer: str
    learning_rate: float
    router_balancing: str
    first_loss: float
    last_loss: float
    eval_loss: float
    eval_perplexity: float
    wall_time_s: float
    base_model: str | None = None


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Total and per-token active parameters (buffers such as the router bias are not parameters).

    Active = every parameter except the input embedding table (a row lookup, not a matmul) and the routed experts
    a token does not visit: of each MoE layer's E experts, k are used, so (E - k)/E of its expert weights are idle.
    """
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    idle = 0
    if config.num_experts:
        idle = routed * (config.num_experts - config.num_experts_per_token) // config.num_experts
    return {"total": total, "embedding": embedding, "routed_experts": routed, "active": total - embedding - idle}


def architecture_summary(config) -> dict[str, object]:
    """The config fields a reader needs to picture the model, in the released field names."""
    linear = config.linear_attn_config
    return {
        "layers": config.num_hidden_layers,
        "layer pattern": " ".join("MLA" if kind == "full_attention" else "KDA" for kind in config.layer_types),
        "MLP pattern": " ".join("MoE" if kind == "sparse" else "dense" for kind in config.mlp_layer_types),
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "KDA heads x head_dim": f"{linear['num_heads']} x {linear['head_dim']}",
        "MLA heads (nope + rope / v dims)": f"{config.num_attention_heads} "
        f"({config.qk_nope_head_dim} + {config.qk_rope_head_dim} / {config.v_head_dim})",
        "routed experts (top-k)": f"{config.num_experts} ({config.num_experts_per_token})",
        "shared experts": config.num_shared_experts,
        "expert latent size / intermediate": f"{config.routed_expert_hidden_size} / {config.moe_intermediate_size}",
        "AttnRes block size": config.attn_res_block_size,
    }


def render_model_card(
    model: torch.nn.Module,
    name: str,
    summary: TrainingSummary | None = None,
    layer_balance: dict[str, dict[str, float]] | None = None,
    template_path: str | os.PathLike | Traversable = TEMPLATE_PATH,
) -> ModelCard:
    """The card of ``model`` published as ``name``; training sections are omitted when ``summary`` is None.

    The template is read here rather than by ``ModelCard.from_template`` because package data need not be a file on
    disk (e.g. a zipped install).
    """
    if isinstance(template_path, (str, os.PathLike)):
        template_path = Path(template_path)
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=TAGS,
        base_model=summary.base_model if summary else None,
        model_name=name,
    )
    balance_rows = [
        {"layer": layer, **{key: metrics[key] for key in BALANCE_COLUMNS}}
        for layer, metrics in (layer_balance or {}).items()
        if metrics
    ]
    return ModelCard.from_template(
        card_data,
        template_str=template_path.read_text(encoding="utf-8"),
        name=name,
        config=model.config,
        architecture=architecture_summary(model.config),
        params=parameter_counts(model),
        summary=asdict(summary) if summary else None,
        balance_columns=BALANCE_COLUMNS,
        balance_rows=balance_rows,
    )


def card_for_folder(folder: Path, name: str) -> ModelCard:
    """Card of a saved folder without training records (e.g. ``checkpoint-N``): architecture and parameters only."""
    with torch.device("meta"):  # parameter counts need shapes, not weights
        model = KimiK3ForCausalLM(KimiK3Config.from_pretrained(folder))
    return render_model_card(model, name)


def is_our_card(path: Path) -> bool:
    """Whether ``path`` is a README.md rendered by :func:`render_model_card` (not a generic template card)."""
    if not path.is_file():
        return False
    return "kimi_k3" in (ModelCard.load(path).data.tags or [])

"""The rows of the ablation matrix: each changes one thing against the baseline, the default job (K3's choices), and
the presets that pick rows, seeds and model size.

A row is job flags, config overrides, or both; overrides that depend on the model (the number of experts of a
finer-grained layer, say) are computed from the baseline config. `check_applies` refuses a row that cannot apply to
the chosen config, or that would change nothing there, before any run starts.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from huggingface_hub.errors import StrictDataclassError

from configuration_kimi_k3 import TINY, KimiK3Config

BASELINE = "baseline"


@dataclass(frozen=True)
class Row:
    """One change against the baseline: ``flags`` for the job, ``overrides`` (or ``derive(baseline config)``) for the
    model config. ``needs`` names what the baseline config must have (`NEEDS`)."""

    name: str
    family: str
    change: str
    flags: tuple[str, ...] = ()
    overrides: dict = field(default_factory=dict)
    derive: Callable[[KimiK3Config], dict] | None = None
    needs: tuple[str, ...] = ()

    def config_overrides(self, baseline: KimiK3Config) -> dict:
        return {**self.overrides, **(self.derive(baseline) if self.derive else {})}


def _has_mla(config: KimiK3Config) -> bool:
    return bool(config.mla_layer_indices)


def _has_moe(config: KimiK3Config) -> bool:
    return bool(config.num_experts) and "sparse" in config.mlp_layer_types


def _has_moe_mla_layer(config: KimiK3Config) -> bool:
    return any(config.mlp_layer_types[i] == "sparse" for i in config.mla_layer_indices)


# What a row may need of the baseline config: (test, what is missing, in the words of the config fields).
NEEDS = {
    "mla": (_has_mla, "no MLA (full_attention) layer"),
    "moe": (_has_moe, "no MoE layer (num_experts)"),
    "moe_mla": (_has_moe_mla_layer, "no MLA layer that is also an MoE layer"),
    "latent": (lambda c: c.routed_expert_hidden_size not in (None, c.hidden_size),
               "no latent projection (routed_expert_hidden_size is the hidden size)"),
    "attn_res": (lambda c: c.attn_res_block_size is not None, "no Block Attention Residuals (attn_res_block_size)"),
    "situ": (lambda c: c.hidden_act == "situ", "a hidden_act other than situ"),
    "top_k_routing": (lambda c: not (c.dynamic_experts_per_token or c.num_coarse_experts
                                     or c.router_score_normalization != "none"),
                      "a routing variant in place of the top-k selection"),
}


def _finer_experts(config: KimiK3Config) -> dict:
    """4x as many experts, 4x as many active, each 4x narrower: the same total and active parameters (the shared
    experts keep their width, which is moe_intermediate_size x num_shared_experts)."""
    if config.moe_intermediate_size % 4:
        raise ValueError(f"moe_intermediate_size {config.moe_intermediate_size} is not divisible by 4")
    return {
        "num_experts": 4 * config.num_experts,
        "num_experts_per_token": 4 * config.num_experts_per_token,
        "moe_intermediate_size": config.moe_intermediate_size // 4,
        "num_shared_experts": 4 * config.num_shared_experts,
    }


def _two_level(config: KimiK3Config) -> dict:
    groups = max(2, config.num_experts // 8)
    return {"num_coarse_experts": groups, "coarse_experts_per_token": max(1, groups // 4)}


ROWS = {row.name: row for row in (
    Row(BASELINE, "baseline", "K3's defaults: Quantile Balancing, Per-Head Muon, SiTU-GLU, latent RMSNorm, ℓ = d/2, "
        "Block AttnRes, MLA output gate, QK-Clip τ = 100"),
    Row("sign-balancing", "balancing", "DeepSeek-V3 sign update of the bias, γ = 1e-3",
        flags=("--router_balancing", "sign", "--sign_balancing_gamma", "1e-3"), needs=("moe", "top_k_routing")),
    Row("aux-loss", "balancing", "DeepSeek-V3 sequence-wise auxiliary loss, α = 1e-4, bias fixed at 0",
        flags=("--router_balancing", "none", "--aux_loss_alpha", "1e-4"), needs=("moe", "top_k_routing")),
    Row("no-balancing", "balancing", "no balancing: the bias stays 0",
        flags=("--router_balancing", "none"), needs=("moe",)),
    Row("whole-matrix-muon", "optimizer", "Muon with each attention Q, K, V orthogonalised whole",
        flags=("--optimizer", "whole_matrix_muon")),
    Row("adamw", "optimizer", "AdamW for every parameter", flags=("--optimizer", "adamw")),
    Row("swiglu", "activation", "SwiGLU (SiLU gate, no caps) in place of SiTU-GLU",
        overrides={"hidden_act": "silu"}, needs=("situ",)),
    Row("no-latent-norm", "latentmoe", "no RMSNorm on the experts' latent output",
        overrides={"latent_moe_use_norm": False}, needs=("moe",)),
    Row("latent-width-d", "latentmoe", "latent width ℓ = d: no down/up projection",
        overrides={"routed_expert_hidden_size": None}, needs=("moe", "latent")),
    Row("plain-residual", "residual", "plain pre-norm residual stream in place of Block AttnRes",
        overrides={"attn_res_block_size": None}, needs=("attn_res",)),
    Row("no-output-gate", "attention", "MLA without its sigmoid output gate",
        overrides={"mla_use_output_gate": False}, needs=("mla",)),
    Row("no-qk-clip", "attention", "QK-Clip off", flags=("--qk_clip_tau", "none"), needs=("mla",)),
    Row("finer-experts", "sparsity", "4x the experts, 4x top-k, each 4x narrower (equal total and active "
        "parameters)", derive=_finer_experts, needs=("moe", "top_k_routing")),
    Row("shared-basis-experts", "variants", "experts built from num_experts / 4 shared basis matrices",
        derive=lambda c: {"expert_basis_size": max(1, c.num_experts // 4)}, needs=("moe",)),
    Row("quantile-routing", "variants", "top-k over each expert's score quantile (64 bins)",
        overrides={"router_score_normalization": "quantile"}, needs=("moe", "top_k_routing")),
    Row("routed-attention-gates", "variants", "MLA output gate modulated by the layer's routing weights",
        overrides={"attention_gate_routing": True}, needs=("moe_mla",)),
    Row("two-level-routing", "variants", "routing over num_experts / 8 coarse groups first",
        derive=_two_level, needs=("moe", "top_k_routing")),
    Row("dynamic-k", "variants", "every expert with s + b > 0, k in [1, 2k]",
        overrides={"dynamic_experts_per_token": True}, needs=("moe", "top_k_routing")),
    Row("expert-merging", "variants", "every 25 steps, merge each layer's most similar expert pair (any cosine)",
        flags=("--expert_merging_every_n_steps", "25", "--expert_merging_threshold", "0.0"), needs=("moe",)),
)}  # fmt: skip
FAMILIES = tuple(dict.fromkeys(row.family for row in ROWS.values()))

# The quick matrix's model: `KimiK3Config.tiny()` (9 layers, 8 experts top-2), its vocabulary sized by the tokenizer.
QUICK_MODEL = {key: value for key, value in TINY.items() if key != "vocab_size"}


@dataclass(frozen=True)
class Preset:
    """A matrix: rows, seeds, steps, the baseline model (config overrides of the default ``KimiK3Config()``) and the
    job options every run shares."""

    rows: tuple[str, ...]
    seeds: tuple[int, ...]
    max_steps: int
    model: dict
    flags: tuple[str, ...]
    block_size: int
    tokenizer_vocab_size: int
    max_eval_samples: int | None


PRESETS = {
    # The balancing, optimizer and activation rows at 2 seeds in about 5 minutes on 2 idle CPU cores (eager SiTU, which
    # the job also picks by itself on a CPU for activations this small).
    "quick": Preset(
        rows=(BASELINE, "sign-balancing", "aux-loss", "no-balancing", "whole-matrix-muon", "adamw", "swiglu"),
        seeds=(0, 1), max_steps=40, model=QUICK_MODEL, block_size=64, tokenizer_vocab_size=1024,
        max_eval_samples=128, flags=("--no_fused_situ", "--logging_steps", "2", "--eval_steps", "40",
                                     "--save_steps", "20"),
    ),
    # The default job (the default model, 150 steps), every row, 3 seeds.
    "full": Preset(
        rows=tuple(ROWS), seeds=(0, 1, 2), max_steps=150, model={}, block_size=128, tokenizer_vocab_size=4096,
        max_eval_samples=None, flags=("--logging_steps", "5"),
    ),
}


class AblationError(ValueError):
    """Input the matrix cannot run: said in one line before any run starts."""


def select_rows(names: list[str] | None, preset: Preset) -> list[Row]:
    """The named rows (default: the preset's), the baseline always first."""
    names = list(preset.rows if names is None else names)
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        raise AblationError(f"--rows: unknown row {unknown[0]!r}; rows are {', '.join(ROWS)}")
    return [ROWS[BASELINE]] + [ROWS[name] for name in dict.fromkeys(names) if name != BASELINE]


def baseline_config(model_overrides: dict) -> KimiK3Config:
    try:
        return KimiK3Config(**model_overrides)
    except StrictDataclassError as error:  # the config's own checks: the error's cause is one line naming the field
        raise AblationError(f"--config_overrides: {error.__cause__ or error}") from None


def check_applies(row: Row, model_overrides: dict) -> dict:
    """The row's config overrides on the baseline model (``model_overrides`` of ``KimiK3Config()``), or an
    `AblationError` saying why the row cannot apply there."""
    baseline = baseline_config(model_overrides)
    for need in row.needs:
        present, missing = NEEDS[need]
        if not present(baseline):
            raise AblationError(f"row {row.name!r} cannot apply: the baseline config has {missing}")
    try:
        overrides = row.config_overrides(baseline)
        changed = KimiK3Config(**{**model_overrides, **overrides})
    except StrictDataclassError as error:
        raise AblationError(f"row {row.name!r} cannot apply to the baseline config: {error.__cause__ or error}") from None
    except (TypeError, ValueError) as error:  # a row's own derivation (`_finer_experts`)
        raise AblationError(f"row {row.name!r} cannot apply to the baseline config: {error}") from None
    if row.name != BASELINE and not row.flags and changed.to_dict() == baseline.to_dict():
        raise AblationError(f"row {row.name!r} changes nothing: the baseline config already has {json.dumps(overrides)}")
    return overrides

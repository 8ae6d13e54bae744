"""Configuration of the Kimi K3 text model (hybrid KDA/MLA, Block Attention Residuals, Stable LatentMoE).

Field names and meanings are those of the released checkpoint's ``text_config`` (``moonshotai/Kimi-K3``), except
the KDA settings the release nests in ``linear_attn_config``: as transformers' ``kimi_linear`` does, they are read once
into flat ``linear_*`` fields and ``layer_types``, and written back, so a released ``config.json`` loads and saves
unchanged. The multimodal wrapper of the release is flattened to its text part. Types are checked by ``@strict``
(``huggingface_hub.dataclasses``), the rules between fields by the ``validate_*`` methods.
Defaults describe a small model that trains on a CPU in minutes while keeping every K3 invariant;
``KimiK3Config.kimi_k3()`` gives the released 2.78T configuration.
"""

import copy
import importlib.metadata
import types
from typing import Literal

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError, StrictDataclassFieldValidationError
from packaging.specifiers import SpecifierSet
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec
from transformers.generation import GenerationConfig
from transformers.utils import logging

try:
    from .configuration_kimi_k3_vision import KimiK3VisionConfig
except ImportError:
    from configuration_kimi_k3_vision import KimiK3VisionConfig

logger = logging.get_logger(__name__)

# The transformers releases these files are tested under (the lowest and the newest are both run by the test suite).
SUPPORTED_TRANSFORMERS = ">=5.23,<5.26"


def installed_transformers() -> str:
    return importlib.metadata.version("transformers")


def transformers_is_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed transformers) lies in ``SUPPORTED_TRANSFORMERS``."""
    return SpecifierSet(SUPPORTED_TRANSFORMERS).contains(version or installed_transformers(), prereleases=True)


# transformers imports a remote-code folder's copy of this file under a module name of its own, and more than once
# per folder; one logger name for every copy lets `warning_once` print the range warning once per process.
if not transformers_is_supported():
    logging.get_logger("configuration_kimi_k3").warning_once(
        f"Kimi K3 model code is tested with transformers {SUPPORTED_TRANSFORMERS}, but {installed_transformers()} is "
        "installed; it may fail or compute differently. Install a supported version, e.g. "
        f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'."
    )

# The release nests the KDA settings in `linear_attn_config` (beside its 1-based `kda_layers`/`full_attn_layers`); the
# config reads them once into these flat fields (kimi_linear's names where it has them) and writes them back.
RELEASED_LINEAR_ATTN_KEYS = {
    "num_heads": "linear_num_heads",
    "head_dim": "linear_head_dim",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
    "gate_lower_bound": "linear_gate_lower_bound",
    "use_full_rank_gate": "linear_use_full_rank_gate",
}
# The toy model of the tests, benchmarks and ablation suite (`KimiK3Config.tiny()`): 9 layers with every invariant of
# the released configuration (KDA at 1-3 and 5-7, MLA at 4, 8 and 9) at toy widths; a forward takes milliseconds.
TINY = {
    "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 9, "max_position_embeddings": 512,
    "num_attention_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
    "v_head_dim": 8, "linear_num_heads": 2, "linear_head_dim": 8, "intermediate_size": 48, "num_experts": 8,
    "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 16, "routed_expert_hidden_size": 24,
    "attn_res_block_size": 4,
}  # fmt: skip
# Stable LatentMoE ideas the release does not use (docs/variants.md), each field at the value that leaves it off.
# config.json omits a field at this value, so a released-style configuration saves exactly as it always did.
VARIANT_FIELDS_OFF = {
    "expert_basis_size": None,
    "router_score_normalization": "none",
    "router_score_quantile_bins": None,
    "attention_gate_routing": False,
    "num_coarse_experts": None,
    "coarse_experts_per_token": None,
    "dynamic_experts_per_token": False,
    "min_experts_per_token": None,
    "max_experts_per_token": None,
}
DEFAULT_SCORE_QUANTILE_BINS = 64
# Training switches that older config.json files carry; they are not properties of the model, so they are dropped.
RETIRED_TRAINING_SWITCHES = (
    "use_fused_situ", "router_balancing", "qb_num_bins", "qb_estimator", "record_attn_logit_max"
)
# Saved folders load through every Auto class with `trust_remote_code` (transformers only writes the saved class).
AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3Config",
    "AutoModel": "modeling_kimi_k3.KimiK3Model",
    "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM",
    "AutoModelForSequenceClassification": "modeling_kimi_k3.KimiK3ForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_kimi_k3.KimiK3ForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_kimi_k3.KimiK3ForQuestionAnswering",
}
# A configuration that switches a Stable LatentMoE variant on is built by the variants' own model classes (the
# released ones refuse it); only folders saved from them carry that file.
VARIANT_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3Config",
    "AutoModel": "variants_kimi_k3.KimiK3VariantModel",
    "AutoModelForCausalLM": "variants_kimi_k3.KimiK3VariantForCausalLM",
}
# A configuration with a `vision_config` also loads as the vision-language model.
VISION_AUTO_MAP = {"AutoModelForImageTextToText": "modeling_kimi_k3_vision.KimiK3ForConditionalGeneration"}
# Keys of the released multimodal wrapper that repeat its `vision_config` (kept there), describe the wrapper's own
# remote-code classes or serving-time quantization only.
_WRAPPER_ONLY_KEYS = (
    "media_placeholder_token_id",
    "image_placeholder",
    "ignore_index",
    "auto_map",
    "quantization_config",
)



@strict
class KimiK3Config(PreTrainedConfig):
    r"""
    Configuration for [`KimiK3ForCausalLM`]: the text tower of Kimi K3.

    Every field is a property of the model. Training policies (router balancing, QK-Clip) are configured where they
    run; older files that still carry their switches load, and the switches are dropped.
    """

    model_type = "kimi_k3"
    # The vision tower and projector of the vision-language model; absent from the text-only model.
    sub_configs_defaults = {"vision_config": SubConfigSpec(KimiK3VisionConfig, optional=True)}
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the cache field under transformers >= 5.24 and before
    attribute_map = {
        "num_local_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
        "norm_topk_prob": "moe_renormalize",
        "n_group": "num_expert_group",
    }
    # Expert parallelism (`DistributedConfig(ep_size=...)`): each rank holds whole experts of the fused 3-D tensors
    # and receives its routed latent tokens by all-to-all; routers, and so Quantile Balancing, stay replicated. FSDP2
    # uses PreTrainedConfig's default plan: one unit per decoder layer, the embeddings and the final norm.
    base_model_ep_plan = {
        "layers.*.block_sparse_moe.experts.gate_up_proj": "grouped_gemm",
        "layers.*.block_sparse_moe.experts.down_proj": "grouped_gemm",
        "layers.*.block_sparse_moe.experts": "ep_dispatch_experts",
    }
    # Tensor parallelism (`from_pretrained(..., tp_plan="auto")`, or `DistributedConfig(tp_size=...)`): each rank
    # holds whole attention heads (the MLA and KDA head counts must divide by the TP size) and a slice of every GLU's
    # intermediate width; an all-reduce ends each attention, dense MLP and shared-expert block, and one more sums the
    # routed experts' latent outputs. The model reads head counts from the tensors, so a rank's forward runs on its
    # own heads. Every parameter has a rule; those marked "replicate" act on whole hidden or latent vectors. The
    # routed experts are split along their intermediate width inside the latent space; the latent down/up
    # projections stay whole, because the latent RMSNorm and every expert read the whole latent vector (splitting
    # them would add an all-gather and an all-reduce per layer, to save a tenth of the routed experts' FLOPs).
    # There is no `base_model_pp_plan`: with Block Attention Residuals a layer reads every earlier block snapshot,
    # while transformers' pipeline stages pass one hidden-state tensor on.
    base_model_tp_plan = {
        # Gated MLA (DeepSeek-V2 layout): queries, expanded keys/values and the output gate by heads; the compressed
        # latent stays whole, and the gradient of its shared key part, which every head reads, is summed over ranks.
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.q_a_proj": "replicate",
        "layers.*.self_attn.q_a_layernorm": "replicate",
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.kv_a_layernorm": "replicate",
        "layers.*.self_attn.kv_b_proj": "colwise",
        # Kimi Delta Attention: projections, short convolutions (depthwise, split by channel as dim 0 of the kernel:
        # "embedding_rowwise" is the style that shards dim 0 of a 3-D tensor) and per-head decay parameters, which
        # the layer reads as local tensors ("local_params"); the low-rank decay input f_a stays whole, and the
        # per-head output norm, shared by all heads, sums its gradient over ranks.
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_conv1d.weight": "embedding_rowwise",
        "layers.*.self_attn.k_conv1d.weight": "embedding_rowwise",
        "layers.*.self_attn.v_conv1d.weight": "embedding_rowwise",
        "layers.*.self_attn.q_conv1d": "local_params",
        "layers.*.self_attn.k_conv1d": "local_params",
        "layers.*.self_attn.v_conv1d": "local_params",
        "layers.*.self_attn.f_a_proj": "replicate",
        "layers.*.self_attn.f_b_proj": "colwise",
        "layers.*.self_attn.A_log": "colwise",
        "layers.*.self_attn.dt_bias": "colwise",
        "layers.*.self_attn.b_proj": "colwise",
        "layers.*.self_attn.o_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn": "local_params",
        # Both attentions: sigmoid output gate by heads, output projection reduced over ranks.
        "layers.*.self_attn.g_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        # Dense MLP and shared experts.
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.block_sparse_moe.shared_experts.gate_proj": "colwise",
        "layers.*.block_sparse_moe.shared_experts.up_proj": "colwise",
        "layers.*.block_sparse_moe.shared_experts.down_proj": "rowwise",
        # Stable LatentMoE: the router (and so Quantile Balancing) sees every token on every rank.
        "layers.*.block_sparse_moe.gate": "replicate",
        "layers.*.block_sparse_moe.routed_expert_down_proj": "replicate",
        "layers.*.block_sparse_moe.experts.gate_up_proj": "packed_colwise",
        "layers.*.block_sparse_moe.experts.down_proj": "rowwise",
        "layers.*.block_sparse_moe.experts": "moe_tp_experts",
        "layers.*.block_sparse_moe.routed_expert_norm": "replicate",
        "layers.*.block_sparse_moe.routed_expert_up_proj": "replicate",
        # Norms and Block Attention Residual pseudo-queries act on whole hidden vectors.
        "layers.*.input_layernorm": "replicate",
        "layers.*.post_attention_layernorm": "replicate",
        "layers.*.self_attention_res_proj": "replicate",
        "layers.*.self_attention_res_norm": "replicate",
        "layers.*.mlp_res_proj": "replicate",
        "layers.*.mlp_res_norm": "replicate",
        "output_attn_res_proj": "replicate",
        "output_attn_res_norm": "replicate",
        "norm": "replicate",
    }

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 9
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    # Gated MLA (DeepSeek-V2 §2.1; K3 report §2.1.2)
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = 128
    kv_lora_rank: int | None = 64
    qk_nope_head_dim: int | None = 32
    qk_rope_head_dim: int | None = 16
    v_head_dim: int | None = 32
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    attention_dropout: float = 0.0

    # Kimi Delta Attention (Kimi Linear; K3 report §2.1). config.json nests these in the release's
    # `linear_attn_config` (keys in RELEASED_LINEAR_ATTN_KEYS), beside its 1-based layer lists.
    linear_num_heads: int = 4
    linear_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    linear_gate_lower_bound: float = -5.0  # lower bound of K3's sigmoid decay gate, in log space
    linear_use_full_rank_gate: bool = True
    # "linear_attention" (KDA) or "full_attention" (MLA) per layer; None gives the release's pattern: MLA at every
    # fourth layer and at the last one.
    layer_types: list[str] | None = None

    # Feed-forward (K3 report §2.3)
    hidden_act: Literal["situ", "silu", "gelu", "relu"] = "situ"
    activation_situ_beta: float | None = 4.0
    activation_situ_linear_beta: float | None = 25.0
    intermediate_size: int = 768
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int | None = 64
    num_experts_per_token: int = 4
    num_shared_experts: int = 2
    moe_intermediate_size: int = 128
    routed_expert_hidden_size: int | None = 128
    latent_moe_use_norm: bool = True
    moe_router_activation_func: Literal["sigmoid", "softmax"] = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    # Return every MoE layer's router logits (transformers' MoE output convention; K3 trains without an auxiliary loss).
    output_router_logits: bool = False

    # Block Attention Residuals (arXiv:2603.15031); None gives the plain pre-norm residual stream.
    attn_res_block_size: int | None = 4
    num_nextn_predict_layers: int = 0

    # Stable LatentMoE variants, all off in the release (docs/variants.md; `variants_kimi_k3.py`):
    # shared-basis experts W_e = sum_j C[e, j] B_j over `expert_basis_size` basis matrices;
    expert_basis_size: int | None = None
    # top-k over each expert's score quantile u = F_e(s) ("quantile", with `router_score_quantile_bins` knots);
    router_score_normalization: Literal["none", "quantile"] = "none"
    router_score_quantile_bins: int | None = None
    # MLA output gate sigma(W_g x + U r(x)), r(x) the layer's sparse routing weights of the attention input;
    attention_gate_routing: bool = False
    # two-level routing: `coarse_experts_per_token` of `num_coarse_experts` groups, then top-k inside them;
    num_coarse_experts: int | None = None
    coarse_experts_per_token: int | None = None
    # dynamic k: every expert with s + b > 0, clamped to [min, max]_experts_per_token (default [1, 2k]).
    dynamic_experts_per_token: bool = False
    min_experts_per_token: int | None = None
    max_experts_per_token: int | None = None

    # MoonViT3d and the patch-merger projector (`configuration_kimi_k3_vision.py`), read by
    # `KimiK3ForConditionalGeneration`; the text classes ignore it.
    vision_config: dict | PreTrainedConfig | None = None

    @property
    def sub_configs(self) -> dict:
        """A text-only config has no sub-config (and saves no ``vision_config``); a vision-language one has one."""
        return {"vision_config": KimiK3VisionConfig} if self.vision_config is not None else {}

    def __post_init__(self, **kwargs):
        text_config = kwargs.pop("text_config", None)
        if text_config is not None:
            kwargs = self._flatten_release_wrapper(text_config, kwargs)
        self._read_layer_pattern(kwargs.pop("linear_attn_config", None), kwargs.pop("mlp_layer_types", None))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        retired = sorted(key for key in RETIRED_TRAINING_SWITCHES if kwargs.pop(key, None) is not None)
        if retired:
            logger.info(f"Ignoring training switches that the training job owns now: {retired}")
        self._fill_variant_defaults()
        super().__post_init__(**kwargs)
        self.auto_map = self._classes_to_load_with()

    def _classes_to_load_with(self) -> dict[str, str]:
        """The ``auto_map`` a saved folder loads through: the variants' classes for a variant, the vision-language
        model's too with a ``vision_config``."""
        auto_map = dict(VARIANT_AUTO_MAP if self.enabled_variants else AUTO_MAP)
        if self.vision_config is not None:
            auto_map.update(VISION_AUTO_MAP)
        return auto_map

    def to_dict(self) -> dict:
        """``PreTrainedConfig.to_dict`` in the release's layout: the KDA fields nested in ``linear_attn_config``, the
        derived ``mlp_layer_types`` written out, and the variant fields that are off left out, so the release saves
        unchanged."""
        output = super().to_dict()
        for field in RELEASED_LINEAR_ATTN_KEYS.values():
            output.pop(field, None)
        output["linear_attn_config"] = self._released_linear_attn_config()
        output["mlp_layer_types"] = self.mlp_layer_types
        if output.get("vision_config", 0) is None:  # a text-only model saves as it always did
            output.pop("vision_config")
        for name, off in VARIANT_FIELDS_OFF.items():
            if output.get(name, off) == off:
                output.pop(name, None)
        return output

    # ------------------------------------------------------------------ the release's layout
    def _read_layer_pattern(self, linear_attn_config: dict | None, mlp_layer_types: list[str] | None) -> None:
        """Read the release's nested ``linear_attn_config`` once into the flat fields, and check the layer lists
        config.json also carries (``layer_types``, ``mlp_layer_types``) against what the release's fields say."""
        if linear_attn_config is not None:
            released = _flat_fields_of_linear_attn_config(linear_attn_config, self.num_hidden_layers)
            for name, value in released.items():
                given, default = getattr(self, name), self.__dataclass_fields__[name].default
                if given not in (default, value):  # both spellings given, and they disagree: neither wins silently
                    _refuse(name, f"`{name}`={given} contradicts `linear_attn_config` (which gives {value}); give "
                                  "the setting once.")
                setattr(self, name, value)
        if self.layer_types is None:
            self.layer_types = release_layer_pattern(self.num_hidden_layers)
        if mlp_layer_types is not None and list(mlp_layer_types) != self.mlp_layer_types:
            _refuse("mlp_layer_types", f"`mlp_layer_types`={mlp_layer_types} contradicts the pattern of "
                                       f"`first_k_dense_replace`/`moe_layer_freq` ({self.mlp_layer_types}); drop "
                                       "`mlp_layer_types` or fix those fields.")

    def _released_linear_attn_config(self) -> dict:
        return {
            "kda_layers": [i + 1 for i in self.kda_layer_indices],
            "full_attn_layers": [i + 1 for i in self.mla_layer_indices],
            **{key: getattr(self, field) for key, field in RELEASED_LINEAR_ATTN_KEYS.items()},
        }

    @property
    def linear_attn_config(self) -> types.MappingProxyType:
        """The release's nested KDA settings, as config.json holds them (read-only: the fields are the flat
        ``linear_*`` ones and ``layer_types``); assigning a whole one reads it into those fields."""
        released = self._released_linear_attn_config()
        return types.MappingProxyType({key: tuple(value) if isinstance(value, list) else value
                                       for key, value in released.items()})

    @linear_attn_config.setter
    def linear_attn_config(self, released: dict) -> None:
        self.update(_flat_fields_of_linear_attn_config(released, self.num_hidden_layers))

    def _flatten_release_wrapper(self, text_config: dict, kwargs: dict) -> dict:
        """Take the text part of a released multimodal ``config.json``.

        Text fields override the wrapper's; token ids missing from the text part are carried over from the wrapper.
        ``model_type``/``architectures``/``auto_map`` (wrapper and text part) point at the release's remote code and
        ``quantization_config`` describes the MXFP4 expert storage, which the loader dequantizes itself. Wrapper keys
        this class does not know are kept as attributes, as for any config, and logged.
        """
        if not isinstance(text_config, dict):
            text_config = text_config.to_dict()
        text_config = copy.deepcopy(text_config)
        if isinstance(self.vision_config, dict):  # the wrapper's copies of the vision side's token ids
            for key in ("media_placeholder_token_id", "ignore_index"):
                if key in kwargs:
                    self.vision_config.setdefault(key, kwargs[key])
        dropped = [key for key in _WRAPPER_ONLY_KEYS if kwargs.pop(key, None) is not None]
        if self.architectures is not None:
            dropped.append("architectures")
            self.architectures = None
        unknown = sorted(key for key in kwargs if not _handled_by_pretrained_config(key))
        if unknown:
            logger.warning(f"Kept unrecognised keys of the released wrapper config as attributes: {unknown}")
        for key in ("model_type", "architectures", "auto_map", "quantization_config", "transformers_version"):
            if text_config.pop(key, None) is not None:
                dropped.append(f"text_config.{key}")
        fields = self.__dataclass_fields__
        for key, value in text_config.items():
            if key in fields or key in self.attribute_map:
                setattr(self, key, value)
            else:
                kwargs[key] = value
        logger.info(f"Read the text part of a released Kimi-K3 config; ignored wrapper keys: {sorted(dropped)}")
        return kwargs

    # ------------------------------------------------------------------ presets
    @classmethod
    def kimi_k3(cls, **overrides) -> "KimiK3Config":
        """The released Kimi-K3 text configuration (``moonshotai/Kimi-K3`` ``text_config``); its 93 layers follow
        the default layer pattern (MLA at layers 4, 8, ..., 92 and 93)."""
        values = {
            "vocab_size": 163840,
            "hidden_size": 7168,
            "num_hidden_layers": 93,
            "max_position_embeddings": 1048576,
            "pad_token_id": 163839,
            "bos_token_id": 163584,
            "eos_token_id": 163586,
            "num_attention_heads": 96,
            "num_key_value_heads": 96,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "linear_num_heads": 96,
            "linear_head_dim": 128,
            "intermediate_size": 33792,
            "num_experts": 896,
            "num_experts_per_token": 16,
            "num_shared_experts": 2,
            "moe_intermediate_size": 3072,
            "routed_expert_hidden_size": 3584,
            "attn_res_block_size": 12,
            "dtype": "bfloat16",
        }
        return cls(**{**values, **overrides})

    @classmethod
    def tiny(cls, **overrides) -> "KimiK3Config":
        """The toy model of the tests, benchmarks and ablation suite (``TINY``): every K3 invariant, a forward in
        milliseconds."""
        return cls(**{**TINY, **overrides})

    # ------------------------------------------------------------------ derived properties
    @property
    def kda_layer_indices(self) -> list[int]:
        """0-based indices of the Kimi Delta Attention layers."""
        return [i for i, kind in enumerate(self.layer_types or []) if kind == "linear_attention"]

    @property
    def mla_layer_indices(self) -> list[int]:
        """0-based indices of the Gated MLA layers."""
        return [i for i, kind in enumerate(self.layer_types or []) if kind == "full_attention"]

    @property
    def mlp_layer_types(self) -> list[str]:
        """"dense" or "sparse" (MoE) per layer, as transformers names them: derived from ``first_k_dense_replace``,
        ``moe_layer_freq`` and ``num_experts``, so it never disagrees with them."""
        return ["sparse" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers)]

    @property
    def number_of_conv_states(self) -> int:
        # KDA keeps separate q, k and v short convolutions, hence three conv-state slots per cache layer.
        return 3

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def enabled_variants(self) -> tuple[str, ...]:
        """The Stable LatentMoE variants this configuration switches on (none for the release)."""
        switches = {
            "shared-basis experts (expert_basis_size)": self.expert_basis_size is not None,
            "quantile-normalized routing (router_score_normalization)": self.router_score_normalization != "none",
            "routing-modulated attention gates (attention_gate_routing)": self.attention_gate_routing,
            "two-level routing (num_coarse_experts)": self.num_coarse_experts is not None,
            "dynamic k (dynamic_experts_per_token)": self.dynamic_experts_per_token,
        }
        return tuple(name for name, on in switches.items() if on)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    # ------------------------------------------------------------------ assignments after construction
    def __setattr__(self, name, value):
        """@strict checks an assigned value's type; once the config is built, the cross-field rules run too, so
        ``config.num_experts_per_token = 100`` is refused (and undone) where it is written, not at save time."""
        if self.__dict__.get("_post_init_done") and self.attribute_map.get(name, name) in self.__dataclass_fields__:
            self.update({name: value})
        else:
            super().__setattr__(name, value)

    def update(self, config_dict: dict) -> None:
        """Set every field of ``config_dict``, then check them together: fields that only agree with each other
        (``num_experts`` and ``num_experts_per_token``) can change in one call. Nothing changes when refused."""
        before, was_variant = dict(self.__dict__), bool(self.enabled_variants)
        try:
            for name, value in config_dict.items():  # by the field's own name, which @strict checks the type of
                super().__setattr__(self.attribute_map.get(name, name), value)
            self.validate()
        except StrictDataclassError:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise
        if bool(self.enabled_variants) != was_variant:  # a folder saved from a variant loads with its classes
            self.auto_map = self._classes_to_load_with()

    # ------------------------------------------------------------------ @strict class validators
    def validate_architecture(self) -> None:
        """Sizes and the settings K3 fixes."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "moe_layer_freq", "attn_res_block_size"):
            _require_positive(name, getattr(self, name))
        for name in ("rms_norm_eps", "activation_situ_beta", "activation_situ_linear_beta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"`{name}` must be > 0{' or None' if name != 'rms_norm_eps' else ''}, got {value}.")
        if self.num_nextn_predict_layers != 0:
            raise ValueError(
                f"`num_nextn_predict_layers` must be 0 (multi-token prediction layers are not supported), "
                f"got {self.num_nextn_predict_layers}."
            )
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"`first_k_dense_replace` must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace}."
            )

    def validate_attention_layers(self) -> None:
        """Each layer is KDA or MLA; a model without MLA layers cannot use transformers' cache."""
        allowed = ("linear_attention", "full_attention")
        if self.layer_types is None or any(kind not in allowed for kind in self.layer_types):
            raise ValueError(f"`layer_types` entries must be one of {allowed} (KDA, MLA), got {self.layer_types}.")
        if not self.mla_layer_indices and self.use_cache:
            raise ValueError(
                "`use_cache` must be False when no layer is MLA (`full_attention`; "
                "`linear_attn_config.full_attn_layers` is empty): transformers' cache counts tokens in attention "
                "layers only, so a model of KDA layers alone generates by full forwards."
            )

    def validate_kda(self) -> None:
        if not self.kda_layer_indices:
            return
        for name in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
            _require_positive(name, getattr(self, name))
        if not self.linear_gate_lower_bound < 0:
            raise ValueError(
                f"`linear_gate_lower_bound` (`linear_attn_config.gate_lower_bound`) must be a negative number (the K3 "
                f"sigmoid decay gate), got {self.linear_gate_lower_bound!r}."
            )
        if not self.linear_use_full_rank_gate:
            raise ValueError("`linear_use_full_rank_gate` (`linear_attn_config.use_full_rank_gate`) must be True "
                             "(K3's full-rank output gate).")

    def validate_mla(self) -> None:
        if not self.mla_layer_indices:
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) is None:
                raise ValueError(f"`{name}` is required because the config has MLA layers (`full_attention`).")
            _require_positive(name, getattr(self, name))
        _require_positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim is None or self.qk_rope_head_dim < 0:
            raise ValueError(f"`qk_rope_head_dim` must be an integer >= 0, got {self.qk_rope_head_dim!r}.")
        if not self.mla_use_nope:
            raise ValueError("`mla_use_nope` must be True: K3's MLA uses no rotary embedding.")

    def validate_moe(self) -> None:
        if self.num_experts is None:
            return
        for name in ("num_experts", "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size"):
            _require_positive(name, getattr(self, name))
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"`num_experts_per_token` ({self.num_experts_per_token}) must be <= `num_experts` ({self.num_experts})."
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"`num_shared_experts` must be >= 0, got {self.num_shared_experts}.")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"`routed_scaling_factor` must be > 0, got {self.routed_scaling_factor}.")
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise ValueError(
                f"Group-limited routing is not supported: `num_expert_group` and `topk_group` must be 1, "
                f"got {self.num_expert_group} and {self.topk_group}."
            )

    # ------------------------------------------------------------------ variants
    def _fill_variant_defaults(self) -> None:
        """The documented defaults of a switched-on variant's own sizes, written out so config.json states them."""
        if self.router_score_normalization == "quantile" and self.router_score_quantile_bins is None:
            self.router_score_quantile_bins = DEFAULT_SCORE_QUANTILE_BINS
        if self.dynamic_experts_per_token and self.num_experts is not None:
            if self.min_experts_per_token is None:
                self.min_experts_per_token = 1
            if self.max_experts_per_token is None:
                self.max_experts_per_token = min(2 * self.num_experts_per_token, self.num_experts)

    def validate_variants(self) -> None:
        if not self.enabled_variants and all(getattr(self, name) == off for name, off in VARIANT_FIELDS_OFF.items()):
            return
        if self.num_experts is None:
            what = self.enabled_variants[0] if self.enabled_variants else "A variant field"
            raise ValueError(f"{what} needs routed experts: set `num_experts`.")
        quantile, dynamic = self.router_score_normalization == "quantile", self.dynamic_experts_per_token
        _require_dependent("router_score_quantile_bins", self.router_score_quantile_bins,
                           "router_score_normalization='quantile'", quantile)
        _require_dependent("coarse_experts_per_token", self.coarse_experts_per_token, "num_coarse_experts",
                           self.num_coarse_experts is not None)
        for name in ("min_experts_per_token", "max_experts_per_token"):
            _require_dependent(name, getattr(self, name), "dynamic_experts_per_token=true", dynamic)
        selection_rules = {
            "router_score_normalization='quantile'": quantile,
            "num_coarse_experts": self.num_coarse_experts is not None,
            "dynamic_experts_per_token": dynamic,
        }
        chosen = [name for name, on in selection_rules.items() if on]
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)} each replace the router's selection rule; enable at most one.")
        if self.expert_basis_size is not None:
            self._check_shared_basis()
        bins = self.router_score_quantile_bins
        if bins is not None and bins < 2:
            raise ValueError(f"`router_score_quantile_bins` must be an integer >= 2, got {bins}.")
        if self.attention_gate_routing:
            self._check_attention_gate_routing()
        if self.num_coarse_experts is not None:
            self._check_two_level_routing()
        if dynamic:
            self._check_dynamic_experts()

    def _check_shared_basis(self) -> None:
        _require_positive("expert_basis_size", self.expert_basis_size)
        if self.expert_basis_size > self.num_experts:
            raise ValueError(f"`expert_basis_size` ({self.expert_basis_size}) must be <= `num_experts` "
                             f"({self.num_experts}): a larger basis holds more weights than independent experts.")

    def _check_attention_gate_routing(self) -> None:
        if not self.mla_use_output_gate:
            raise ValueError("`attention_gate_routing` modulates MLA's output gate: it needs "
                             "`mla_use_output_gate=true`.")
        routed_mla = [i for i in self.mla_layer_indices if self.is_moe_layer(i)]
        if not routed_mla:
            raise ValueError("`attention_gate_routing` reads the routing of an MLA layer's own router, but no MLA "
                             "layer (`full_attention`) is an MoE layer.")

    def _check_two_level_routing(self) -> None:
        groups, chosen, k = self.num_coarse_experts, self.coarse_experts_per_token, self.num_experts_per_token
        _require_positive("num_coarse_experts", groups)
        if chosen is None:
            raise ValueError("`coarse_experts_per_token` is required with `num_coarse_experts`: how many of the coarse "
                             f"experts each token picks, in [1, {groups}].")
        _require_positive("coarse_experts_per_token", chosen)
        if self.num_experts % groups:
            raise ValueError(f"`num_coarse_experts` ({groups}) must divide `num_experts` ({self.num_experts}): each "
                             "coarse expert owns num_experts / num_coarse_experts fine experts.")
        if chosen > groups:
            raise ValueError(f"`coarse_experts_per_token` ({chosen}) must be <= `num_coarse_experts` ({groups}).")
        reachable = chosen * (self.num_experts // groups)
        if k >= reachable:
            raise ValueError(f"`num_experts_per_token` ({k}) must be < coarse_experts_per_token x num_experts / "
                             f"num_coarse_experts = {reachable}, the experts a token can reach (at {reachable} the "
                             "fine router would have nothing to choose).")
        if not self.moe_renormalize or k < 2:
            raise ValueError("Two-level routing renormalizes the product of coarse and fine scores over the chosen "
                             f"experts: it needs `moe_renormalize=true` and `num_experts_per_token` >= 2, got "
                             f"{self.moe_renormalize} and {k}.")

    def _check_dynamic_experts(self) -> None:
        low, high, k = self.min_experts_per_token, self.max_experts_per_token, self.num_experts_per_token
        _require_positive("min_experts_per_token", low)
        _require_positive("max_experts_per_token", high)
        if not low <= k <= high <= self.num_experts:
            raise ValueError(f"Dynamic k needs 1 <= `min_experts_per_token` <= `num_experts_per_token` <= "
                             f"`max_experts_per_token` <= `num_experts`, got {low} <= {k} <= {high} <= "
                             f"{self.num_experts}.")


def release_layer_pattern(num_hidden_layers: int) -> list[str]:
    """The release's layer pattern for any depth: MLA at every fourth layer and at the last one, KDA elsewhere."""
    return ["full_attention" if (i + 1) % 4 == 0 or i + 1 == num_hidden_layers else "linear_attention"
            for i in range(num_hidden_layers)]


def _flat_fields_of_linear_attn_config(released, num_hidden_layers: int) -> dict:
    """The flat fields (``linear_*``, ``layer_types``) that a release-format ``linear_attn_config`` states; any key
    missing or unknown, or a layer list that does not name every layer once, is refused naming the key."""
    try:
        layers = _released_layer_lists(released, num_hidden_layers)
    except ValueError as error:
        raise StrictDataclassFieldValidationError(field="linear_attn_config", cause=error) from error
    fields = {field: released[key] for key, field in RELEASED_LINEAR_ATTN_KEYS.items() if key in released}
    full = set(layers["full_attn_layers"])
    layer_numbers = range(1, num_hidden_layers + 1)
    fields["layer_types"] = ["full_attention" if i in full else "linear_attention" for i in layer_numbers]
    return fields


def _released_layer_lists(released, num_hidden_layers: int) -> dict[str, list]:
    if not isinstance(released, dict):
        raise ValueError(f"`linear_attn_config` must be a dict, got {type(released).__name__}.")
    allowed = ("kda_layers", "full_attn_layers", *RELEASED_LINEAR_ATTN_KEYS)
    unknown = sorted(set(released) - set(allowed))
    if unknown:
        raise ValueError(f"`linear_attn_config` has unknown keys {unknown}; its keys are {list(allowed)}.")
    missing = [key for key in allowed if key not in released and key != "use_full_rank_gate"]
    if missing:
        raise ValueError(f"`linear_attn_config.{missing[0]}` is missing (its keys are {list(allowed)}; the layer "
                         "lists hold 1-based layer numbers and may be []).")
    layer_numbers = range(1, num_hidden_layers + 1)
    for key in ("kda_layers", "full_attn_layers"):
        layers = list(released[key])
        if len(set(layers)) != len(layers):
            raise ValueError(f"`linear_attn_config.{key}` lists a layer twice: {layers}.")
        bad = [i for i in layers if i not in layer_numbers]
        if bad:
            raise ValueError(f"`linear_attn_config.{key}` holds 1-based layer numbers in [1, {num_hidden_layers}]; "
                             f"out of range: {bad}.")
    kda, full = set(released["kda_layers"]), set(released["full_attn_layers"])
    if kda & full:
        raise ValueError(f"`linear_attn_config.kda_layers` and `full_attn_layers` overlap at layers "
                         f"{sorted(kda & full)}.")
    neither = sorted(set(layer_numbers) - kda - full)
    if neither:
        raise ValueError(f"Layers {neither} are in neither `linear_attn_config.kda_layers` nor `full_attn_layers`.")
    return {"kda_layers": sorted(kda), "full_attn_layers": sorted(full)}


def _refuse(field: str, message: str) -> None:
    """Refuse a value read at construction the way @strict refuses one: an error naming the field."""
    cause = ValueError(message)
    raise StrictDataclassFieldValidationError(field=field, cause=cause) from cause


def _require_dependent(name: str, value, switch: str, switched_on: bool) -> None:
    """A variant's own size is meaningless without its switch: refuse it rather than ignore it."""
    if value is not None and not switched_on:
        raise ValueError(f"`{name}` is set ({value!r}) but only applies with {switch}.")


def _require_positive(name: str, value: int | None) -> None:
    """Sizes must be >= 1 (``None``, where a field allows it, switches the part off and is not checked here)."""
    if value is not None and value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


def _handled_by_pretrained_config(key: str) -> bool:
    """Keys `PreTrainedConfig` consumes itself: its attributes, private plumbing and generation defaults."""
    generation_defaults = GenerationConfig._get_default_generation_params()
    return key.startswith("_") or hasattr(PreTrainedConfig, key) or key in generation_defaults


KimiK3Config.register_for_auto_class()

__all__ = ["KimiK3Config"]

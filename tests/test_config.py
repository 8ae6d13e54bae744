"""KimiK3Config: released field names, flat fields read from the release's layout, release JSON, validation errors."""

import json
import re
from pathlib import Path

import pytest
from huggingface_hub.errors import StrictDataclassError

from configuration_kimi_k3 import (
    AUTO_MAP,
    RELEASED_LINEAR_ATTN_KEYS,
    TINY,
    VARIANT_AUTO_MAP,
    VARIANT_FIELDS_OFF,
    KimiK3Config,
)
from tests.conftest import ROOT, tiny_config
from tests.golden.record_release_default import config_json

GOLDEN = json.loads((Path(__file__).resolve().parent / "golden" / "release_default.json").read_text())
TINY_LINEAR_ATTN_CONFIG = {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8, 9], "num_heads": 2,
                           "head_dim": 8, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                           "use_full_rank_gate": True}  # fmt: skip


def test_layer_types_come_from_one_based_released_lists():
    config = tiny_config(linear_attn_config=TINY_LINEAR_ATTN_CONFIG)
    assert config.to_dict() == tiny_config().to_dict()  # the default pattern is the release's
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ] * 2
    assert config.mlp_layer_types == ["dense"] + ["sparse"] * 8
    assert config.kda_layer_indices == [0, 1, 2, 4, 5, 6]
    assert config.mla_layer_indices == [3, 7, 8]


def test_released_preset_has_the_release_layer_pattern():
    config = KimiK3Config.kimi_k3()
    mla = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert len(mla) == 24 and mla[-2:] == [91, 92] and mla[:3] == [3, 7, 11]
    assert config.layer_types.count("linear_attention") == 69
    assert config.mlp_layer_types[0] == "dense" and set(config.mlp_layer_types[1:]) == {"sparse"}
    assert (config.num_experts, config.num_experts_per_token, config.routed_expert_hidden_size) == (896, 16, 3584)


def test_default_config_keeps_k3_invariants():
    config = KimiK3Config()
    assert config.layer_types[-2:] == ["full_attention", "full_attention"]
    assert "linear_attention" in config.layer_types
    assert config.num_hidden_layers // config.attn_res_block_size >= 2
    assert config.mlp_layer_types[0] == "dense"
    assert config.routed_expert_hidden_size != config.hidden_size
    assert config.num_shared_experts > 0 and config.num_experts_per_token > 1
    assert config.num_experts >= 8 * config.num_experts_per_token
    assert (config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta) == ("situ", 4.0, 25.0)
    assert config.qk_rope_head_dim > 0 and config.mla_use_output_gate


def test_save_and_reload_round_trip(tmp_path):
    config = tiny_config(routed_scaling_factor=2.5)
    config.save_pretrained(tmp_path)
    reloaded = KimiK3Config.from_pretrained(tmp_path)
    assert reloaded.to_dict() == config.to_dict()


@pytest.mark.parametrize("name", ["default", "released", "tiny"])
def test_a_recorded_config_json_round_trips_byte_for_byte(tmp_path, name):
    """The config.json texts recorded from the release configurations (nested ``linear_attn_config`` and all) load
    into the flat fields and save back unchanged."""
    text = json.dumps({**GOLDEN[f"{name}_config_json"], "transformers_version": "5.24.0"}, indent=2, sort_keys=True)
    (tmp_path / "config.json").write_text(text + "\n")
    loaded = KimiK3Config.from_pretrained(tmp_path)
    loaded.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert json.dumps({**saved, "transformers_version": "5.24.0"}, indent=2, sort_keys=True) == text
    assert config_json(loaded) == GOLDEN[f"{name}_config_json"]


def test_linear_attn_config_is_read_once_into_flat_fields_and_written_back():
    released = {**TINY_LINEAR_ATTN_CONFIG, "num_heads": 3, "head_dim": 12, "short_conv_kernel_size": 3,
                "gate_lower_bound": -4.5}  # fmt: skip
    config = KimiK3Config(linear_attn_config=released)
    assert {field: getattr(config, field) for field in RELEASED_LINEAR_ATTN_KEYS.values()} == {
        "linear_num_heads": 3, "linear_head_dim": 12, "linear_conv_kernel_dim": 3, "linear_gate_lower_bound": -4.5,
        "linear_use_full_rank_gate": True,
    }  # fmt: skip
    saved = config.to_dict()
    assert saved["linear_attn_config"] == released
    assert not set(RELEASED_LINEAR_ATTN_KEYS.values()) & set(saved)
    assert KimiK3Config(**saved).to_dict() == saved


def test_a_kda_setting_given_both_flat_and_nested_must_agree():
    with pytest.raises(StrictDataclassError, match=r"`linear_num_heads`=2 contradicts `linear_attn_config` \(which "
                                                   r"gives 3\); give the setting once"):
        tiny_config(linear_attn_config={**TINY_LINEAR_ATTN_CONFIG, "num_heads": 3})
    with pytest.raises(StrictDataclassError, match=r"`layer_types`=.* contradicts `linear_attn_config`"):
        tiny_config(layer_types=["linear_attention"] * 8 + ["full_attention"],
                    linear_attn_config=TINY_LINEAR_ATTN_CONFIG)
    assert tiny_config(linear_num_heads=2, linear_attn_config=TINY_LINEAR_ATTN_CONFIG).linear_num_heads == 2


def test_tiny_preset_is_the_tiny_fields_with_overrides():
    assert KimiK3Config.tiny().to_dict() == KimiK3Config(**TINY).to_dict()
    assert KimiK3Config.tiny(num_experts=4).num_experts == 4 and TINY["num_experts"] == 8


def test_no_module_outside_the_config_indexes_linear_attn_config():
    """Model, package, benchmarks and scripts read the flat fields; only the config knows the release's nesting."""
    indexing = re.compile(r"linear_attn_config\s*\[|linear_attn_config\.get\(|\[\s*[\"']linear_attn_config[\"']\s*\]")
    readers = [
        str(path.relative_to(ROOT))
        for folder in (ROOT, ROOT / "kimi_k3", ROOT / "benchmarks", ROOT / "scripts")
        for path in (folder.glob("*.py") if folder == ROOT else folder.rglob("*.py"))
        if path.name != "configuration_kimi_k3.py" and indexing.search(path.read_text())
    ]
    assert readers == []


def test_released_wrapper_json_yields_the_text_config(tmp_path, caplog):
    text = KimiK3Config.kimi_k3().to_dict()
    text.update(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], quantization_config={"x": 1})
    for key in ("layer_types", "mlp_layer_types", "bos_token_id"):
        text.pop(key)
    wrapper = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 163584,
        "media_placeholder_token_id": 163605,
        "vision_config": {"depth": 27},
        "text_config": text,
    }
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    config = KimiK3Config.from_pretrained(tmp_path)
    assert config.hidden_size == 7168 and config.num_experts == 896
    assert config.bos_token_id == 163584 and config.eos_token_id == 163586
    assert config.layer_types[-2:] == ["full_attention", "full_attention"]
    assert config.vision_config is not None and not hasattr(config, "quantization_config")  # the vision side stays


def test_attribute_aliases_of_other_moe_ports():
    config = tiny_config(num_experts_per_tok=3, num_local_experts=12)
    assert (config.num_experts_per_token, config.num_experts) == (3, 12)


BAD_SETTINGS = [
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_hidden_layers": -1}, "num_hidden_layers"),
    ({"vocab_size": "big"}, "vocab_size"),
    ({"num_experts_per_token": 9}, "num_experts_per_token"),
    ({"num_experts": 0}, "num_experts"),
    ({"hidden_act": "swish2"}, "hidden_act"),
    ({"moe_router_activation_func": "relu"}, "moe_router_activation_func"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"v_head_dim": 0}, "v_head_dim"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"attn_res_block_size": 0}, "attn_res_block_size"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"first_k_dense_replace": 10}, "first_k_dense_replace"),
    ({"num_expert_group": 4, "topk_group": 2}, "Group-limited"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"routed_expert_hidden_size": -4}, "routed_expert_hidden_size"),
    ({"activation_situ_beta": -1.0}, "activation_situ_beta"),
    ({"layer_types": ["kda"] * 9}, "layer_types"),
    ({"linear_num_heads": 0}, "linear_num_heads"),
    ({"linear_gate_lower_bound": 0.5}, "linear_gate_lower_bound"),
]


@pytest.mark.parametrize("overrides,message", BAD_SETTINGS, ids=[m for _, m in BAD_SETTINGS])
def test_invalid_settings_raise_naming_the_field(overrides, message):
    with pytest.raises(StrictDataclassError, match=message):
        tiny_config(**overrides)


def _linear_cfg(**changes):
    return {**TINY_LINEAR_ATTN_CONFIG, **changes}


BAD_LAYER_LISTS = [
    (_linear_cfg(kda_layers=[1, 2, 3, 4, 5, 6, 7]), "overlap"),
    (_linear_cfg(kda_layers=[1, 2, 3, 5, 6]), "neither"),
    (_linear_cfg(full_attn_layers=[4, 8, 10]), "out of range"),
    (_linear_cfg(full_attn_layers=[0, 4, 8, 9]), "out of range"),
    (_linear_cfg(kda_layers=[1, 1, 2, 3, 5, 6, 7]), "twice"),
    ({k: v for k, v in _linear_cfg().items() if k != "kda_layers"}, "kda_layers` is missing"),
    (_linear_cfg(gate_lower_bound=0.5), "gate_lower_bound"),
    (_linear_cfg(num_heads=0), "num_heads"),
    (_linear_cfg(short_conv_kernel_size=None), "linear_conv_kernel_dim"),
    (_linear_cfg(use_full_rank_gate=False), "use_full_rank_gate"),
    (_linear_cfg(conv_bias=True), r"unknown keys \['conv_bias'\]"),
    ([1, 2], "`linear_attn_config` must be a dict"),
]


@pytest.mark.parametrize("linear_attn_config,message", BAD_LAYER_LISTS, ids=[m for _, m in BAD_LAYER_LISTS])
def test_invalid_layer_lists_raise_naming_the_field(linear_attn_config, message):
    with pytest.raises(StrictDataclassError, match=message):
        tiny_config(linear_attn_config=linear_attn_config)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rms_norm_eps", "1e-6", "Field 'rms_norm_eps' expected float, got str (value: '1e-6')"),
        ("routed_scaling_factor", "2.5", "Field 'routed_scaling_factor' expected float, got str (value: '2.5')"),
        ("num_experts", 8.0, "Field 'num_experts' with value 8.0 doesn't match any type in (<class 'int'>, "
                             "<class 'NoneType'>)"),
        ("use_cache", "false", "Field 'use_cache' expected bool, got str (value: 'false')"),
        ("routed_scaling_factor", 0.0, "`routed_scaling_factor` must be > 0, got 0.0."),
    ],
)
def test_config_json_values_of_the_wrong_type_are_refused_at_load_naming_the_field(tmp_path, field, value, message):
    tiny_config().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, field: value}))
    with pytest.raises(StrictDataclassError) as error:
        KimiK3Config.from_pretrained(tmp_path)
    assert str(error.value.__cause__).startswith(message)  # @strict's error wraps this one-line cause


@pytest.mark.parametrize(
    "switch,value",
    [("use_fused_situ", False), ("router_balancing", "none"), ("qb_num_bins", 64), ("qb_estimator", "exact"),
     ("record_attn_logit_max", True)],
)
def test_old_config_json_with_a_retired_training_switch_loads_and_drops_it(tmp_path, switch, value):
    tiny_config().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, switch: value}))
    loaded = KimiK3Config.from_pretrained(tmp_path)
    assert not hasattr(loaded, switch)
    loaded.save_pretrained(tmp_path / "again")
    assert switch not in json.loads((tmp_path / "again" / "config.json").read_text())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_experts_per_token", 100, r"`num_experts_per_token` \(100\) must be <= `num_experts` \(8\)"),
        ("num_experts_per_tok", 100, r"`num_experts_per_token` \(100\) must be <= `num_experts` \(8\)"),
        ("num_experts_per_tok", 2.0, r"Field 'num_experts_per_token' expected int, got float"),
        ("hidden_act", "tanh", r"Field 'hidden_act' expected one of \('situ', 'silu', 'gelu', 'relu'\), got tanh"),
        ("rms_norm_eps", "1e-6", r"Field 'rms_norm_eps' expected float, got str \(value: '1e-6'\)"),
        ("num_hidden_layers", 12, r"`num_hidden_layers` \(12\) must be equal to the number of `layer_types` \(9\)"),
        ("layer_types", ["full_attention"] * 8, r"\(9\) must be equal to the number of `layer_types` \(8\)"),
        ("linear_attn_config", _linear_cfg(kda_layers=[1, 2, 3, 4, 5, 6, 7]), r"overlap at layers \[4\]"),
        ("linear_use_full_rank_gate", False, r"`linear_use_full_rank_gate` .* must be True"),
        ("layer_types", None, r"`layer_types` entries must be one of \('linear_attention', 'full_attention'\)"),
    ],
)
def test_an_assignment_that_breaks_the_config_is_refused_and_undone(field, value, message):
    config = tiny_config()
    before = config.to_dict()
    with pytest.raises(StrictDataclassError, match=message):
        setattr(config, field, value)
    assert config.to_dict() | {"transformers_version": None} == before | {"transformers_version": None}


def test_assignments_rederive_the_layer_pattern_and_update_checks_fields_together(tmp_path):
    config = tiny_config()
    config.linear_attn_config = {**config.linear_attn_config, "kda_layers": [1, 2, 3, 4, 5, 6, 7], "full_attn_layers": [8, 9]}
    assert config.layer_types == ["linear_attention"] * 7 + ["full_attention"] * 2
    config.update({"num_experts": 2, "num_experts_per_token": 1})  # either assignment alone would be refused first
    assert (config.num_experts, config.num_experts_per_token) == (2, 1)
    with pytest.raises(StrictDataclassError, match=r"`num_experts_per_token` \(3\) must be <= `num_experts` \(1\)"):
        config.update({"num_experts": 1, "num_experts_per_token": 3})
    assert (config.num_experts, config.num_experts_per_token) == (2, 1)
    config.first_k_dense_replace = 3
    assert config.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 6
    config.save_pretrained(tmp_path / "ok")
    reloaded = KimiK3Config.from_pretrained(tmp_path / "ok")
    assert (reloaded.layer_types, reloaded.mlp_layer_types) == (config.layer_types, config.mlp_layer_types)


def test_a_variant_switched_on_by_assignment_saves_with_the_classes_that_build_it():
    config = tiny_config()
    config.expert_basis_size = 2
    assert config.auto_map == VARIANT_AUTO_MAP
    config.expert_basis_size = None
    assert config.auto_map == AUTO_MAP


def test_a_field_changed_in_place_is_refused_before_config_json_is_written(tmp_path):
    config = tiny_config()
    config.layer_types[3] = "kda"
    with pytest.raises(StrictDataclassError, match=r"`layer_types` entries must be one of"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_the_released_view_of_the_kda_fields_is_read_only_so_no_edit_is_lost():
    config = tiny_config()
    with pytest.raises(TypeError):
        config.linear_attn_config["num_heads"] = 4
    with pytest.raises(AttributeError):
        config.linear_attn_config["kda_layers"].append(4)
    assert dict(config.linear_attn_config) == {key: tuple(value) if isinstance(value, list) else value
                                               for key, value in TINY_LINEAR_ATTN_CONFIG.items()}


def test_a_config_of_kda_layers_alone_needs_use_cache_false():
    kda_only = {**TINY_LINEAR_ATTN_CONFIG, "kda_layers": list(range(1, 10)), "full_attn_layers": []}
    with pytest.raises(StrictDataclassError, match=r"`use_cache` must be False when no layer is MLA"):
        tiny_config(linear_attn_config=kda_only)
    with pytest.raises(StrictDataclassError, match=r"`use_cache` must be False when no layer is MLA"):
        tiny_config(layer_types=["linear_attention"] * 9)
    assert tiny_config(linear_attn_config=kda_only, use_cache=False).layer_types == ["linear_attention"] * 9


# ---------------------------------------------------------------------------------------------------------------------
# The opt-in Stable LatentMoE variants
# ---------------------------------------------------------------------------------------------------------------------
def test_variant_fields_are_absent_from_config_json_when_off_and_round_trip_when_on(tmp_path):
    assert not any(key in KimiK3Config().to_dict() for key in VARIANT_FIELDS_OFF)
    config = tiny_config(router_score_normalization="quantile", expert_basis_size=2, attention_gate_routing=True)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {key: saved[key] for key in saved if key in VARIANT_FIELDS_OFF} == {
        "router_score_normalization": "quantile", "router_score_quantile_bins": 64,  # the default, written out
        "expert_basis_size": 2, "attention_gate_routing": True,
    }
    assert KimiK3Config.from_pretrained(tmp_path).to_dict() == config.to_dict()
    dynamic = tiny_config(dynamic_experts_per_token=True)
    assert (dynamic.min_experts_per_token, dynamic.max_experts_per_token) == (1, 4)  # [1, 2k]
    assert tiny_config().enabled_variants == () and len(config.enabled_variants) == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"expert_basis_size": 9}, r"`expert_basis_size` \(9\) must be <= `num_experts` \(8\)"),
        ({"expert_basis_size": 0}, r"`expert_basis_size` must be a positive integer, got 0"),
        ({"router_score_normalization": "rank"}, r"'router_score_normalization' expected one of \('none', 'quantile'\)"),
        ({"router_score_quantile_bins": 32}, r"`router_score_quantile_bins` is set \(32\) but only applies with "
                                             r"router_score_normalization='quantile'"),
        ({"router_score_normalization": "quantile", "router_score_quantile_bins": 1}, r"must be an integer >= 2"),
        ({"attention_gate_routing": True, "mla_use_output_gate": False}, r"needs `mla_use_output_gate=true`"),
        ({"attention_gate_routing": True, "first_k_dense_replace": 9}, r"no MLA layer .* is an MoE layer"),
        ({"num_coarse_experts": 3, "coarse_experts_per_token": 1}, r"`num_coarse_experts` \(3\) must divide"),
        ({"num_coarse_experts": 4}, r"`coarse_experts_per_token` is required with `num_coarse_experts`"),
        ({"num_coarse_experts": 4, "coarse_experts_per_token": 5}, r"must be <= `num_coarse_experts` \(4\)"),
        ({"num_coarse_experts": 4, "coarse_experts_per_token": 1}, r"`num_experts_per_token` \(2\) must be < .* = 2"),
        ({"num_coarse_experts": 2, "coarse_experts_per_token": 1, "moe_renormalize": False}, r"moe_renormalize=true"),
        ({"coarse_experts_per_token": 2}, r"`coarse_experts_per_token` is set \(2\) but only applies with"),
        ({"dynamic_experts_per_token": True, "max_experts_per_token": 9}, r"got 1 <= 2 <= 9 <= 8"),
        ({"dynamic_experts_per_token": True, "min_experts_per_token": 3}, r"got 3 <= 2 <= 4 <= 8"),
        ({"min_experts_per_token": 1}, r"`min_experts_per_token` is set \(1\) but only applies with"),
        ({"dynamic_experts_per_token": True, "num_coarse_experts": 2, "coarse_experts_per_token": 1},
         r"^num_coarse_experts and dynamic_experts_per_token each replace the router's selection rule; enable at most one"),
        ({"expert_basis_size": 2, "num_experts": None}, r"shared-basis experts \(expert_basis_size\) needs routed experts"),
        ({"dynamic_experts_per_token": "yes"}, r"'dynamic_experts_per_token' expected bool, got str \(value: 'yes'\)"),
    ],
)
def test_impossible_variant_settings_are_refused_in_one_line_naming_the_field(fields, message):
    with pytest.raises(StrictDataclassError) as error:
        tiny_config(**fields)
    assert re.search(message, str(error.value.__cause__)) and "\n" not in str(error.value.__cause__)

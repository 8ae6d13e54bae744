"""The opt-in Stable LatentMoE variants (variants_kimi_k3.py): each one's defining property, its fast path against
its reference, cached generation against full forwards, and reloading through trust_remote_code."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kimi_k3.policies.quantile_balancing import QuantileBalancing
from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3Model, KimiK3TopkRouter
from tests.conftest import HANG_CEILING_S, tiny_config
from tests.numerics import assert_as_accurate
from variants_kimi_k3 import (
    KimiK3DynamicTopkRouter,
    KimiK3SharedBasisExperts,
    KimiK3TwoLevelRouter,
    KimiK3VariantForCausalLM,
    KimiK3VariantModel,
    KimiK3VaryingCountExperts,
    causal_lm_class,
    materialise_experts,
    materialise_experts_reference,
    quantile_normalize,
    quantile_normalize_reference,
    sparse_routing_weights,
)

REPOSITORY = Path(__file__).resolve().parent.parent

# One configuration per variant, at the tiny model's sizes (8 experts, k = 2).
VARIANTS = {
    "shared_basis": {"expert_basis_size": 3},
    "quantile": {"router_score_normalization": "quantile", "router_score_quantile_bins": 16},
    "attention_gate": {"attention_gate_routing": True},
    "two_level": {"num_coarse_experts": 4, "coarse_experts_per_token": 2},
    "dynamic_k": {"dynamic_experts_per_token": True, "min_experts_per_token": 1, "max_experts_per_token": 4},
}


def variant_model(seed: int = 0, **fields) -> KimiK3ForCausalLM:
    """A tiny model with non-trivial AttnRes mixes, router biases and (for the attention gate) routing weights."""
    torch.manual_seed(seed)
    config = tiny_config(**fields)
    model = causal_lm_class(config)(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "res_proj" in name or "routing_weight" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                bias = module.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=generator) * 0.05)
    return model


def moe_blocks(model):
    return [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]


def released_into(variant: KimiK3ForCausalLM, released: KimiK3ForCausalLM) -> list[str]:
    """Copy the released model's tensors into the variant's (the variant's own extra tensors keep their values)."""
    return variant.load_state_dict(released.state_dict(), strict=False).missing_keys


# ---------------------------------------------------------------------------------------------------------------------
# Shared-basis experts
# ---------------------------------------------------------------------------------------------------------------------
def test_identity_coefficients_over_a_basis_of_every_expert_are_bitwise_the_independent_experts():
    released = variant_model()
    basis = variant_model(expert_basis_size=8)
    state = released.state_dict()
    with torch.no_grad():
        for name, module in basis.named_modules():
            if isinstance(module, KimiK3SharedBasisExperts):
                module.gate_up_basis.copy_(state.pop(f"{name}.gate_up_proj"))
                module.down_basis.copy_(state.pop(f"{name}.down_proj"))
                module.gate_up_coefficients.copy_(torch.eye(8))
                module.down_coefficients.copy_(torch.eye(8))
    basis.load_state_dict(state, strict=False)
    ids = torch.randint(3, 97, (2, 11))
    with torch.no_grad():
        assert torch.equal(basis(ids).logits, released(ids).logits)
        for implementation in ("eager", "batched_mm"):
            basis.set_experts_implementation(implementation)
            released.set_experts_implementation(implementation)
            assert torch.equal(basis(ids).logits, released(ids).logits), implementation


def test_shared_basis_parameter_count_is_basis_times_expert_size_plus_two_coefficient_tables():
    config = tiny_config(expert_basis_size=3)
    experts = KimiK3SharedBasisExperts(config)
    expert_size = 3 * config.routed_expert_hidden_size * config.moe_intermediate_size
    assert sum(p.numel() for p in experts.parameters()) == 3 * expert_size + 2 * config.num_experts * 3
    saved = KimiK3ForCausalLM(tiny_config()).num_parameters() - KimiK3VariantForCausalLM(config).num_parameters()
    moe_layers = config.mlp_layer_types.count("sparse")
    assert saved == moe_layers * (config.num_experts * expert_size - (3 * expert_size + 2 * config.num_experts * 3))


def test_materialised_experts_equal_the_term_by_term_sum_to_fp32_rounding():
    generator = torch.Generator().manual_seed(0)
    coefficients = torch.randn(9, 5, generator=generator, dtype=torch.float64)
    basis = torch.randn(5, 6, 7, generator=generator, dtype=torch.float64)
    exact = materialise_experts_reference(coefficients, basis)
    assert_as_accurate(materialise_experts(coefficients.float(), basis.float()),
                       materialise_experts_reference(coefficients.float(), basis.float()), exact,
                       what="materialised experts")


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_shared_basis_experts_backends_match_the_per_expert_loop(implementation):
    config = tiny_config(expert_basis_size=3)
    experts = KimiK3SharedBasisExperts(config)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.3)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randn(13, config.routed_expert_hidden_size, generator=generator)
    indices = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(13)])
    weights = torch.rand(13, 2, generator=generator)

    def run(dtype, name):
        experts.to(dtype).config._experts_implementation = name
        return experts(tokens.to(dtype), indices, weights.to(dtype))

    exact, trusted = run(torch.float64, "eager"), run(torch.float32, "eager")
    assert_as_accurate(run(torch.float32, implementation), trusted, exact, what=implementation)


# ---------------------------------------------------------------------------------------------------------------------
# Quantile-normalized routing (the CDF refit and its balancing are in tests/policies/test_score_quantiles.py)
# ---------------------------------------------------------------------------------------------------------------------
def test_quantile_normalization_matches_the_counting_reference_with_ties_and_end_scores():
    generator = torch.Generator().manual_seed(0)
    inner = torch.rand(5, 7, generator=generator, dtype=torch.float64).sort(-1).values
    knots = torch.cat([torch.zeros(5, 1, dtype=torch.float64), inner, torch.ones(5, 1, dtype=torch.float64)], -1)
    knots[2, 3:5] = knots[2, 3]  # a zero-width bin
    scores = torch.rand(40, 5, generator=generator, dtype=torch.float64)
    scores[:5] = knots[:, 1:6].T  # exactly on knots
    scores[5], scores[6] = 0.0, 1.0
    expected = quantile_normalize_reference(scores, knots)
    assert torch.allclose(quantile_normalize(scores, knots), expected, rtol=0, atol=1e-15)
    assert ((expected >= 0) & (expected <= 1)).all()


def test_a_16_bit_load_keeps_the_score_cdf_float32_and_the_release_list_does_not_name_it(tmp_path):
    variant_model(**VARIANTS["quantile"]).save_pretrained(tmp_path)
    reloaded = KimiK3VariantForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    router = reloaded.model.layers[1].block_sparse_moe.gate
    assert router.score_quantiles.dtype == torch.float32 and router.weight.dtype == torch.bfloat16
    assert "score_quantiles" not in variant_model()._keep_in_fp32_modules_strict


def test_fresh_quantile_router_selects_as_the_released_router():
    released, quantile = variant_model(), variant_model(**VARIANTS["quantile"])
    released_into(quantile, released)
    tokens = torch.randn(64, 32)
    for plain, normalized in zip(moe_blocks(released), moe_blocks(quantile)):
        _, weights, indices = plain.gate(tokens)
        _, quantile_weights, quantile_indices = normalized.gate(tokens)
        assert torch.equal(indices.sort(-1).values, quantile_indices.sort(-1).values)


# ---------------------------------------------------------------------------------------------------------------------
# Routing-modulated attention gates
# ---------------------------------------------------------------------------------------------------------------------
def test_zero_routing_weights_are_bitwise_the_released_attention_gate():
    released, gated = variant_model(), variant_model(attention_gate_routing=True)
    missing = released_into(gated, released)
    assert sorted(missing) == [f"model.layers.{i}.self_attn.g_proj.routing_weight" for i in (3, 7, 8)]
    with torch.no_grad():
        for name in missing:
            gated.get_parameter(name).zero_()
    ids = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        assert torch.equal(gated(ids).logits, released(ids).logits)
    assert KimiK3VariantForCausalLM(tiny_config(attention_gate_routing=True)).get_parameter(missing[0]).abs().max() == 0


def test_gradients_reach_the_zero_initialised_routing_weights_but_not_the_router_through_the_gate():
    model = KimiK3VariantForCausalLM(tiny_config(attention_gate_routing=True)).train()
    ids = torch.randint(3, 97, (2, 10))
    model(ids, labels=ids).loss.backward()
    for i in (3, 7, 8):
        gate_projection = model.model.layers[i].self_attn.g_proj
        assert gate_projection.routing_weight.abs().max() == 0
        assert (gate_projection.routing_weight.grad.abs().amax(-1) > 0).all()  # every head learns
    router = model.model.layers[3].block_sparse_moe.gate
    with torch.enable_grad():
        routing = sparse_routing_weights(router, torch.randn(4, 32, requires_grad=True))
    assert not routing.requires_grad and (routing > 0).sum(-1).eq(router.top_k).all()


def test_balancing_statistics_count_the_moe_tokens_only_with_attention_gates():
    model = variant_model(attention_gate_routing=True).train()
    balancing = QuantileBalancing(model)
    balancing.attach()
    statistics = balancing.statistics["layer_3"]  # an MLA layer
    ids = torch.randint(3, 97, (2, 10))
    model(ids)
    assert statistics.tokens_per_expert.sum() == 2 * 10 * model.config.num_experts_per_token


# ---------------------------------------------------------------------------------------------------------------------
# Two-level routing
# ---------------------------------------------------------------------------------------------------------------------
def test_one_coarse_group_is_bitwise_flat_routing():
    released, grouped = variant_model(), variant_model(num_coarse_experts=1, coarse_experts_per_token=1)
    assert all(".coarse_gate." in key for key in released_into(grouped, released))
    tokens = torch.randn(50, 32)
    for plain, two_level in zip(moe_blocks(released), moe_blocks(grouped)):
        for released_output, grouped_output in zip(plain.gate(tokens), two_level.gate(tokens)):
            assert torch.equal(released_output, grouped_output)
    ids = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        assert torch.equal(grouped(ids).logits, released(ids).logits)


def test_experts_come_from_the_chosen_groups_only_and_weigh_the_renormalized_score_product():
    router = moe_blocks(variant_model(**VARIANTS["two_level"]).double())[0].gate
    assert isinstance(router, KimiK3TwoLevelRouter)
    tokens = torch.randn(200, 32, dtype=torch.float64)
    coarse_logits, _, groups = router.coarse_gate(tokens)
    logits, weights, indices = router(tokens)
    owner = indices // router.experts_per_group
    assert (owner[..., None] == groups[:, None, :]).any(-1).all()  # groups outside the top g never get a token
    product = torch.sigmoid(coarse_logits).gather(1, owner) * torch.sigmoid(logits).gather(1, indices)
    torch.testing.assert_close(weights, product / product.sum(-1, keepdim=True), rtol=1e-12, atol=0)
    top_g = torch.topk(torch.sigmoid(coarse_logits) + router.coarse_gate.e_score_correction_bias, 2).indices
    assert torch.equal(groups.sort(-1).values, top_g.sort(-1).values)


# ---------------------------------------------------------------------------------------------------------------------
# Dynamic k (the mean count under Quantile Balancing is in tests/policies/test_quantile_balancing.py)
# ---------------------------------------------------------------------------------------------------------------------
def test_dynamic_routes_take_every_expert_above_zero_within_the_bounds():
    router = KimiK3DynamicTopkRouter(tiny_config(**VARIANTS["dynamic_k"]))
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.copy_(torch.linspace(-0.9, -0.2, 8))
    tokens = torch.randn(300, 32)
    logits, weights, indices = router(tokens)
    biased = torch.sigmoid(logits) + router.e_score_correction_bias
    used = indices < 8
    counts = used.sum(-1)
    assert counts.min() >= 1 and counts.max() <= 4 and len(set(counts.tolist())) > 1
    above = (biased > 0).sum(-1)
    assert torch.equal(counts, above.clamp(1, 4))
    assert torch.equal(weights == 0, ~used)
    torch.testing.assert_close(weights.sum(-1), torch.ones(300))


def test_varying_count_experts_equal_a_loop_over_each_tokens_experts():
    config = tiny_config(**VARIANTS["dynamic_k"])
    experts = KimiK3VaryingCountExperts(config).double()
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.3)
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randn(9, 24, generator=generator, dtype=torch.float64)
    indices = torch.stack([torch.randperm(8, generator=generator)[:4] for _ in range(9)])
    indices[torch.rand(9, 4, generator=generator) < 0.4] = 8
    indices[:, 0] = indices[:, 0].clamp(max=7)
    weights = torch.rand(9, 4, generator=generator, dtype=torch.float64) * (indices < 8)
    expected = torch.zeros_like(tokens)
    for t in range(9):
        for slot in range(4):
            e = int(indices[t, slot])
            if e < 8:
                gate, up = (experts.gate_up_proj[e] @ tokens[t]).chunk(2)
                expected[t] += weights[t, slot] * (experts.down_proj[e] @ experts.glu(gate, up))
    for implementation in ("eager", "batched_mm"):
        experts.config._experts_implementation = implementation
        torch.testing.assert_close(experts(tokens, indices, weights), expected, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------------------
# Every variant: generation with the cache, the router's class, reloading in a fresh process
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_greedy_generation_equals_repeated_full_forwards(variant):
    model = variant_model(eos_token_id=None, **VARIANTS[variant])  # no early stop: every step is compared
    ids = torch.randint(3, 97, (2, 7))
    generated = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    greedy = ids
    with torch.no_grad():
        for _ in range(6):
            greedy = torch.cat([greedy, model(greedy, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, greedy)


def test_only_the_enabled_variants_replace_released_modules():
    model = variant_model(**VARIANTS["attention_gate"])
    assert all(type(block.gate) is KimiK3TopkRouter for block in moe_blocks(model))
    assert "variants_kimi_k3" not in type(model.model.layers[4].self_attn.g_proj).__module__


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_released_classes_refuse_a_config_that_enables_a_variant(name):
    config = tiny_config(**VARIANTS[name])
    for released_class in (KimiK3ForCausalLM, KimiK3Model):
        with pytest.raises(ValueError, match=rf"^The config switches on .*\({next(iter(VARIANTS[name]))}\), which "
                                             rf"{released_class.__name__} does not build: use the variant classes"):
            released_class(config)
    assert type(KimiK3VariantModel(config).layers[1]).__name__ == "KimiK3VariantDecoderLayer"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (relative imports without their dots)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_shipped_model_files_never_import_the_variants_which_import_them():
    shipped_files = ("modeling_kimi_k3.py", "configuration_kimi_k3.py", "checkpoint_format_kimi_k3.py", "kda_kimi_k3.py",
                     "loading_kimi_k3.py", "packing_kimi_k3.py")
    for shipped in shipped_files:
        imports = imported_modules(REPOSITORY / shipped)
        assert "variants_kimi_k3" not in imports and "kimi_k3" not in {name.split(".")[0] for name in imports}, shipped
    assert {"modeling_kimi_k3", "configuration_kimi_k3"} <= imported_modules(REPOSITORY / "variants_kimi_k3.py")
    assert "variants_kimi_k3" not in (REPOSITORY / "modeling_kimi_k3.py").read_text()


def test_a_folder_saved_from_the_released_model_carries_no_variant_code(tmp_path):
    variant_model().save_pretrained(tmp_path / "released")
    variant_model(**VARIANTS["two_level"]).save_pretrained(tmp_path / "variant")
    assert not (tmp_path / "released" / "variants_kimi_k3.py").exists()
    assert "variants_kimi_k3" not in (tmp_path / "released" / "config.json").read_text()
    auto_map = json.loads((tmp_path / "variant" / "config.json").read_text())["auto_map"]
    assert auto_map == {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                        "AutoModel": "variants_kimi_k3.KimiK3VariantModel",
                        "AutoModelForCausalLM": "variants_kimi_k3.KimiK3VariantForCausalLM"}


LOAD_IN_FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    for name in ("modeling_kimi_k3", "configuration_kimi_k3", "checkpoint_format_kimi_k3", "kda_kimi_k3", "loading_kimi_k3",
                 "packing_kimi_k3", "variants_kimi_k3", "kimi_k3"):
        sys.modules[name] = None  # any import of the installed project now fails
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    for folder in sys.argv[1:]:
        expected = load_file(f"{folder}/../expected.safetensors")
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        with torch.no_grad():
            assert torch.equal(model(expected["input_ids"]).logits, expected["logits"]), folder
        generated = model.generate(expected["input_ids"], max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(generated, expected["generated"]), folder
    print("ok")
    """
)


def test_saved_variant_folders_reload_through_trust_remote_code_in_a_fresh_process(tmp_path):
    folders = []
    # The three routing rules exclude each other; the other variants ride along.
    for name, fields in [("quantile+basis+gate", {**VARIANTS["quantile"], **VARIANTS["shared_basis"],
                                                  **VARIANTS["attention_gate"]}),
                         ("two_level+gate", {**VARIANTS["two_level"], **VARIANTS["attention_gate"]}),
                         ("dynamic_k+basis", {**VARIANTS["dynamic_k"], **VARIANTS["shared_basis"]})]:
        model = variant_model(**fields)
        folder = tmp_path / name / "model"
        model.save_pretrained(folder)
        assert (folder / "variants_kimi_k3.py").is_file()
        ids = torch.randint(3, 97, (2, 9))
        with torch.no_grad():
            expected = {"input_ids": ids, "logits": model(ids).logits,
                        "generated": model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)}
        from safetensors.torch import save_file

        save_file(expected, str(folder.parent / "expected.safetensors"))
        folders.append(str(folder))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-I", "-c", LOAD_IN_FRESH_PROCESS, *folders], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=HANG_CEILING_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.parametrize("sizes", [{"tp_size": 2}, {"ep_size": 2, "fsdp_size": 2}])
def test_tensor_and_expert_parallel_loading_of_a_variant_is_refused_while_the_model_is_built(sizes):
    from transformers.distributed import DistributedConfig

    config = tiny_config(**VARIANTS["two_level"])
    config.distributed_config = DistributedConfig(**sizes)  # what from_pretrained(distributed_config=...) sets first
    with pytest.raises(ValueError, match=r"^two-level routing \(num_coarse_experts\) has no tensor- or expert-parallel "
                                         r"plan: load it with tp_size=1 and ep_size=1"):
        KimiK3VariantForCausalLM(config)
    config.distributed_config = DistributedConfig(fsdp_size=2)
    KimiK3VariantForCausalLM(config)  # FSDP shards any parameter

"""What Hugging Face users reach for: accelerate offload, PEFT LoRA, 16-bit casts, attention maps, cache kinds."""

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import StaticCache

from kimi_k3.optim.muon import PerHeadMuon
from kimi_k3.attachments.seams import find_routers
from kimi_k3.policies.quantile_balancing import QuantileBalancing, QuantileBalancingCallback
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config
from tests.numerics import assert_as_accurate, float64_copy
from tests.test_modeling import build


@pytest.fixture
def model() -> KimiK3ForCausalLM:
    return build(dtype=torch.float32)


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))


def test_disk_offloaded_layers_give_the_plain_models_logits(model, ids, tmp_path):
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map |= {"model.output_attn_res_proj": "disk", "model.output_attn_res_norm": "disk"}
    device_map |= {f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(model.config.num_hidden_layers)}
    offloaded = KimiK3ForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    assert offloaded.model.layers[3].self_attn.kv_b_proj.weight.device.type == "meta"  # an MLA layer on disk
    with torch.no_grad():
        assert torch.equal(offloaded(ids).logits, model(ids).logits)


def test_mla_absorbed_weights_come_through_the_projection_forward(model):
    attention = model.model.layers[3].self_attn
    latent = torch.zeros(1, 1, 1, attention.kv_lora_rank)
    key_weight, value_weight = attention.absorbed_weights(latent)
    weight = attention.kv_b_proj.weight.unflatten(0, (attention.num_heads, -1))
    assert torch.equal(torch.cat([key_weight, value_weight], dim=1), weight)


def test_lora_all_linear_trains_the_attn_res_pseudo_queries_and_merges_exactly(model, ids):
    config = LoraConfig(target_modules="all-linear", r=2, lora_alpha=4, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    wrapped = {name for name, module in peft_model.named_modules() if name.endswith("res_proj") and hasattr(module, "lora_A")}
    assert len(wrapped) == 2 * model.config.num_hidden_layers + 1
    peft_model(ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in peft_model.named_parameters() if "res_proj.lora_" in name}
    # Layer 0's mixer site has no snapshot to weigh yet, so it alone takes no gradient.
    assert sum(g is not None and g.abs().sum() > 0 for g in grads.values()) == 2 * (len(wrapped) - 1)
    peft_model.eval()
    with torch.no_grad():
        unmerged = peft_model(ids).logits
        merged_model = peft_model.merge_and_unload()
        merged, exact = merged_model(ids).logits, float64_copy(merged_model)(ids).logits
        assert (merged - model(ids).logits).abs().max() > 1e-3  # the adapters changed the model
    # Merging rounds W + BA once: the merged model is as accurate as the adapters applied on the fly.
    assert_as_accurate(merged, unmerged, exact, what="merged logits")


def test_sixteen_bit_casts_keep_the_precision_critical_tensors_fp32(model):
    bias = model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to(dtype=torch.bfloat16)):
        casted = cast(copy.deepcopy(model))
        for name, tensor in casted.state_dict().items():
            fp32 = any(key in name for key in ("A_log", "dt_bias", "conv1d", "o_norm", "e_score_correction_bias"))
            assert tensor.dtype == torch.float32 if fp32 else tensor.dtype != torch.float32, name
        assert torch.equal(casted.model.layers[1].block_sparse_moe.gate.e_score_correction_bias, bias)
    assert model.double().model.layers[1].self_attn.A_log.dtype == torch.float64  # casts up still apply


def test_construction_declares_fp32_for_the_kept_tensors():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = KimiK3ForCausalLM(tiny_config())
    finally:
        torch.set_default_dtype(default)
    layer = model.model.layers[1]
    assert layer.self_attn.A_log.dtype == layer.self_attn.q_conv1d.weight.dtype == torch.float32
    assert layer.block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16


def test_output_attentions_holds_the_mla_layers_maps_in_layer_order(model, ids):
    """As in transformers' hybrids (Qwen3-Next, Kimi Linear): KDA has no attention map, so only MLA layers add one."""
    model.set_attn_implementation("eager")
    attentions = model(ids, output_attentions=True).attentions
    mla_layers = [layer for layer in model.model.layers if layer.layer_type == "full_attention"]
    assert len(attentions) == len(mla_layers) == 3
    for layer, attention in zip(mla_layers, attentions):
        assert attention.shape == (2, model.config.num_attention_heads, 12, 12)
        torch.testing.assert_close(attention.sum(-1), torch.ones(2, model.config.num_attention_heads, 12))
    assert not torch.equal(attentions[0], attentions[1])
    assert model(ids).attentions is None


def test_static_cache_is_refused_naming_the_supported_cache(model, ids):
    refusal = r"DynamicCache.*got StaticCache.*'dynamic' \(or 'offloaded' on a CUDA device\)"
    for implementation in ("static", "sliding_window"):
        with pytest.raises(ValueError, match=refusal):
            model.generate(ids[:1], max_new_tokens=2, do_sample=False, cache_implementation=implementation)
    with pytest.raises(ValueError, match=refusal):
        model(ids, cache=StaticCache(config=model.config, max_cache_len=32), use_cache=True)
    assert model.generate(ids[:1], max_new_tokens=2, do_sample=False, cache_implementation="dynamic").shape == (1, 14)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for models off CUDA")
def test_offloaded_cache_off_cuda_fails_in_torch_rather_than_decoding(model, ids):
    """transformers' offloaded cache pages through CUDA streams; without a CUDA device torch refuses them."""
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|Stream"):  # +cpu and CUDA builds word it apart
        model.generate(ids[:1], max_new_tokens=2, do_sample=False, cache_implementation="offloaded")


def test_router_bias_survives_a_lora_adapter_round_trip_when_the_routers_are_saved_with_it(model, ids, tmp_path):
    model.save_pretrained(tmp_path / "base")
    with pytest.warns(UserWarning, match="modules_to_save=\\['gate'\\]"):
        QuantileBalancingCallback(get_peft_model(copy.deepcopy(model), LoraConfig(target_modules=["q_proj"], r=2)))
    config = LoraConfig(target_modules=["q_proj"], r=2, modules_to_save=["gate"])
    tuned = get_peft_model(KimiK3ForCausalLM.from_pretrained(tmp_path / "base"), config)
    balancing = QuantileBalancing(tuned)
    balancing.attach()
    before = find_routers(tuned)["layer_1"].e_score_correction_bias.clone()
    tuned.train()
    tuned(ids, labels=ids).loss.backward()
    balancing.update()
    assert not torch.equal(find_routers(tuned)["layer_1"].e_score_correction_bias, before)  # QB moved the bias
    tuned.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(KimiK3ForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(ids).logits, tuned.eval()(ids).logits)


def test_per_head_muon_refuses_lora_adapters_naming_them(model):
    tuned = get_peft_model(model, LoraConfig(target_modules=["q_proj"], r=2))
    with pytest.raises(ValueError, match=r"trains LoRA adapters \(e\.g\. .*lora_A.*AdamW"):
        PerHeadMuon.for_model(tuned)

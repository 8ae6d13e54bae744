"""What the model declares to transformers' weight-swapping quantizers and dtype plans: the AttnRes pseudo-queries,
which compute as an fp32 product and sum rather than a linear layer, are never quantized and stay fp32; `print(model)`
shows the MoE's sizes."""

import pytest
import torch
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3PseudoQuery
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def model():
    return KimiK3ForCausalLM(tiny_config())


def test_quantizers_skip_every_pseudo_query_and_convert_the_other_linear_layers(model):
    """The skip list as torchao's and bitsandbytes' quantizers build it, matched as they match it."""
    skipped = HfQuantizer.get_modules_to_not_convert(model, None, model._keep_in_fp32_modules)
    pseudo_queries = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, KimiK3PseudoQuery)}
    assert pseudo_queries  # one per AttnRes site
    linear = {f"{name}.weight" for name, module in model.named_modules()
              if type(module) is torch.nn.Linear and name != "lm_head"}  # fmt: skip
    assert not [name for name in pseudo_queries if should_convert_module(name, skipped)]
    assert all(should_convert_module(name, skipped) for name in linear)


def test_a_half_precision_load_keeps_the_pseudo_queries_in_fp32(model, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = KimiK3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)
    for name, module in loaded.named_modules():
        expected = torch.float32 if isinstance(module, KimiK3PseudoQuery) else torch.float16
        if type(module) in (KimiK3PseudoQuery, torch.nn.Linear):
            assert module.weight.dtype == expected, name


def test_torchao_int8_weight_only_model_runs_forward_and_generate(model, tmp_path):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    model.save_pretrained(tmp_path)
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path, trust_remote_code=True, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
    )
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = model(ids).logits
    logits = quantized(ids).logits
    assert torch.isfinite(logits).all() and logits.shape == reference.shape
    assert quantized.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)


def test_print_shows_the_expert_count_widths_and_top_k(model):
    text = str(model.model.layers[1].block_sparse_moe)
    assert "KimiK3TopkRouter(num_experts=8, top_k=2, hidden_size=32, score=sigmoid" in text
    assert "num_experts=8, hidden_dim=24, intermediate_dim=16" in text

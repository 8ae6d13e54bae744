"""One attachment protocol: every feature that acts on the model from outside (Quantile Balancing, QK-Clip, QAT, fused
SiTU-GLU and Block AttnRes, sorted experts) attaches through the model's seams and returns a handle; attached together they share one padding tracker
and never set the same attribute, a refused attachment leaves nothing behind, and removing them leaves the model
bitwise as it was."""

import pytest
import torch

from kimi_k3.attachments.handle import attribute_owners
from kimi_k3.attachments.seams import decoder_stack, find_mla_layers
from kimi_k3.kernels.fused_attention_residual import use_fused_attention_residuals
from kimi_k3.kernels.fused_situ import use_fused_situ
from kimi_k3.kernels.sorted_experts import use_sorted_experts
from kimi_k3.optim.muon import PerHeadMuon
from kimi_k3.policies.qk_clip import QKClip
from kimi_k3.policies.quantile_balancing import QuantileBalancing
from kimi_k3.quantization.qat import attach_qat
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config

# Expert input widths MXFP4 can group, so that QAT attaches too.
QAT_WIDTHS = {"routed_expert_hidden_size": 32, "moe_intermediate_size": 32}


def module_state(model) -> dict[str, dict[str, object]]:
    """Per module, every instance attribute by identity, and the entries of its dictionaries (parameters, buffers,
    submodules, every kind of hook) by identity: what attaching could add, replace or leave behind."""
    return {
        name: {
            key: tuple((entry, id(item)) for entry, item in value.items()) if isinstance(value, dict) else id(value)
            for key, value in vars(module).items()
        }
        for name, module in model.named_modules()
    }


def attach_everything(model, optimizer) -> list:
    return [
        use_fused_situ(model, min_elements=1),
        use_fused_attention_residuals(model, min_elements=1),
        use_sorted_experts(model),
        attach_qat(model, "mxfp4", activations="mxfp8"),
        QuantileBalancing(model).attach(optimizer),
        QKClip(model, tau=100.0).attach(optimizer),
    ]


def test_attaching_every_feature_then_removing_them_leaves_the_model_bitwise_as_before():
    model = KimiK3ForCausalLM(tiny_config(**QAT_WIDTHS)).eval()
    optimizer = PerHeadMuon.for_model(model, lr=1e-2)
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
    tensors = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    state = module_state(model)

    attachments = attach_everything(model, optimizer)
    model.train()
    model(ids, labels=ids).loss.backward()  # every hook, recorder and kernel runs
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, plain)  # QAT was on
    for attachment in attachments:  # in the order they were attached: they do not depend on each other
        attachment.remove()

    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain)
    assert tensors.keys() == model.state_dict().keys()
    assert all(torch.equal(tensors[name], tensor) for name, tensor in model.state_dict().items())
    assert module_state(model) == state
    assert not any(attribute_owners(module) for module in model.modules())
    assert not optimizer._optimizer_step_post_hooks


def test_attached_features_each_hold_their_own_attributes():
    model = KimiK3ForCausalLM(tiny_config(**QAT_WIDTHS))
    attach_everything(model, PerHeadMuon.for_model(model, lr=1e-2))
    layer = model.model.layers[1].block_sparse_moe
    assert attribute_owners(layer.experts.glu) == {"forward": "fused SiTU-GLU"}
    assert attribute_owners(model.model.layers[1]) == {"attention_residual": "fused Block AttnRes"}
    assert attribute_owners(layer.experts) == {"forward": "sorted experts", "gate_up_proj": "QAT mxfp4",
                                               "down_proj": "QAT mxfp4"}
    assert all(attribute_owners(attn) == {"query_key_observer": "QK-Clip"} for attn in find_mla_layers(model).values())


def test_a_second_feature_setting_an_attribute_is_refused_naming_both():
    model = KimiK3ForCausalLM(tiny_config())
    first = QKClip(model, tau=100.0).attach()
    with pytest.raises(ValueError, match="QK-Clip cannot set KimiK3MLAAttention.query_key_observer: QK-Clip holds it"):
        QKClip(model, tau=50.0).attach()
    first.remove()
    # The refused attachment took back what it had attached before the refusal: no padding hook is left.
    assert not decoder_stack(model)._forward_pre_hooks and not any(attribute_owners(m) for m in model.modules())
    QKClip(model, tau=50.0).attach().remove()  # free again once the first is removed
    balancing = QuantileBalancing(model)
    with balancing.attach(), pytest.raises(ValueError, match="already attached; remove that attachment first"):
        balancing.attach()


def test_every_recorder_reads_one_padding_tracker_per_model():
    model = KimiK3ForCausalLM(tiny_config())
    stack = decoder_stack(model)
    for _ in range(3):  # building optimizers attaches nothing
        PerHeadMuon.for_model(model, lr=1e-2)
    assert not stack._forward_pre_hooks
    balancing, clipping = QuantileBalancing(model).attach(), QKClip(model, tau=100.0).attach()
    assert len(stack._forward_pre_hooks) == 1
    balancing.remove()
    assert len(stack._forward_pre_hooks) == 1  # QK-Clip still reads it
    clipping.remove()
    assert not stack._forward_pre_hooks

"""Per-Head Muon on the vision-language model: the tower's q/k/v per head, its other matrices and the projector whole,
its patch embedding and position table with AdamW; the language model's groups as for the text model."""

import torch

from kimi_k3.optim.muon import PerHeadMuon, build_param_groups
from modeling_kimi_k3 import KimiK3ForCausalLM
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration
from tests.test_modeling_vision import PLACEHOLDER, pixels_for, tiny_vl_config


def groups_by_name(model) -> dict[str, dict]:
    return {
        name: {key: value for key, value in group.items() if key not in ("params", "param_names")}
        for group in build_param_groups(model)
        for name in group["param_names"]
    }


def test_tower_attention_is_orthogonalised_per_head_and_other_matrices_whole():
    model = KimiK3ForConditionalGeneration(tiny_vl_config())
    groups = groups_by_name(model)
    head_dim = model.config.vision_config.head_dim
    block = "vision_tower.encoder.blocks.1."
    assert groups[block + "wqkv.weight"] == {"use_muon": True, "head_rows": head_dim, "weight_decay": 0.1}
    for whole in (block + "wo.weight", block + "mlp.fc0.weight", "mm_projector.proj.0.weight", "mm_projector.proj.2.weight"):
        assert groups[whole] == {"use_muon": True, "weight_decay": 0.1}, whole
    for adamw in ("vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight"):
        assert groups[adamw] == {"use_muon": False, "weight_decay": 0.1}, adamw
    assert groups[block + "norm0.weight"] == {"use_muon": False, "weight_decay": 0.0}
    text = groups_by_name(KimiK3ForCausalLM(model.config))
    assert {name: group for name, group in groups.items() if name.startswith("language_model.")} == {
        f"language_model.{name}": group for name, group in text.items()
    }


def test_one_step_changes_each_q_k_v_head_by_its_own_gradient_alone():
    model = KimiK3ForConditionalGeneration(tiny_vl_config())
    optimizer = PerHeadMuon.for_model(model, lr=0.01)
    wqkv = model.get_parameter("vision_tower.encoder.blocks.0.wqkv.weight")
    head_dim = model.config.vision_config.head_dim
    pixel_values, grid_thws = pixels_for([(1, 4, 4)])
    input_ids = torch.tensor([[5, PLACEHOLDER, 6]])
    model(input_ids=input_ids, pixel_values=pixel_values, grid_thws=grid_thws, labels=input_ids).loss.backward()
    before, gradient = wqkv.detach().clone(), wqkv.grad.clone()
    with torch.no_grad():
        wqkv.grad[head_dim:] *= 1000  # every head but the first query head
    optimizer.step()
    scaled_first_head = wqkv.detach()[:head_dim].clone()
    with torch.no_grad():
        wqkv.copy_(before)
    wqkv.grad = gradient
    optimizer = PerHeadMuon.for_model(model, lr=0.01)
    optimizer.step()
    assert torch.equal(wqkv.detach()[:head_dim], scaled_first_head)
    assert not torch.equal(wqkv.detach()[:head_dim], before[:head_dim])

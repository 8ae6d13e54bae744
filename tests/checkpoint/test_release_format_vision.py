"""The released vision-language layout: our folder exports to it with its vision tensors dense and under the released
names, the vision-language model loads it back with equal logits, it imports back to our layout, and the text-only
class still loads it, naming the skipped vision tensors once."""

import json
import logging
from pathlib import Path

import pytest
import torch

from kimi_k3.checkpoint.convert import main as convert_main
from modeling_kimi_k3 import KimiK3ForCausalLM
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration
from tests.checkpoint.test_release_format import MXFP4_SHAPES, mxfp4_representable_, tensor_shapes
from tests.conftest import tiny_config
from tests.test_modeling_vision import PLACEHOLDER, pixels_for, randomize_
from configuration_kimi_k3_vision import KimiK3VisionConfig


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Our tiny VL model (experts exactly representable in MXFP4), its folder, and its released export."""
    vision = KimiK3VisionConfig.tiny(32, media_placeholder_token_id=PLACEHOLDER)
    config = tiny_config(**MXFP4_SHAPES, vision_config=vision.to_dict())
    model = mxfp4_representable_(randomize_(KimiK3ForConditionalGeneration(config))).eval()
    ours, released = tmp_path_factory.mktemp("ours"), tmp_path_factory.mktemp("released")
    model.save_pretrained(ours)
    convert_main(["to-release", str(ours), str(released), "--max_shard_size", "20KB", "--no_progress"])
    return model, ours, released


def image_logits(model) -> torch.Tensor:
    pixel_values, grid_thws = pixels_for([(1, 4, 6)])
    input_ids = torch.tensor([[5, PLACEHOLDER, 6, 7]])
    with torch.no_grad():
        return model(input_ids=input_ids, pixel_values=pixel_values, grid_thws=grid_thws).logits


def test_export_writes_the_released_wrapper_and_dense_vision_tensors(folders):
    model, ours, released = folders
    config = json.loads((released / "config.json").read_text())
    assert config["vision_config"]["vt_hidden_size"] == 64 and "vision_config" not in config["text_config"]
    assert config["media_placeholder_token_id"] == PLACEHOLDER and config["ignore_index"] == -100
    assert config["auto_map"]["AutoModelForImageTextToText"] == "modeling_kimi_k3_vision.KimiK3ForConditionalGeneration"
    assert (released / "modeling_kimi_k3_vision.py").exists() and (released / "processing_kimi_k3.py").exists()
    stored = tensor_shapes(released)
    vision = {name: shape for name, (shape, _) in stored.items() if name.startswith(("vision_tower.", "mm_projector."))}
    assert vision == {
        name: tuple(tensor.shape)
        for name, tensor in model.state_dict().items()
        if name.startswith(("vision_tower.", "mm_projector."))
    }
    assert all(dtype == "F32" for name, (_, dtype) in stored.items() if name in vision)  # dense, as saved
    assert any(name.endswith("experts.0.w1.weight_packed") for name in stored)
    assert all(name.startswith(("language_model.", "vision_tower.", "mm_projector.")) for name in stored)


def test_released_vl_folder_loads_with_its_vision_tensors(folders):
    model, _, released = folders
    loaded = KimiK3ForConditionalGeneration.from_pretrained(released).eval()
    assert torch.equal(image_logits(loaded), image_logits(model))


def test_released_vl_folder_imports_back_to_our_layout(folders, tmp_path):
    model, ours, released = folders
    convert_main(["from-release", str(released), str(tmp_path / "back"), "--no_progress"])
    assert set(tensor_shapes(tmp_path / "back")) == set(tensor_shapes(ours))
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [
        "KimiK3ForConditionalGeneration"
    ]
    loaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    assert torch.equal(image_logits(loaded), image_logits(model))


def test_text_only_class_loads_the_vl_folder_naming_the_vision_tensors_once(folders, caplog):
    model, _, released = folders
    ids = torch.tensor([[5, 6, 7, 8]])
    with caplog.at_level(logging.INFO):
        text_model = KimiK3ForCausalLM.from_pretrained(released).eval()
    mentions = [record.getMessage() for record in caplog.records if "vision_tower" in record.getMessage()]
    assert mentions == [
        "Skipping the multimodal part of the checkpoint (the text model has no use for it): "
        "15 vision_tower.* tensors, 3 mm_projector.* tensors."
    ]
    with torch.no_grad():
        assert torch.equal(text_model(ids).logits, model.language_model(ids).logits)


def test_vl_model_refuses_a_folder_without_its_vision_tensors(folders, tmp_path):
    model, _, _ = folders
    model.language_model.save_pretrained(tmp_path)
    config = json.loads(Path(tmp_path / "config.json").read_text())
    assert "vision_config" in config  # the text part saved from a VL model keeps the vision config
    with pytest.raises(ValueError, match="missing vision_tower.patch_embed.proj.weight"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path)

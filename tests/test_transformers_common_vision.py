"""transformers' own model tests (`ModelTesterMixin`, `TrainingTesterMixin`) for the vision-language model, run on a
tiny K3 with a two-block tower the way transformers runs them for its own vision-language models.

`KIMI_K3_VL_SKIPPED` lists every mixin test skipped here, with its reason; nothing else is changed.
"""

import os
import unittest

import pytest
import torch

from configuration_kimi_k3 import KimiK3Config
from configuration_kimi_k3_vision import KimiK3VisionConfig
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration
from tests.conftest import TINY_CONFIG
from tests.transformers_suite import SuiteUnavailable, import_suite

try:
    import_suite()
except SuiteUnavailable as unavailable:
    if os.environ.get("KIMI_K3_REQUIRE_TRANSFORMERS_SUITE"):
        raise
    pytest.skip(f"transformers' model tests are not available here: {unavailable}", allow_module_level=True)

from transformers.models.auto import modeling_auto  # noqa: E402
from transformers_tests.test_modeling_common import ModelTesterMixin, ids_tensor  # noqa: E402
from transformers_tests.test_training_mixin import TrainingTesterMixin  # noqa: E402

from tests.mixin_overrides import KimiK3MixinOverrides  # noqa: E402

PLACEHOLDER = 96


class KimiK3VisionModelTester:
    """Two samples, each with one 56 x 28-pixel image (4 x 2 patches, two tokens) at its second position."""

    def __init__(self, parent, batch_size=2, seq_length=7, is_training=True):
        self.parent, self.batch_size, self.seq_length, self.is_training = parent, batch_size, seq_length, is_training
        self.config_kwargs = {**TINY_CONFIG, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                              "attn_res_block_size": 1, "pad_token_id": 0}
        self.vocab_size = TINY_CONFIG["vocab_size"]
        self.hidden_size = TINY_CONFIG["hidden_size"]
        self.num_hidden_layers = 2
        self.num_attention_heads = TINY_CONFIG["num_attention_heads"]
        self.expected_num_hidden_layers = self.num_hidden_layers + 1

    def get_config(self) -> KimiK3Config:
        vision = KimiK3VisionConfig.tiny(self.hidden_size, media_placeholder_token_id=PLACEHOLDER)
        return KimiK3Config(**self.config_kwargs, vision_config=vision.to_dict())

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 1)  # never the placeholder
        input_ids[:, 1] = PLACEHOLDER
        grid_thws = torch.tensor([[1, 4, 2]] * self.batch_size)
        pixel_values = torch.randn(int(grid_thws.prod(-1).sum()), 3, 14, 14)
        inputs = {"input_ids": input_ids, "pixel_values": pixel_values, "grid_thws": grid_thws,
                  "attention_mask": torch.ones_like(input_ids)}
        return self.get_config(), inputs


@pytest.fixture(autouse=True, scope="module")
def listed_in_transformers_tables():
    """The mixins give labels to the classes transformers' own tables list (a built-in model is listed there)."""
    table = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    previous = table.get(KimiK3Config.model_type)
    table[KimiK3Config.model_type] = "KimiK3ForConditionalGeneration"
    yield
    if previous is None:
        del table[KimiK3Config.model_type]
    else:
        table[KimiK3Config.model_type] = previous


GROWS = "the merge grows each sequence by n_tokens - 1 per image (the release's LLaVA merge), so hidden states are " \
        "longer than input_ids, and input_ids must hold the placeholders"
FEATURES = "get_image_features returns each image's projected tokens (the release's interface), not transformers' " \
           "newer BaseModelOutputWithPooling with the tower's hidden states and attentions"
KIMI_K3_VL_SKIPPED = {
    "test_generation_tester_mixin_inheritance": "GenerationTesterMixin is a stand-in here (the sdist ships no "
    "tests/generation); cached generation with images is tests/test_modeling_vision.py",
    "test_hidden_states_output": GROWS,
    "test_attention_outputs": GROWS,
    "test_inputs_embeds": GROWS + " (inputs_embeds alone cannot say where the images go)",
    "test_resize_tokens_embeddings": GROWS + " (the mixin redraws input_ids without them)",
    "test_multimodal_outputs_are_returned": FEATURES,
    "test_get_image_features_attentions": FEATURES,
    "test_get_image_features_hidden_states": FEATURES,
    "test_get_image_features_output_0": FEATURES,
    "test_get_image_features_output_1": FEATURES,
    "test_get_image_features_output_2": FEATURES,
    "test_can_load_from_already_mapped_keys": "fused expert tensors saved under language_model. "
    "(save_original_format=False) are not recognised by strict loading yet; the per-expert layout save_pretrained "
    "writes by default loads (tests/test_remote_code_vision.py)",
    "test_resize_embeddings_untied": GROWS + " (the mixin redraws input_ids without them)",
}


class KimiK3VisionModelTest(KimiK3MixinOverrides, ModelTesterMixin, TrainingTesterMixin, unittest.TestCase):
    model_tester_class = KimiK3VisionModelTester
    all_model_classes = (KimiK3ForConditionalGeneration,)
    test_all_params_have_gradient = False  # as for the text classes: first-layer AttnRes queries, idle experts
    test_can_init_all_missing_weights_before_2023 = True


# Some of these mixin tests are younger than the lowest supported transformers: skip the ones this release has.
for _name, _reason in KIMI_K3_VL_SKIPPED.items():
    if hasattr(KimiK3VisionModelTest, _name):
        setattr(KimiK3VisionModelTest, _name, unittest.skip(_reason)(getattr(KimiK3VisionModelTest, _name)))

"""transformers' own model tests (`ModelTesterMixin`, `ConfigTester`, `TrainingTesterMixin`), from the test sources
of the installed transformers release, run against a tiny K3 the way transformers runs them for each of its models.

`KIMI_K3_SKIPPED` lists every mixin test skipped here and `KIMI_K3_OVERRIDDEN` every one replaced, each with its
reason; nothing else is changed.
"""

import copy
import os
import tempfile
import unittest
from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest
import torch

from configuration_kimi_k3 import RELEASED_LINEAR_ATTN_KEYS, KimiK3Config
from kimi_k3.checkpoint.auto_classes import register_auto_classes
from modeling_kimi_k3 import (
    KimiK3ForCausalLM,
    KimiK3ForSequenceClassification,
    KimiK3ForTokenClassification,
    KimiK3Model,
)
from tests.conftest import TINY_CONFIG
from tests.mixin_overrides import KimiK3MixinOverrides, lenient_loading
from tests.transformers_suite import SuiteUnavailable, import_suite

try:
    import_suite()
except SuiteUnavailable as unavailable:
    if os.environ.get("KIMI_K3_REQUIRE_TRANSFORMERS_SUITE"):
        raise
    pytest.skip(f"transformers' model tests are not available here: {unavailable}", allow_module_level=True)

from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers_tests.test_configuration_common import ConfigTester  # noqa: E402
from transformers_tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask  # noqa: E402
from transformers_tests.test_training_mixin import TrainingTesterMixin  # noqa: E402

# transformers decides what some mixin tests do from its own model-name tables (which class is a model's base, which
# get labels); a built-in model is listed there, and a remote-code model is listed for the duration of these tests.
NAME_TABLES = [
    (modeling_auto.MODEL_MAPPING_NAMES, "KimiK3Model"),
    (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "KimiK3ForCausalLM"),
    (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "KimiK3ForSequenceClassification"),
    (modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, "KimiK3ForTokenClassification"),
]


@pytest.fixture(autouse=True, scope="module")
def listed_in_transformers_tables():
    for table, name in NAME_TABLES:
        table[KimiK3Config.model_type] = name
    yield
    for table, _ in NAME_TABLES:
        del table[KimiK3Config.model_type]


class KimiK3ModelTester:
    """Inputs and a config for the mixins: two layers that take all four paths of the decoder layer (KDA with the
    dense MLP, then MLA with the latent MoE and shared experts), with Block Attention Residuals between them."""

    base_model_class = KimiK3Model
    causal_lm_class = KimiK3ForCausalLM

    def __init__(self, parent, batch_size=2, seq_length=7, is_training=True):
        self.parent, self.batch_size, self.seq_length, self.is_training = parent, batch_size, seq_length, is_training
        self.config_kwargs = {**TINY_CONFIG, "num_hidden_layers": 2,
                              "layer_types": ["linear_attention", "full_attention"],
                              "attn_res_block_size": 1, "pad_token_id": 0}
        self.vocab_size = self.config_kwargs["vocab_size"]
        self.hidden_size = self.config_kwargs["hidden_size"]
        self.num_hidden_layers = self.config_kwargs["num_hidden_layers"]
        self.num_attention_heads = self.config_kwargs["num_attention_heads"]
        self.expected_num_hidden_layers = self.num_hidden_layers + 1

    def get_config(self) -> KimiK3Config:
        return KimiK3Config(**self.config_kwargs)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


@contextmanager
def registered_with_auto_classes():
    """The Kimi K3 classes in transformers' Auto mappings for the duration, as `register_auto_classes` puts them: some
    mixin tests load through the Auto classes without remote code. Other tests then see the mappings unchanged."""
    mappings = [CONFIG_MAPPING, modeling_auto.MODEL_MAPPING, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING,
                modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
                modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING]
    with ExitStack() as stack:
        for mapping in mappings:
            stack.enter_context(mock.patch.dict(mapping._extra_content))
        register_auto_classes()
        yield


class KimiK3ConfigTest(unittest.TestCase):
    def test_config(self):
        # The tester finds each keyword in config.json, which nests the KDA fields in the release's layout.
        released = {key: value for key, value in TINY_CONFIG.items() if key not in RELEASED_LINEAR_ATTN_KEYS.values()}
        released["linear_attn_config"] = KimiK3Config.tiny().to_dict()["linear_attn_config"]
        ConfigTester(self, config_class=KimiK3Config, **released).run_common_tests()


KIMI_K3_SKIPPED = {
    "test_generation_tester_mixin_inheritance": (
        "the release's sdist ships no tests/generation, so GenerationTesterMixin is a stand-in here; generation "
        "(greedy, sampling, beams, cache == no cache, left padding, cache kinds) is tests/test_generation.py"
    ),
}
KIMI_K3_OVERRIDDEN = {
    "test_correct_missing_keys": "loading is strict by default: the mixin's check runs with strict=False, and the "
    "strict default is checked to refuse the same folder naming the head",
    "test_base_model_prefix_loads_base_weights": "as test_correct_missing_keys (a base folder lacks lm_head)",
    "test_model_weights_reload_no_missing_tied_weights": "as test_correct_missing_keys (the folder holds no weight)",
    "test_can_init_all_missing_weights": "as test_correct_missing_keys (the folder holds no weight)",
    "test_load_with_mismatched_shapes": "loads through the Auto classes without remote code, so the Kimi K3 classes "
    "are registered with them first (`register_auto_classes`); lenient as test_correct_missing_keys",
    "test_can_load_ignoring_mismatched_shapes": "as test_correct_missing_keys: strict loading refuses a head of "
    "another shape with a ValueError naming it (transformers raises RuntimeError); with ignore_mismatched_sizes=True "
    "the strict default reinitialises it, as transformers does",
    "test_attention_outputs": "KDA layers have no attention map: one map per MLA layer, as transformers' hybrids "
    "(Qwen3-Next, Kimi Linear) override it",
}


class KimiK3ModelTest(KimiK3MixinOverrides, ModelTesterMixin, TrainingTesterMixin, unittest.TestCase):
    model_tester_class = KimiK3ModelTester
    all_model_classes = (KimiK3Model, KimiK3ForCausalLM, KimiK3ForSequenceClassification, KimiK3ForTokenClassification)
    # The first layer's Block Attention Residual pseudo-queries weigh a single source (the embeddings), so the
    # released checkpoint holds them but they get no gradient there; routed experts that receive no token get none.
    test_all_params_have_gradient = False
    # `_init_weights` initialises every parameter and buffer (the flag lets the mixin check that for this model).
    test_can_init_all_missing_weights_before_2023 = True

    def test_correct_missing_keys(self):
        super().test_correct_missing_keys()
        self.assert_strict_loading_refuses_a_base_folder()

    def test_base_model_prefix_loads_base_weights(self):
        with lenient_loading():
            super().test_base_model_prefix_loads_base_weights()
        self.assert_strict_loading_refuses_a_base_folder()

    def test_load_with_mismatched_shapes(self):
        with registered_with_auto_classes(), lenient_loading():
            super().test_load_with_mismatched_shapes()

    def test_can_load_ignoring_mismatched_shapes(self):
        with lenient_loading():
            super().test_can_load_ignoring_mismatched_shapes()
        with tempfile.TemporaryDirectory() as folder:
            KimiK3ForSequenceClassification(self.model_tester.get_config()).save_pretrained(folder)  # 2 labels
            with self.assertRaisesRegex(ValueError, r"score.weight: expected shape \[5, 32\], found \[2, 32\]"):
                KimiK3ForSequenceClassification.from_pretrained(folder, num_labels=5)
            model = KimiK3ForSequenceClassification.from_pretrained(folder, num_labels=5, ignore_mismatched_sizes=True)
            self.assertEqual(tuple(model.score.weight.shape), (5, 32))

    def test_attention_outputs(self):
        """MLA layers return attention maps and KDA layers none, as in transformers' hybrids (Qwen3-Next, Kimi
        Linear): the maps are one per MLA layer, each a softmax over the keys, whether asked for by argument or by
        config, and last among the outputs."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config._attn_implementation = "eager"
        seq_length = self.model_tester.seq_length
        mla_layers = config.layer_types.count("full_attention")
        for model_class in self.all_model_classes:
            model = model_class._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
            with torch.no_grad():
                plain = model(**inputs)
                by_argument = model(**inputs, output_attentions=True)
                model.config.output_attentions = True
                by_config = model(**inputs)
                with_hidden_states = model(**inputs, output_hidden_states=True)
            for outputs in (by_argument, by_config):
                self.assertEqual(len(outputs.attentions), mla_layers)
                for attention in outputs.attentions:
                    shape = (self.model_tester.batch_size, config.num_attention_heads, seq_length, seq_length)
                    self.assertEqual(tuple(attention.shape), shape)
                    torch.testing.assert_close(attention.sum(-1), torch.ones(shape[:-1]))
                self.assertEqual(len(outputs), len(plain) + 1)
            self.assertEqual(len(with_hidden_states), len(plain) + 2)
            self.assertIs(with_hidden_states[-1], with_hidden_states.attentions)

    def assert_strict_loading_refuses_a_base_folder(self):
        with tempfile.TemporaryDirectory() as folder:
            KimiK3Model(self.model_tester.get_config()).save_pretrained(folder)
            with self.assertRaisesRegex(ValueError, r"1 text tensor\(s\) do not match the model: missing lm_head"):
                KimiK3ForCausalLM.from_pretrained(folder)


for _name, _reason in KIMI_K3_SKIPPED.items():
    setattr(KimiK3ModelTest, _name, unittest.skip(_reason)(getattr(ModelTesterMixin, _name)))

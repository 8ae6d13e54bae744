"""Saved folders without ``trust_remote_code``: the installed model files in transformers' Auto mappings.

Remote code needs nothing of this (a folder names its classes in ``auto_map``), so it lives in the package rather
than in the files every folder carries.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from configuration_kimi_k3 import KimiK3Config
from modeling_kimi_k3 import (
    KimiK3ForCausalLM,
    KimiK3ForSequenceClassification,
    KimiK3ForTokenClassification,
    KimiK3Model,
)
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration


def register_auto_classes() -> None:
    """Make ``AutoConfig`` and the Auto model classes (base, causal LM, sequence and token classification, image-text
    to text) resolve ``model_type="kimi_k3"`` to the installed model files."""
    AutoConfig.register(KimiK3Config.model_type, KimiK3Config, exist_ok=True)
    AutoModel.register(KimiK3Config, KimiK3Model, exist_ok=True)
    AutoModelForCausalLM.register(KimiK3Config, KimiK3ForCausalLM, exist_ok=True)
    AutoModelForSequenceClassification.register(KimiK3Config, KimiK3ForSequenceClassification, exist_ok=True)
    AutoModelForTokenClassification.register(KimiK3Config, KimiK3ForTokenClassification, exist_ok=True)
    AutoModelForImageTextToText.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)

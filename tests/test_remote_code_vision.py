"""A saved vision-language folder (model and processor) loads as ``trust_remote_code`` in a fresh interpreter where
this project is not importable, and reproduces the logits and the greedy generation with an image."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText

from kimi_k3.checkpoint.auto_classes import register_auto_classes
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration
from processing_kimi_k3 import KimiK3ImageProcessor, KimiK3Processor
from tests.conftest import HANG_CEILING_S
from tests.test_modeling_vision import randomize_, tiny_vl_config
from tests.test_processing import word_tokenizer

LOAD_IN_FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    for name in ("modeling_kimi_k3", "modeling_kimi_k3_vision", "configuration_kimi_k3", "configuration_kimi_k3_vision",
                 "checkpoint_format_kimi_k3", "processing_kimi_k3", "variants_kimi_k3", "kimi_k3"):
        sys.modules[name] = None  # any import of the installed project now fails
    import numpy as np
    import torch
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder, expected = sys.argv[1], load_file(sys.argv[2])
    model = AutoModelForImageTextToText.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    image = Image.fromarray(expected["image"].numpy())
    inputs = processor(images=[image], text=["a photo of <|media_pad|>"])
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, expected["generated"]), (generated, expected["generated"])
    print("ok")
    """
)


def test_fresh_process_without_the_package_reproduces_logits_with_an_image(tmp_path):
    folder = tmp_path / "model"
    config = tiny_vl_config("sdpa")  # what from_pretrained picks in the fresh process
    config.vision_config.media_placeholder_token_id = 6  # the word tokenizer's <|media_pad|>
    model = randomize_(KimiK3ForConditionalGeneration(config)).eval()
    processor = KimiK3Processor(KimiK3ImageProcessor(), word_tokenizer())
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["vision_config"]["media_placeholder_token_id"] == 6
    assert saved["auto_map"]["AutoModelForImageTextToText"] == "modeling_kimi_k3_vision.KimiK3ForConditionalGeneration"
    assert {"modeling_kimi_k3_vision.py", "configuration_kimi_k3_vision.py", "processing_kimi_k3.py"} <= set(
        os.listdir(folder)
    )
    image = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    inputs = processor(images=[Image.fromarray(image)], text=["a photo of <|media_pad|>"])
    with torch.no_grad():
        expected = {
            "image": torch.from_numpy(image),
            "pixel_values": inputs["pixel_values"],
            "logits": model(**inputs).logits,
            "generated": model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=0),
        }
    save_file(expected, str(tmp_path / "expected.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-I", "-c", LOAD_IN_FRESH_PROCESS, str(folder), str(tmp_path / "expected.safetensors")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_CEILING_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_registered_auto_class_loads_a_vl_folder_without_remote_code(tmp_path):
    model = KimiK3ForConditionalGeneration(tiny_vl_config()).eval()
    model.save_pretrained(tmp_path)
    register_auto_classes()
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert type(loaded) is KimiK3ForConditionalGeneration
    assert all(torch.equal(tensor, model.state_dict()[name]) for name, tensor in loaded.state_dict().items())

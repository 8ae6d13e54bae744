"""Saved folders load as ``trust_remote_code`` in a fresh interpreter where this project is not importable."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import modeling_kimi_k3
from kimi_k3.checkpoint.auto_classes import register_auto_classes
from kimi_k3.checkpoint.release_format import export_released
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import HANG_CEILING_S, tiny_config
from tests.checkpoint.test_release_format import MXFP4_SHAPES, mxfp4_representable_

LOAD_IN_FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    import warnings
    for name in ("modeling_kimi_k3", "configuration_kimi_k3", "checkpoint_format_kimi_k3", "kda_kimi_k3", "loading_kimi_k3",
                 "packing_kimi_k3", "kimi_k3"):
        sys.modules[name] = None  # any import of the installed project now fails
    for category in (FutureWarning, DeprecationWarning):  # deprecations raised from the model files are errors
        warnings.filterwarnings("error", category=category, module=r"transformers_modules\\.")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    folder, expected = sys.argv[1], load_file(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    assert type(AutoConfig.from_pretrained(folder, trust_remote_code=True)).__name__ == "KimiK3Config"
    base = AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert type(base).__name__ == "KimiK3Model", type(base).__name__
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
    generated = model.generate(expected["input_ids"], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, expected["generated"])
    greedy = expected["input_ids"]  # the same six tokens by repeated full forwards, without any cache
    with torch.no_grad():
        for _ in range(6):
            greedy = torch.cat([greedy, model(greedy, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, greedy), (generated, greedy)
    print("ok")
    """
)


def save_with_expected_outputs(model: KimiK3ForCausalLM, folder) -> None:
    """``model.save_pretrained(folder)`` and, beside the folder, the logits and greedy generation it must reproduce."""
    model.save_pretrained(folder)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        expected = {
            "input_ids": ids,
            "logits": model(ids).logits,
            "generated": model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0),
        }
    save_file(expected, str(folder.parent / "expected.safetensors"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3-tiny") / "model"
    save_with_expected_outputs(KimiK3ForCausalLM(tiny_config()).eval(), folder)
    return folder


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A released-layout folder (wrapper config, `language_model.` names, MXFP4 experts) with our code beside it."""
    root = tmp_path_factory.mktemp("k3-released")
    model = mxfp4_representable_(KimiK3ForCausalLM(tiny_config(**MXFP4_SHAPES))).eval()  # exported losslessly
    save_with_expected_outputs(model, root / "ours")
    folder = root / "model"
    export_released(root / "ours", folder, progress=False)  # writes our code and auto_map beside the weights
    return folder


def test_saved_folder_holds_code_config_weights_and_auto_map(saved):
    files = sorted(os.listdir(saved))
    assert files == [
        "checkpoint_format_kimi_k3.py",
        "config.json",
        "configuration_kimi_k3.py",
        "configuration_kimi_k3_vision.py",  # imported by the configuration, for a vision_config
        "generation_config.json",
        "kda_kimi_k3.py",
        "loading_kimi_k3.py",
        "model.safetensors",
        "modeling_kimi_k3.py",
        "packing_kimi_k3.py",
    ]
    config = json.loads((saved / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_kimi_k3.KimiK3Config",
        "AutoModel": "modeling_kimi_k3.KimiK3Model",
        "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM",
        "AutoModelForSequenceClassification": "modeling_kimi_k3.KimiK3ForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_kimi_k3.KimiK3ForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_kimi_k3.KimiK3ForQuestionAnswering",
    }
    assert (saved / "modeling_kimi_k3.py").read_text() == open(modeling_kimi_k3.__file__).read()


@pytest.mark.parametrize("layout", ["saved", "released"])
def test_fresh_process_without_the_package_reproduces_logits(layout, request, tmp_path):
    saved = request.getfixturevalue(layout)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-I", "-c", LOAD_IN_FRESH_PROCESS, str(saved), str(saved.parent / "expected.safetensors")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_CEILING_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_trust_remote_code_false_fails_with_transformers_message(saved):
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(saved, trust_remote_code=False)


def test_registered_auto_classes_load_without_remote_code(saved):
    register_auto_classes()
    config = AutoConfig.from_pretrained(saved)
    assert type(config).__module__ == "configuration_kimi_k3"
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert type(model) is KimiK3ForCausalLM
    assert type(AutoModel.from_config(config)).__name__ == "KimiK3Model"


VERSION_PROBE = textwrap.dedent(
    """
    import importlib.metadata
    import sys
    import transformers.modeling_utils
    installed = importlib.metadata.version
    importlib.metadata.version = lambda name: sys.argv[1] if name == "transformers" else installed(name)
    import configuration_kimi_k3, modeling_kimi_k3, kimi_k3
    from transformers import AutoModel, AutoModelForCausalLM
    for auto_class in (AutoModelForCausalLM, AutoModel):  # each remote-code load imports the folder's copies again
        auto_class.from_pretrained(sys.argv[2], trust_remote_code=True)
    print("imported", kimi_k3.__name__)
    """
)


@pytest.mark.parametrize("version", ["5.22.2", "5.26.0"])
def test_unsupported_transformers_warns_once_per_process_and_the_package_still_imports(version, saved):
    result = subprocess.run(
        [sys.executable, "-c", VERSION_PROBE, version, str(saved)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported kimi_k3" in result.stdout
    assert result.stderr.count(f"tested with transformers >=5.23,<5.26, but {version} is installed") == 1

"""Record what the release configuration produces: config.json text, state-dict layout, init digests and logits.

`tests/test_release_default_unchanged.py` compares the current code against these files, so a change that alters the
released model (a new config.json key, a renamed or re-initialised tensor, different logits) fails loudly. Rerun this
script only for a deliberate change of the released model:

    python tests/golden/record_release_default.py
"""

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.ablation.report import cpu_name  # noqa: E402
from modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402

INPUT_IDS = (torch.arange(18).view(2, 9) * 5 + 3) % 97


def config_json(config: KimiK3Config) -> dict:
    """The saved config.json as a dict, without the writer's transformers version."""
    saved = json.loads(config.to_json_string(use_diff=True))
    saved.pop("transformers_version", None)
    return saved


def tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def checkpoint_tensors(model: KimiK3ForCausalLM) -> dict[str, list]:
    """Names, shapes and dtypes of the tensors ``save_pretrained`` writes."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as saved:
            return {name: [saved.get_slice(name).get_shape(), saved.get_slice(name).get_dtype()] for name in saved.keys()}


def seeded_tiny_model() -> KimiK3ForCausalLM:
    torch.manual_seed(0)
    return KimiK3ForCausalLM(tiny_config()).eval()


def record() -> dict:
    model = seeded_tiny_model()
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
        model.double().set_experts_implementation("eager")  # grouped_mm kernels have no fp64 path
        logits_fp64 = model(INPUT_IDS).logits
    save_file({"logits": logits, "logits_fp64": logits_fp64}, str(HERE / "release_default_logits.safetensors"))
    state = seeded_tiny_model().state_dict()
    return {
        "platform": {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                     "cpu": cpu_name(), "transformers": transformers.__version__},
        "default_config_json": config_json(KimiK3Config()),
        "released_config_json": config_json(KimiK3Config.kimi_k3()),
        "tiny_config_json": config_json(tiny_config()),
        "tiny_checkpoint_tensors": checkpoint_tensors(seeded_tiny_model()),
        "tiny_state_dict": {name: [list(t.shape), str(t.dtype), tensor_digest(t)] for name, t in state.items()},
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    (HERE / "release_default.json").write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n")

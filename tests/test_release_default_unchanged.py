"""With every variant off, the released configuration, state dict, checkpoint layout and logits are what they were
before the variants existed (`tests/golden/record_release_default.py` recorded them from that code)."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.ablation.report import cpu_name
from tests.conftest import tiny_config
from tests.golden.record_release_default import (
    INPUT_IDS,
    checkpoint_tensors,
    config_json,
    seeded_tiny_model,
    tensor_digest,
)
from tests.numerics import assert_as_accurate

GOLDEN = Path(__file__).resolve().parent / "golden"
RECORDED = json.loads((GOLDEN / "release_default.json").read_text())
RECORDED_LOGITS = load_file(GOLDEN / "release_default_logits.safetensors")


def same_kernels() -> bool:
    """Initial values are bitwise a promise for the torch and the instruction set of ATen's kernels they were recorded
    with (its random-number transforms are vectorised per instruction set)."""
    platform = RECORDED["platform"]
    return platform["torch"] == torch.__version__ and platform["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def same_platform() -> bool:
    """Bitwise logits are a promise for the CPU they were recorded on as well: MKL's matrix products and math functions
    take other code paths on other CPU kinds (AMD and Intel CPUs with AVX-512 round differently)."""
    return same_kernels() and RECORDED["platform"]["cpu"] == cpu_name()


@pytest.mark.parametrize("name, config", [("default", KimiK3Config), ("released", KimiK3Config.kimi_k3),
                                          ("tiny", tiny_config)])
def test_config_json_of_the_release_configurations_is_unchanged(name, config):
    saved, recorded = config_json(config()), RECORDED[f"{name}_config_json"]
    if transformers.__version__ != RECORDED["platform"]["transformers"]:
        # PreTrainedConfig's own keys differ between transformers releases; the model's keys may not.
        saved, recorded = ({k: v for k, v in d.items() if k in KimiK3Config.__annotations__} for d in (saved, recorded))
    assert saved == recorded


def test_state_dict_names_shapes_dtypes_and_initial_values_are_unchanged():
    state = seeded_tiny_model().state_dict()
    layout = {name: [list(t.shape), str(t.dtype)] for name, t in state.items()}
    assert layout == {name: entry[:2] for name, entry in RECORDED["tiny_state_dict"].items()}
    if same_kernels():
        changed = [name for name, t in state.items() if tensor_digest(t) != RECORDED["tiny_state_dict"][name][2]]
        assert not changed, f"initial values changed: {changed[:5]}"


def test_saved_checkpoint_tensors_are_unchanged():
    assert checkpoint_tensors(seeded_tiny_model()) == RECORDED["tiny_checkpoint_tensors"]


def test_logits_are_bitwise_unchanged_on_the_recording_platform_and_as_accurate_elsewhere():
    model = seeded_tiny_model()
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
    if same_platform():
        assert torch.equal(logits, RECORDED_LOGITS["logits"])
    else:
        assert_as_accurate(logits, RECORDED_LOGITS["logits"], RECORDED_LOGITS["logits_fp64"], what="release logits")

"""Loading our own layout is as strict as loading the released one: a checkpoint that does not hold exactly the
model's floating-point tensors is refused, naming them, unless ``strict=False`` asks for transformers' leniency."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config

LM_HEAD = "lm_head.weight"
ROUTER = "model.layers.1.block_sparse_moe.gate.weight"
A_LOG = "model.layers.0.self_attn.A_log"
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ours")
    KimiK3ForCausalLM(tiny_config()).save_pretrained(folder)
    return folder


def edited_copy(saved, folder, edit):
    tensors = load_file(saved / "model.safetensors")
    edit(tensors)
    folder.mkdir()
    (folder / "config.json").write_bytes((saved / "config.json").read_bytes())
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_missing_tensors_are_refused_naming_each_one(saved, tmp_path):
    folder = edited_copy(saved, tmp_path / "bad", lambda tensors: [tensors.pop(name) for name in (LM_HEAD, ROUTER, A_LOG)])
    with pytest.raises(ValueError, match="Refusing the checkpoint: 3 text tensor") as error:
        KimiK3ForCausalLM.from_pretrained(folder)
    message = str(error.value)
    assert "\n" not in message
    assert f"missing {LM_HEAD} [97, 32]" in message and f"missing {ROUTER} [8, 32]" in message
    assert f"missing {A_LOG} [2]" in message and "strict=False" in message


def test_tied_lm_head_is_stored_once_and_loads(tmp_path):
    model = KimiK3ForCausalLM(tiny_config(tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    assert LM_HEAD not in load_file(tmp_path / "model.safetensors")
    loaded = KimiK3ForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_integer_or_boolean_tensors_are_refused_not_cast(saved, tmp_path, dtype):
    folder = edited_copy(saved, tmp_path / "bad", lambda tensors: tensors.__setitem__(NORM, torch.ones(32, dtype=dtype)))
    stored = {torch.int32: "I32", torch.bool: "BOOL"}[dtype]
    with pytest.raises(ValueError, match=f"{NORM}: stored as {stored}, expected a floating-point dtype"):
        KimiK3ForCausalLM.from_pretrained(folder)


def test_strict_false_gives_transformers_lenient_load(saved, tmp_path):
    folder = edited_copy(saved, tmp_path / "bad", lambda tensors: tensors.pop(LM_HEAD))
    model = KimiK3ForCausalLM.from_pretrained(folder, strict=False)
    assert model.lm_head.weight.shape == (97, 32) and torch.isfinite(model.lm_head.weight).all()
    complete = KimiK3ForCausalLM.from_pretrained(saved)  # the switch does not outlive its call
    assert torch.equal(complete.model.norm.weight, load_file(saved / "model.safetensors")[NORM])
    with pytest.raises(ValueError, match=f"missing {LM_HEAD}"):
        KimiK3ForCausalLM.from_pretrained(folder)


def test_in_memory_state_dict_missing_a_tensor_is_refused(saved):
    tensors = load_file(saved / "model.safetensors")
    del tensors[LM_HEAD]
    with pytest.raises(ValueError, match="missing lm_head.weight"):
        KimiK3ForCausalLM.from_pretrained(None, config=tiny_config(), state_dict=tensors)

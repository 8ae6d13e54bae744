"""Loading our own layout is as strict as loading the released one: a checkpoint that does not hold exactly the
model's floating-point tensors is refused, naming them, unless ``strict=False`` asks for transformers' leniency."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3Model
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


# ---------------------------------------------------------------------------------------------------------------------
# Base model and causal LM folders, both ways (transformers bridges them through `base_model_prefix`)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    KimiK3Model(tiny_config()).save_pretrained(folder)
    return folder


def assert_same_tensors(model, folder, prefix=""):
    stored = load_file(folder / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if prefix + name in stored:
            assert torch.equal(tensor, stored[prefix + name]), name


@pytest.mark.parametrize("strict", [True, False])
def test_each_class_reloads_its_own_folder(saved, base_folder, strict):
    base = KimiK3Model.from_pretrained(base_folder, strict=strict, output_loading_info=True)
    assert_same_tensors(base[0], base_folder)
    assert base[1]["missing_keys"] == set() and base[1]["unexpected_keys"] == set()
    causal_lm, info = KimiK3ForCausalLM.from_pretrained(saved, strict=strict, output_loading_info=True)
    assert_same_tensors(causal_lm, saved)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()


@pytest.mark.parametrize("strict", [True, False])
def test_base_model_reads_the_base_of_a_causal_lm_folder(saved, strict):
    model, info = KimiK3Model.from_pretrained(saved, strict=strict, output_loading_info=True)
    assert_same_tensors(model, saved, prefix="model.")
    assert info["missing_keys"] == set() and info["unexpected_keys"] == {LM_HEAD}  # the head is not the base's


def test_causal_lm_from_a_base_folder_is_refused_naming_only_the_head(base_folder):
    with pytest.raises(ValueError, match=r"Refusing the checkpoint: 1 text tensor\(s\) do not match the model: "
                                         r"missing lm_head\.weight \[97, 32\] \("):
        KimiK3ForCausalLM.from_pretrained(base_folder)


def test_causal_lm_from_a_base_folder_initialises_only_the_head_when_lenient(base_folder):
    model, info = KimiK3ForCausalLM.from_pretrained(base_folder, strict=False, output_loading_info=True)
    assert info["missing_keys"] == {LM_HEAD} and info["unexpected_keys"] == set()
    assert_same_tensors(model.model, base_folder)
    assert torch.isfinite(model.lm_head.weight).all() and model.lm_head.weight.std() > 0


def test_base_folder_missing_a_tensor_is_still_refused(base_folder, tmp_path):
    folder = edited_copy(base_folder, tmp_path / "bad", lambda tensors: tensors.pop(NORM.removeprefix("model.")))
    for model_class in (KimiK3Model, KimiK3ForCausalLM):
        with pytest.raises(ValueError, match=r"missing norm\.weight \[32\]"):
            model_class.from_pretrained(folder)


def test_keys_to_ignore_on_load_are_honoured_as_transformers_does(base_folder, saved, tmp_path):
    """A class may initialise the tensors its `_keys_to_ignore_on_load_missing` names (a new task head) and leave
    those its `_keys_to_ignore_on_load_unexpected` names unread; anything else is still refused."""

    class NewHead(KimiK3ForCausalLM):
        _keys_to_ignore_on_load_missing = [r"^lm_head\."]

    model, info = NewHead.from_pretrained(base_folder, output_loading_info=True)
    assert info["missing_keys"] == set() and torch.isfinite(model.lm_head.weight).all()
    folder = edited_copy(saved, tmp_path / "extra", lambda tensors: tensors.__setitem__("extra.scale", torch.ones(3)))
    with pytest.raises(ValueError, match=r"unexpected extra\.scale \[3\]"):
        KimiK3ForCausalLM.from_pretrained(folder)

    class ToleratesExtra(KimiK3ForCausalLM):
        _keys_to_ignore_on_load_unexpected = [r"^extra\."]

    ToleratesExtra.from_pretrained(folder)


def bin_copy(saved, folder, edit):
    """``saved`` as a ``pytorch_model.bin`` folder (the per-expert names safetensors stores), after ``edit``."""
    tensors = load_file(saved / "model.safetensors")
    edit(tensors)
    folder.mkdir()
    (folder / "config.json").write_bytes((saved / "config.json").read_bytes())
    torch.save(tensors, folder / "pytorch_model.bin")
    return folder


def test_pytorch_model_bin_folders_load_as_strictly_as_safetensors(saved, tmp_path):
    whole = bin_copy(saved, tmp_path / "whole", lambda tensors: None)
    loaded = KimiK3ForCausalLM.from_pretrained(whole).state_dict()
    expected = KimiK3ForCausalLM.from_pretrained(saved).state_dict()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)
    def spoil(tensors):
        tensors[NORM] = torch.ones(32, dtype=torch.int32)
        tensors["model.extra.weight"] = torch.zeros(3)

    spoiled = bin_copy(saved, tmp_path / "spoiled", spoil)
    with pytest.raises(ValueError, match="Refusing the checkpoint: 2 text tensor") as error:
        KimiK3ForCausalLM.from_pretrained(spoiled)
    assert f"{NORM}: stored as I32, expected a floating-point dtype" in str(error.value)
    assert "unexpected model.extra.weight [3]" in str(error.value)

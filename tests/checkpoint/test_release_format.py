"""Released Kimi-K3 checkpoint layout (the release's config.json and index): MXFP4, export, strict loading, conversion."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from configuration_kimi_k3 import AUTO_MAP, VISION_AUTO_MAP, KimiK3Config
from checkpoint_format_kimi_k3 import (
    checkpoint_shapes,
    dequantize_mxfp4,
    quantize_mxfp4,
    released_tensor_shapes,
)
from kimi_k3.checkpoint.release_format import export_released, import_released, released_config_dict
from modeling_kimi_k3 import KimiK3Experts, KimiK3ForCausalLM
from kimi_k3.checkpoint.convert import main as convert_main
from tests.conftest import HANG_CEILING_S, tiny_config
from variants_kimi_k3 import KimiK3VariantForCausalLM

# Experts need input widths that are multiples of the MXFP4 group (32).
MXFP4_SHAPES = {"routed_expert_hidden_size": 32, "moe_intermediate_size": 32}
PREFIX = "language_model.model.layers"


def mxfp4_representable_(model: KimiK3ForCausalLM) -> KimiK3ForCausalLM:
    """Overwrite every routed expert with random MXFP4 codes and scales, so export is lossless."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, KimiK3Experts):
                for weight in (module.gate_up_proj, module.down_proj):
                    rows, columns = weight.shape[:-1], weight.shape[-1]
                    codes = torch.randint(0, 256, (*rows, columns // 2), dtype=torch.uint8, generator=generator)
                    scales = torch.randint(120, 125, (*rows, columns // 32), dtype=torch.uint8, generator=generator)
                    weight.copy_(dequantize_mxfp4(codes, scales, weight.dtype))
    return model


def tensor_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    shapes = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                shapes[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
    return shapes


def edit_shard_holding(folder: Path, name: str, edit) -> Path:
    """Apply ``edit`` to the tensors of the shard that holds ``name``."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))


class Exported(NamedTuple):
    logits: torch.Tensor  # of the original model on `ids`
    ours: Path
    released: Path


@pytest.fixture(scope="module")
def representable(tmp_path_factory, ids) -> Exported:
    """A tiny model with MXFP4-representable experts, saved in our layout and exported in multi-shard release layout."""
    torch.manual_seed(0)
    model = mxfp4_representable_(KimiK3ForCausalLM(tiny_config(**MXFP4_SHAPES))).eval()
    ours, released = tmp_path_factory.mktemp("ours"), tmp_path_factory.mktemp("released")
    model.save_pretrained(ours)
    convert_main(["to-release", str(ours), str(released), "--max_shard_size", "20KB", "--no_progress"])
    return Exported(model(ids).logits, ours, released)


# ---------------------------------------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------------------------------------
def test_nibble_order_puts_element_2j_in_the_low_nibble():
    blocks = torch.tensor([[0x71, 0x9A] + [0x00] * 14], dtype=torch.uint8)
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^(128-127) = 2
    values = dequantize_mxfp4(blocks, scales, torch.float32)
    # 0x71: low 1 -> 0.5, high 7 -> 6; 0x9A: low 0xA = -(code 2) -> -1, high 9 = -(code 1) -> -0.5.
    assert values[0, :4].tolist() == [1.0, 12.0, -2.0, -1.0]
    assert values[0, 4:].abs().sum() == 0
    assert torch.equal(quantize_mxfp4(values)[0], blocks)


def test_rounding_to_the_e2m1_grid_breaks_ties_to_the_even_code():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    nearest_even = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    group = torch.tensor(ties + [-t for t in ties] + [6.0, 0.26, 2.51, 5.01] + [0.0] * 14)
    blocks, scales = quantize_mxfp4(group[None])
    decoded = dequantize_mxfp4(blocks, scales, torch.float32)[0]
    assert scales.item() == 127  # the group max 6 fits at scale 1
    assert decoded[:14].tolist() == nearest_even + [-v for v in nearest_even]
    assert decoded[14:18].tolist() == [6.0, 0.5, 3.0, 6.0]  # just past a tie rounds away from it


def test_pack_then_unpack_is_the_identity_on_representable_values():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 253, (64, 8), dtype=torch.uint8, generator=generator)  # 4·2^(253-127) overflows fp32
    weight = dequantize_mxfp4(codes, scales, torch.float32)
    blocks, rescales = quantize_mxfp4(weight)
    assert torch.equal(dequantize_mxfp4(blocks, rescales, torch.float32), weight)
    assert torch.equal(dequantize_mxfp4(blocks, rescales, torch.bfloat16).float(), weight)  # exact in bf16 too


def test_scale_is_the_smallest_power_of_two_that_fits_the_group_max():
    def scale_of(group_max: float) -> int:
        return quantize_mxfp4(torch.tensor([[group_max] + [0.0] * 31]))[1].item()

    assert scale_of(6.0) == 127 and scale_of(4.0) == 127 and scale_of(3.0) == 126
    assert scale_of(6.5) == 128  # no clipping: 6.5 / 2 = 3.25 -> 3, decoded 6 (the MX rule would clip to 6 at 127)
    assert scale_of(torch.nextafter(torch.tensor(6.0), torch.tensor(7.0)).item()) == 128
    assert scale_of(0.0) == 0


def test_mxfp4_rejects_bad_widths_and_values_naming_the_tensor():
    with pytest.raises(ValueError, match=r"`experts.0.w1.weight` has shape \[4, 24\].*multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 24), name="experts.0.w1.weight")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp4(torch.full((1, 32), float("inf")))
    with pytest.raises(ValueError, match=r"\[4, 16\] and `scales` \[4, 2\] disagree"):
        dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------------------------------
# Export and loading
# ---------------------------------------------------------------------------------------------------------------------
def test_export_writes_the_released_layout(representable):
    released = representable.released
    shapes = tensor_shapes(released)
    index = json.loads((released / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(shapes) and len(set(index["weight_map"].values())) > 1
    assert all(name.startswith("language_model.") for name in shapes)
    assert shapes[f"{PREFIX}.1.block_sparse_moe.experts.7.w1.weight_packed"] == ((32, 16), "U8")
    assert shapes[f"{PREFIX}.1.block_sparse_moe.experts.7.w2.weight_scale"] == ((32, 1), "U8")
    assert f"{PREFIX}.1.block_sparse_moe.experts.7.w2.weight" not in shapes
    assert shapes[f"{PREFIX}.0.self_attn.A_log"] == ((8,), "F32")  # zero-padded from 2 heads to head_dim 8
    assert shapes[f"{PREFIX}.1.block_sparse_moe.routed_expert_down_proj.weight"] == ((32, 32), "F32")
    config = json.loads((released / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "kimi_linear"
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"


def test_released_layout_loads_back_with_identical_logits_and_saves_our_layout(representable, ids, tmp_path):
    loaded = KimiK3ForCausalLM.from_pretrained(representable.released).eval()
    assert torch.equal(loaded(ids).logits, representable.logits)
    loaded.save_pretrained(tmp_path)
    assert tensor_shapes(tmp_path) == tensor_shapes(representable.ours)
    # In bf16 the uint8 codes pass through transformers' cast to the parameter dtype; dequantization stays exact.
    released_bf16 = KimiK3ForCausalLM.from_pretrained(representable.released, dtype=torch.bfloat16).state_dict()
    ours_bf16 = KimiK3ForCausalLM.from_pretrained(representable.ours, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(released_bf16[name], tensor) for name, tensor in ours_bf16.items())


def test_from_release_conversion_restores_our_layout_exactly(representable, tmp_path):
    ours, released = representable.ours, representable.released
    import_released(released, tmp_path, max_shard_bytes=30_000, progress=False)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    restored = {name: tensor for shard in tmp_path.glob("*.safetensors") for name, tensor in load_file(shard).items()}
    original = load_file(ours / "model.safetensors")
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[name], original[name]) for name in original)
    assert KimiK3Config.from_pretrained(tmp_path).hidden_size == 32
    with pytest.raises(ValueError, match="is not in the released layout"):
        import_released(ours, tmp_path / "again", progress=False)


def test_export_of_non_representable_experts_has_bounded_logit_error(ids, tmp_path, capsys):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(tiny_config(**MXFP4_SHAPES)).eval()  # experts ~ N(0, 0.02)
    model.save_pretrained(tmp_path / "ours")
    convert_main(["to-release", str(tmp_path / "ours"), str(tmp_path / "released"), "--no_progress"])
    reference = model(ids).logits
    error = (KimiK3ForCausalLM.from_pretrained(tmp_path / "released")(ids).logits - reference).abs().max().item()
    relative = error / reference.abs().max().item()
    with capsys.disabled():
        print(f"\nMXFP4 export of N(0, 0.02) experts: max |Δlogit| = {error:.3e} ({relative:.2%} of max |logit|)")
    assert 0 < relative < 0.05


def test_export_refuses_expert_widths_that_are_not_multiples_of_32_in_one_line(tmp_path, capsys):
    KimiK3ForCausalLM(tiny_config()).save_pretrained(tmp_path / "ours")  # latent width 24
    assert convert_main(["to-release", str(tmp_path / "ours"), str(tmp_path / "released"), "--no_progress"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and re.fullmatch(r"kimi-k3-convert: error: .*experts\.0\.w1\.weight has 24 input features.*multiple of 32.*", line)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ours"]  # no target, no staging folder


def _pop(name):
    return lambda tensors: tensors.pop(name)


def _set(name, value):
    return lambda tensors: tensors.__setitem__(name, value)


def _nonzero_tail(name):
    def edit(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][5] = 0.5

    return edit


def _fill_scale(name, rows, byte):
    def edit(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][rows] = byte

    return edit


NORM = "language_model.model.norm.weight"
A_LOG = f"{PREFIX}.0.self_attn.A_log"
SCALE = f"{PREFIX}.1.block_sparse_moe.experts.3.w2.weight_scale"
EXTRA = f"{PREFIX}.0.self_attn.extra_proj.weight"


@pytest.mark.parametrize(
    ("holder", "edit", "message"),
    [
        (SCALE, _pop(SCALE), f"missing {SCALE} [32, 1]"),
        (NORM, _set(EXTRA, torch.zeros(4, 32)), f"unexpected {EXTRA} [4, 32]"),
        (NORM, _set(NORM, torch.ones(33)), f"{NORM}: expected shape [32], found [33]"),
        (SCALE, _set(SCALE, torch.zeros(32, 1)), f"{SCALE}: expected U8 [32, 1], found F32 [32, 1]"),
        (A_LOG, _nonzero_tail(A_LOG), f"{A_LOG}: stored zero-padded to 8, but entries 2..7 are not zero"),
        (SCALE, _fill_scale(SCALE, 0, 255), f"{SCALE}: 1 group(s) decode to non-finite values (E8M0 scale byte 255"),
        (SCALE, _fill_scale(SCALE, slice(None), 254), f"{SCALE}: 32 group(s) decode to non-finite values"),
        (NORM, _set(NORM, torch.ones(32, dtype=torch.int32)), f"{NORM}: stored as I32, expected a floating-point"),
    ],
    ids=["missing", "extra", "wrong-shape", "wrong-dtype", "nonzero-A_log-tail", "nan-scale", "overflowing-scale",
         "integer-tensor"],
)
def test_loading_refuses_a_mismatched_released_checkpoint_naming_the_tensor(
    representable, tmp_path, holder, edit, message
):
    folder = shutil.copytree(representable.released, tmp_path / "released")
    edit_shard_holding(folder, holder, edit)
    with pytest.raises(ValueError, match="Refusing the checkpoint") as error:
        KimiK3ForCausalLM.from_pretrained(folder)
    assert message in str(error.value)


def test_loading_refuses_a_truncated_shard_naming_it(representable, tmp_path):
    folder = shutil.copytree(representable.released, tmp_path / "released")
    shard = sorted(folder.glob("model-00002-of-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{shard.name} cannot be read \(truncated or corrupted\?\)"):
        KimiK3ForCausalLM.from_pretrained(folder)


def test_vision_and_projector_tensors_are_skipped_with_one_log_line(representable, ids, tmp_path, caplog):
    folder = shutil.copytree(representable.released, tmp_path / "released")

    def add_multimodal(tensors):
        tensors.update({f"vision_tower.blocks.{i}.weight": torch.ones(3) for i in range(2)})
        tensors["mm_projector.proj.weight"] = torch.ones(2, 2)

    edit_shard_holding(folder, NORM, add_multimodal)
    with caplog.at_level(logging.INFO):
        loaded = KimiK3ForCausalLM.from_pretrained(folder)
    mentions = [record.getMessage() for record in caplog.records if "vision_tower" in record.getMessage()]
    assert mentions == [
        "Skipping the multimodal part of the checkpoint (the text model has no use for it): "
        "2 vision_tower.* tensors, 1 mm_projector.* tensors."
    ]
    assert torch.equal(loaded(ids).logits, representable.logits)


# ---------------------------------------------------------------------------------------------------------------------
# Configuration and naming at the released scale
# ---------------------------------------------------------------------------------------------------------------------
def test_wrapper_config_reads_its_text_config_and_carries_token_ids_over(tmp_path, caplog):
    config = tiny_config()
    wrapper = released_config_dict(config)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        wrapper["text_config"].pop(key)
    wrapper.update(
        bos_token_id=11, eos_token_id=12, pad_token_id=13, media_placeholder_token_id=14,
        vision_config={"hidden_size": 1024}, auto_map={"AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        audio_config={"hidden_size": 8},
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    with caplog.at_level(logging.INFO):
        loaded = KimiK3Config.from_pretrained(tmp_path)
        # AutoConfig hands `name_or_path` to the constructor, which is no wrapper key.
        assert KimiK3Config(**wrapper, name_or_path=str(tmp_path)).to_diff_dict() == loaded.to_diff_dict()
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (11, 12, 13)
    ignored = ("architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "audio_config", "vision_config")
    assert {k: v for k, v in loaded.to_dict().items() if k not in ignored} == {
        k: v for k, v in config.to_dict().items() if k not in ignored
    }
    assert loaded.architectures is None  # the wrapper's named its multimodal class
    assert loaded.auto_map == {**AUTO_MAP, **VISION_AUTO_MAP}  # the vision side is kept
    assert loaded.vision_config.media_placeholder_token_id == 14 and loaded.vision_config.hidden_size == 1024
    assert loaded.audio_config == {"hidden_size": 8}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["Kept unrecognised keys of the released wrapper config as attributes: ['audio_config']"] * 2


def test_released_configuration_on_meta_has_the_released_text_key_set():
    config = KimiK3Config.kimi_k3()
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    released = {
        key: shape
        for name, shape in checkpoint_shapes(model).items()
        for key, shape in released_tensor_shapes(name, shape, config).items()
    }
    assert len(released) == 497_220 - 168  # the released index without its vision tower and projector
    assert sum(key.endswith(".weight_packed") for key in released) == 92 * 896 * 3
    expected = {
        "language_model.model.embed_tokens.weight": (163840, 7168),
        "language_model.lm_head.weight": (163840, 7168),
        "language_model.model.output_attn_res_proj.weight": (1, 7168),
        f"{PREFIX}.0.mlp.down_proj.weight": (7168, 33792),
        f"{PREFIX}.0.self_attn.A_log": (128,),
        f"{PREFIX}.0.self_attn.q_conv1d.weight": (12288, 1, 4),
        f"{PREFIX}.0.self_attn.f_b_proj.weight": (12288, 128),
        f"{PREFIX}.3.self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
        f"{PREFIX}.3.self_attn.kv_b_proj.weight": (24576, 512),
        f"{PREFIX}.92.block_sparse_moe.gate.e_score_correction_bias": (896,),
        f"{PREFIX}.92.block_sparse_moe.shared_experts.gate_proj.weight": (6144, 7168),
        f"{PREFIX}.92.block_sparse_moe.experts.895.w1.weight_packed": (3072, 1792),
        f"{PREFIX}.92.block_sparse_moe.experts.895.w3.weight_scale": (3072, 112),
        f"{PREFIX}.92.block_sparse_moe.experts.895.w2.weight_packed": (3584, 1536),
        f"{PREFIX}.92.block_sparse_moe.experts.895.w2.weight_scale": (3584, 96),
    }
    assert {key: released[key] for key in expected} == expected
    expert_bytes = sum(
        torch.Size(shape).numel() for key, shape in released.items() if f"{PREFIX}.1.block_sparse_moe.experts.0." in key
    )
    assert expert_bytes == 17_547_264  # per expert on disk


# ---------------------------------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------------------------------
def status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith(field))


def reset_peak_rss() -> float:
    """Reset the high-water mark of resident memory (Linux `clear_refs`); returns the current RSS in MiB."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return status_mib("VmRSS")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to measure peak RSS")
def test_multi_shard_conversion_keeps_peak_memory_near_one_shard(tmp_path, capsys):
    shard_mib = 8
    config = tiny_config(num_experts=64, routed_expert_hidden_size=128, moe_intermediate_size=128)
    KimiK3ForCausalLM(config).save_pretrained(tmp_path / "ours", max_shard_size=shard_mib * 2**20)
    KimiK3ForCausalLM(tiny_config(**MXFP4_SHAPES)).save_pretrained(tmp_path / "warm-up")
    export_released(tmp_path / "warm-up", tmp_path / "warm-up-released", progress=False)  # lazy imports, one-offs
    model_mib = sum(path.stat().st_size for path in (tmp_path / "ours").glob("*.safetensors")) / 2**20
    start = reset_peak_rss()
    export_released(tmp_path / "ours", tmp_path / "released", max_shard_bytes=shard_mib * 2**20, progress=False)
    export_peak = status_mib("VmHWM") - start
    start = reset_peak_rss()
    import_released(tmp_path / "released", tmp_path / "restored", max_shard_bytes=shard_mib * 2**20, progress=False)
    import_peak = status_mib("VmHWM") - start
    assert len(list((tmp_path / "released").glob("*.safetensors"))) > 1
    assert len(list((tmp_path / "restored").glob("*.safetensors"))) > 1
    with capsys.disabled():
        print(
            f"\nconverting a {model_mib:.0f} MiB checkpoint in {shard_mib} MiB shards raised peak RSS by "
            f"{export_peak:.1f} MiB (to release) and {import_peak:.1f} MiB (back)"
        )
    # An input shard mapped, the output shard being filled, per-tensor temporaries and fixed overhead; holding the
    # whole output (one shard) measures > 100 MiB here. In-process numbers are lower bounds: freed heap is reused.
    assert model_mib > 90
    assert max(export_peak, import_peak) < 8 * shard_mib


def test_from_release_conversion_refuses_non_finite_scales_and_writes_nothing(representable, tmp_path):
    folder = shutil.copytree(representable.released, tmp_path / "released")
    edit_shard_holding(folder, SCALE, _fill_scale(SCALE, 3, 255))
    with pytest.raises(ValueError, match=f"{SCALE}: 1 group"):
        import_released(folder, tmp_path / "ours", progress=False)


def test_failed_conversion_prints_one_line_and_leaves_no_partial_target(representable, tmp_path, capsys):
    folder = shutil.copytree(representable.released, tmp_path / "released")
    edit_shard_holding(folder, SCALE, _fill_scale(SCALE, 0, 255))
    assert convert_main(["from-release", str(folder), str(tmp_path / "ours"), "--no_progress"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kimi-k3-convert: error: Refusing the checkpoint") and SCALE in line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["released"]


def test_conversion_failing_midway_removes_its_staging_folder(representable, tmp_path, monkeypatch, capsys):
    import kimi_k3.checkpoint.release_format as release_format

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(release_format, "save_file", disk_full)
    (tmp_path / "empty").mkdir()
    assert convert_main(["from-release", str(representable.released), str(tmp_path / "empty"), "--no_progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kimi-k3-convert: error: writing {tmp_path / 'empty'} failed (the disk is full), nothing partial was left: "
        "[Errno 28] No space left on device"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())


# Runs in `python -I` with the project blocked: only the converted folder's own code files can serve the Auto classes.
LOAD_CONVERTED_IN_FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    for name in ("modeling_kimi_k3", "configuration_kimi_k3", "checkpoint_format_kimi_k3", "kda_kimi_k3", "loading_kimi_k3",
                 "packing_kimi_k3", "kimi_k3"):
        sys.modules[name] = None
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    expected = load_file(sys.argv[1])
    for folder in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        with torch.no_grad():
            logits = model(expected["ids"]).logits
        assert torch.equal(logits, expected["logits"]), (folder, (logits - expected["logits"]).abs().max())
    print("ok")
    """
)


def test_converted_folders_carry_the_code_and_reload_with_trust_remote_code_in_a_fresh_interpreter(
    representable, ids, tmp_path
):
    ours = tmp_path / "ours"
    assert convert_main(["from-release", str(representable.released), str(ours), "--no_progress"]) == 0
    code = {"checkpoint_format_kimi_k3.py", "configuration_kimi_k3.py", "kda_kimi_k3.py", "loading_kimi_k3.py",
            "modeling_kimi_k3.py", "packing_kimi_k3.py"}
    for folder in (representable.released, ours):
        assert code <= {path.name for path in folder.iterdir()}
    assert json.loads((representable.released / "config.json").read_text())["auto_map"] == AUTO_MAP
    save_file({"ids": ids, "logits": representable.logits.contiguous()}, tmp_path / "expected.safetensors")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-I", "-c", LOAD_CONVERTED_IN_FRESH_PROCESS, str(tmp_path / "expected.safetensors"),
         str(representable.released), str(ours)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_CEILING_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_rerun_removes_staging_folders_a_killed_conversion_left_beside_the_target(representable, tmp_path, capsys):
    stale = tmp_path / ".staging-ours-0123456789ab"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 4096)
    assert convert_main(["from-release", str(representable.released), str(tmp_path / "ours"), "--no_progress"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ours"]
    assert f"removed .staging-ours-0123456789ab, left beside {tmp_path / 'ours'}" in capsys.readouterr().err


def test_second_simultaneous_conversion_into_one_target_is_refused(representable, tmp_path, capsys):
    from kimi_k3.checkpoint import run_folder

    with run_folder.OutputFolderLock(tmp_path, ".ours.converting.lock"):
        assert convert_main(["from-release", str(representable.released), str(tmp_path / "ours"), "--no_progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kimi-k3-convert: error: another conversion is writing {tmp_path / 'ours'}; wait for it, or choose another "
        "target"
    )
    assert not (tmp_path / "ours").exists()


def test_converting_a_trainer_checkpoint_leaves_its_optimizer_state_and_pickles_behind(representable, tmp_path, capsys):
    checkpoint = shutil.copytree(representable.ours, tmp_path / "checkpoint-8")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json"):
        (checkpoint / name).write_bytes(b"state")
    assert convert_main(["to-release", str(checkpoint), str(tmp_path / "released"), "--no_progress"]) == 0
    written = {path.name for path in (tmp_path / "released").iterdir()}
    assert not written & {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json"}
    assert ("not converted (Trainer state, not part of the model): optimizer.pt, rng_state.pth, scheduler.pt, "
            "trainer_state.json, training_args.bin") in capsys.readouterr().err  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# The opt-in variants (variants_kimi_k3.py)
# ---------------------------------------------------------------------------------------------------------------------
def test_shared_basis_export_materialises_each_expert_and_reloads_as_the_materialised_model(ids, tmp_path):
    torch.manual_seed(0)
    basis = KimiK3VariantForCausalLM(tiny_config(**MXFP4_SHAPES, expert_basis_size=3)).eval()
    basis.save_pretrained(tmp_path / "ours")
    export_released(tmp_path / "ours", tmp_path / "released", progress=False)
    shapes = tensor_shapes(tmp_path / "released")
    assert not any("basis" in name or "coefficients" in name for name in shapes)
    assert shapes[f"{PREFIX}.1.block_sparse_moe.experts.7.w2.weight_packed"] == ((32, 16), "U8")
    config = json.loads((tmp_path / "released" / "config.json").read_text())["text_config"]
    assert "expert_basis_size" not in config
    # The materialised model: independent experts W_e = sum_j C[e, j] B_j, as MXFP4 stores them.
    materialised = KimiK3ForCausalLM(tiny_config(**MXFP4_SHAPES)).eval()
    state = {name: tensor for name, tensor in basis.state_dict().items() if "basis" not in name and "coefficients" not in name}
    for name, module in basis.named_modules():
        if hasattr(module, "gate_up_basis"):
            for fused in ("gate_up_proj", "down_proj"):
                state[f"{name}.{fused}"] = dequantize_mxfp4(*quantize_mxfp4(getattr(module, fused).detach()), torch.float32)
    materialised.load_state_dict(state)
    reloaded = KimiK3ForCausalLM.from_pretrained(tmp_path / "released").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, materialised(ids).logits)


@pytest.mark.parametrize("fields", [{"router_score_normalization": "quantile"}, {"attention_gate_routing": True},
                                    {"num_coarse_experts": 2, "coarse_experts_per_token": 1},
                                    {"dynamic_experts_per_token": True}])
def test_export_refuses_variants_the_released_layout_cannot_represent_in_one_line(fields, tmp_path, capsys):
    KimiK3VariantForCausalLM(tiny_config(**MXFP4_SHAPES, **fields)).save_pretrained(tmp_path / "ours")
    assert convert_main(["to-release", str(tmp_path / "ours"), str(tmp_path / "released"), "--no_progress"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(rf"kimi-k3-convert: error: export_released: the released layout cannot represent .*"
                        rf"\({next(iter(fields))}\); keep this project's layout.*", line), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ours"]

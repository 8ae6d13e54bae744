"""``kimi-k3-train --image_text_dataset``: the vision-language job on the embedded shapes, offline, and its
refusals in one line."""

import json

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import Trainer

from kimi_k3.checkpoint.convert import main as convert_main
from kimi_k3.job import vision
from kimi_k3.publishing import hub
from kimi_k3.publishing.model_card import metadata_problems
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration
from tests.checkpoint.test_release_format import MXFP4_SHAPES
from tests.job.test_train import TINY_MODEL
from tests.publishing.test_hub import FakeHfApi


def tiny_job(output_dir, *extra: str) -> list[str]:
    return [
        "--image_text_dataset", "shapes", "--shapes_num_images", "40", "--output_dir", str(output_dir),
        "--config_overrides", json.dumps(TINY_MODEL), "--tokenizer_vocab_size", "300",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--learning_rate", "1e-2",
        "--warmup_steps", "0", "--max_steps", "12", "--eval_steps", "12", "--save_steps", "12", "--logging_steps", "1",
        "--disable_tqdm", "True", *extra,
    ]  # fmt: skip


def test_vl_job_on_the_shapes_lowers_the_loss_and_saves_a_loadable_folder(tmp_path, capsys):
    assert vision.main(tiny_job(tmp_path / "out")) == 0
    report = capsys.readouterr().out.strip().splitlines()[-1]
    first, last = (float(value) for value in report.split("training loss ")[1].split(",")[0].split(" -> "))
    assert last < 0.7 * first, report
    folder = tmp_path / "out" / "model"
    model = KimiK3ForConditionalGeneration.from_pretrained(folder)
    processor = vision.build_processor(vision.VisionArguments(model_name_or_path=str(folder)), None)
    image = vision.shapes_dataset(1, seed=5)[0]["image"]
    inputs = processor(images=[image], text=["<|media_pad|> a"])
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()
    card = ModelCard.load(folder / "README.md")  # a card for the task the folder does, so kimi-k3-push publishes it
    assert card.data.pipeline_tag == "image-text-to-text" and "AutoModelForImageTextToText" in card.text
    assert metadata_problems(card.data.to_dict()) == []
    hub.push_folder(folder, "someone/vl", FakeHfApi(tmp_path / "hub"))
    published = {path.name for path in (tmp_path / "hub" / "someone" / "vl").iterdir()}
    assert {"modeling_kimi_k3_vision.py", "processing_kimi_k3.py", "README.md", "processor_config.json"} <= published


def test_vl_job_refuses_bad_input_in_one_line(tmp_path, capsys):
    for extra, message in (
        (["--vision_train_parts", "tower"], "--vision_train_parts 'tower'; allowed"),
        (["--optimizer", "sgd"], "--optimizer 'sgd'; allowed: per_head_muon, adamw"),
        (["--text_column", "caption"], "has no column 'caption'"),
        (["--image_text_dataset", str(tmp_path / "missing")], f"--image_text_dataset {tmp_path / 'missing'}: "),
    ):
        assert vision.main(tiny_job(tmp_path / "bad", *extra)) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("kimi-k3-train: error: ") and message in error and "\n" not in error, error


def test_vl_job_fine_tunes_a_released_layout_folder_with_the_tower_frozen(tmp_path, capsys):
    mxfp4_widths = json.dumps({**TINY_MODEL, **MXFP4_SHAPES})  # the released experts are MXFP4: 32-wide groups
    assert vision.main(tiny_job(tmp_path / "first", "--max_steps", "2", "--config_overrides", mxfp4_widths)) == 0
    released = tmp_path / "released"
    convert_main(["to-release", str(tmp_path / "first" / "model"), str(released), "--no_progress"])
    tower = KimiK3ForConditionalGeneration.from_pretrained(released).vision_tower.state_dict()
    argv = tiny_job(tmp_path / "second", "--max_steps", "2", "--model_name_or_path", str(released),
                    "--vision_train_parts", "projector_and_language_model")
    assert vision.main(argv) == 0
    assert "frozen tensors" in capsys.readouterr().out
    tuned = KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "second" / "model").vision_tower.state_dict()
    assert all(torch.equal(tuned[name], tower[name]) for name in tower)


def test_vl_job_resumes_bit_exactly_and_refuses_a_used_folder_without_resume(tmp_path, capsys, monkeypatch):
    """Killed after its step-6 checkpoint and resumed, the job ends bitwise where an uninterrupted run ends; its
    processor (a BPE tokenizer learnt at the start) comes back from the checkpoint."""
    steps = ("--max_steps", "8", "--save_steps", "6", "--eval_steps", "8")
    assert vision.main(tiny_job(tmp_path / "whole", *steps)) == 0
    training_step = Trainer.training_step

    def killed_at_step_7(self, *args, **kwargs):
        if self.state.global_step == 7:
            raise KeyboardInterrupt("simulated kill")
        return training_step(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "training_step", killed_at_step_7)
        with pytest.raises(KeyboardInterrupt):
            vision.main(tiny_job(tmp_path / "cut", *steps))
    capsys.readouterr()
    assert vision.main(tiny_job(tmp_path / "cut", *steps)) == 2
    assert "already holds checkpoints of another run" in capsys.readouterr().err
    assert vision.main(tiny_job(tmp_path / "cut", *steps, "--resume_from_checkpoint", "True")) == 0
    whole = load_file(tmp_path / "whole" / "model" / "model.safetensors")
    resumed = load_file(tmp_path / "cut" / "model" / "model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[name], resumed[name]) for name in whole)
    assert (tmp_path / "cut" / "model" / "processor_config.json").is_file()

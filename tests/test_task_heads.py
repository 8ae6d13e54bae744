"""Sequence and token classification through transformers' generic heads: loaded from a causal-LM folder with only
the new head initialised (a missing base-model tensor is still refused), trained with Trainer, reloaded through the
Auto classes and remote code, and scoring each sequence at its last real token whatever the padding."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    Trainer,
    TrainingArguments,
)

from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config
from tests.numerics import assert_as_accurate, float64_copy

PAD = 0
HEADS = {"sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification}


@pytest.fixture(scope="module")
def causal_lm_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("causal-lm")
    KimiK3ForCausalLM(tiny_config(pad_token_id=PAD)).save_pretrained(folder)
    return folder


def labelled_rows(task: str, count: int = 8, length: int = 10) -> list[dict[str, torch.Tensor]]:
    """Sequences whose label is a function of their first token, so a few steps can learn it."""
    ids = torch.randint(3, 97, (count, length), generator=torch.Generator().manual_seed(0))
    labels = ids[:, 0] % 2 if task == "sequence" else ids % 2
    return [{"input_ids": row, "labels": label} for row, label in zip(ids, labels)]


@pytest.mark.parametrize("task", sorted(HEADS))
def test_head_from_a_causal_lm_folder_trains_a_few_steps_and_reloads_through_remote_code(task, causal_lm_folder,
                                                                                           tmp_path, caplog):
    auto_class = HEADS[task]
    with caplog.at_level("WARNING"):
        model = auto_class.from_pretrained(causal_lm_folder, trust_remote_code=True, num_labels=2)
    assert "score.weight" in caplog.text and "initialised at random (a new task head)" in caplog.text
    base = load_file(causal_lm_folder / "model.safetensors")
    assert torch.equal(model.model.norm.weight, base["model.norm.weight"])  # the base model came from the folder

    args = TrainingArguments(tmp_path / "train", max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
    head_before = model.score.weight.detach().clone()
    trainer = Trainer(model=model, args=args, train_dataset=labelled_rows(task))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(loss > 0 for loss in losses)
    assert not torch.equal(model.score.weight, head_before)

    model.save_pretrained(tmp_path / "tuned")
    reloaded = auto_class.from_pretrained(tmp_path / "tuned", trust_remote_code=True).eval()
    ids = torch.stack([row["input_ids"] for row in labelled_rows(task)])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model.eval()(ids).logits)


def test_head_loading_still_refuses_a_folder_missing_a_base_model_tensor(causal_lm_folder, tmp_path):
    folder = tmp_path / "no-norm"
    folder.mkdir()
    tensors = load_file(causal_lm_folder / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for source in [causal_lm_folder / "config.json", *causal_lm_folder.glob("*.py")]:  # the folder's code, as saved
        (folder / source.name).write_bytes(source.read_bytes())
    with pytest.raises(ValueError, match=r"1 text tensor\(s\) do not match the model: missing model.norm.weight"):
        AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True, num_labels=2)


def test_sequence_score_is_read_at_the_last_real_token_of_right_padded_rows(causal_lm_folder):
    model = AutoModelForSequenceClassification.from_pretrained(causal_lm_folder, trust_remote_code=True,
                                                               num_labels=3).eval()
    exact = float64_copy(model)
    lengths = [10, 6, 3]
    ids = torch.randint(3, 97, (len(lengths), 10), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(10)[None, :] < torch.tensor(lengths)[:, None]
    padded = ids.masked_fill(~mask, PAD)
    with torch.no_grad():
        batch = model(padded, attention_mask=mask.long()).logits
        for row, length in enumerate(lengths):
            alone = ids[row : row + 1, :length]  # the same sequence unpadded: fp32 (trusted) and fp64 (exact)
            assert_as_accurate(batch[row], model(alone).logits[0], exact(alone).logits[0], what=f"row {row}")


def test_question_answering_head_loads_from_a_causal_lm_folder_trains_and_reloads(causal_lm_folder, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        model = AutoModelForQuestionAnswering.from_pretrained(causal_lm_folder, trust_remote_code=True)
    assert "qa_outputs.weight" in caplog.text and "initialised at random (a new task head)" in caplog.text
    base = load_file(causal_lm_folder / "model.safetensors")
    assert torch.equal(model.model.norm.weight, base["model.norm.weight"])
    ids = torch.randint(3, 97, (4, 10), generator=torch.Generator().manual_seed(0))
    spans = {"start_positions": torch.tensor([1, 2, 3, 4]), "end_positions": torch.tensor([2, 3, 5, 6])}
    output = model(ids, **spans)
    assert output.start_logits.shape == (4, 10) and output.end_logits.shape == (4, 10)
    output.loss.backward()
    assert model.qa_outputs.weight.grad.abs().sum() > 0
    model.save_pretrained(tmp_path / "tuned")
    reloaded = AutoModelForQuestionAnswering.from_pretrained(tmp_path / "tuned", trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).start_logits, model.eval()(ids).start_logits)

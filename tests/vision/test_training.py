"""Fine-tuning the vision-language model under ``Trainer`` on the synthetic image set: the loss falls, and the parts
left frozen keep their weights bitwise."""

import math

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments

from kimi_k3.optim.muon import PerHeadMuon
from kimi_k3.vision.data import ImageTextCollator, check_columns, image_folder_dataset
from kimi_k3.vision.freezing import train_parts
from kimi_k3.vision.shapes import COLOURS, SHAPES, shapes_dataset
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration
from processing_kimi_k3 import KimiK3ImageProcessor, KimiK3Processor
from tests.test_modeling_vision import tiny_vl_config

WORDS = ["<pad>", "<s>", "</s>", "<|media_pad|>", "a", *sorted(COLOURS), *SHAPES]


def caption_processor() -> KimiK3Processor:
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="</s>", additional_special_tokens=["<|media_pad|>"]
    )
    return KimiK3Processor(KimiK3ImageProcessor(), tokenizer)


def caption_model() -> KimiK3ForConditionalGeneration:
    config = tiny_vl_config()
    config.vision_config.media_placeholder_token_id = WORDS.index("<|media_pad|>")
    return KimiK3ForConditionalGeneration(config)


def train(model, tmp_path, steps: int, optimizers=(None, None), learning_rate=1e-2) -> list[float]:
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps, learning_rate=learning_rate,
        logging_steps=1, save_strategy="no", report_to=[], remove_unused_columns=False, use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model, args, train_dataset=shapes_dataset(32), data_collator=ImageTextCollator(caption_processor()),
                      optimizers=optimizers)
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def test_collator_pads_text_and_packs_images():
    rows = [shapes_dataset(3)[i] for i in range(3)]
    batch = ImageTextCollator(caption_processor())(rows)
    placeholder = WORDS.index("<|media_pad|>")
    assert batch["input_ids"].shape[0] == 3 and (batch["input_ids"][:, 0] == placeholder).all()
    assert batch["grid_thws"].shape == (3, 3)
    assert batch["pixel_values"].shape[0] == int(batch["grid_thws"].prod(-1).sum())
    assert (batch["labels"][:, 0] == -100).all() and (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    assert batch["labels"][0, 1:4].tolist() == batch["input_ids"][0, 1:4].tolist()  # "a <colour> <shape>"


def test_trainer_fine_tune_on_image_caption_pairs_lowers_the_loss(tmp_path):
    losses = train(caption_model(), tmp_path, steps=12)
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses


@pytest.mark.parametrize("parts", ["projector_and_language_model", "projector"])
def test_frozen_parts_keep_their_weights(parts, tmp_path):
    model = caption_model()
    frozen = set(train_parts(model, parts))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    # Per-Head Muon needs the language model's heads; the projector alone trains with Trainer's AdamW.
    optimizer = PerHeadMuon.for_model(model, lr=1e-3) if parts != "projector" else None
    train(model, tmp_path, steps=3, optimizers=(optimizer, None))
    after = model.state_dict()
    assert frozen and all(torch.equal(after[name], before[name]) for name in frozen)
    assert not torch.equal(after["mm_projector.proj.0.weight"], before["mm_projector.proj.0.weight"])
    assert all(name.startswith("vision_tower.") for name in frozen) == (parts == "projector_and_language_model")


def test_unknown_parts_and_missing_columns_are_refused_in_one_line():
    with pytest.raises(ValueError, match="--vision_train_parts 'tower'; allowed"):
        train_parts(caption_model(), "tower")
    with pytest.raises(ValueError, match="has no column 'caption'; its columns: \\['image', 'text'\\]"):
        check_columns(shapes_dataset(1), "image", "caption")


def test_image_folder_reads_each_image_with_its_caption_file(tmp_path):
    for i, row in enumerate(shapes_dataset(2)):
        row["image"].save(tmp_path / f"{i}.png")
        (tmp_path / f"{i}.txt").write_text(row["text"] + "\n")
    folder = image_folder_dataset(tmp_path)
    assert folder["text"] == shapes_dataset(2)["text"]
    (tmp_path / "2.png").write_bytes((tmp_path / "0.png").read_bytes())
    with pytest.raises(ValueError, match="no caption file \\(<name>.txt\\) for 2.png"):
        image_folder_dataset(tmp_path)


def test_lora_on_the_tower_and_the_language_model_trains_only_the_adapters(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(caption_model(), LoraConfig(r=4, target_modules=["wqkv", "q_b_proj"]))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    losses = train(model, tmp_path, steps=3)
    after = model.state_dict()
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert changed and all("lora_B" in name or "lora_A" in name for name in changed), sorted(changed)[:3]
    assert any("vision_tower" in name for name in changed) and any("language_model" in name for name in changed)
    assert all(math.isfinite(loss) for loss in losses)


# A chat template for the word-level test tokenizer: each image as its placeholder, each text as itself.
CHAT_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|media_pad|> "
                 "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}</s>")  # fmt: skip


def conversations(count: int) -> Dataset:
    rows = shapes_dataset(count)
    return Dataset.from_dict({
        "images": [[row["image"]] for row in rows],
        "messages": [[{"role": "user", "content": [{"type": "image"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": row["text"]}]}] for row in rows],
    })  # fmt: skip


def test_base_model_scores_at_the_input_positions_what_the_model_scores_on_the_merged_sequence():
    """``base_model`` returns hidden states of the input's length (a placeholder's are its image's last token's): the
    LM head on them against labels of the input, as TRL's fused head applies it, gives the model's own loss."""
    model = caption_model().eval()
    processor = caption_processor()
    rows = shapes_dataset(3)
    texts = ["<|media_pad|> a " + rows[0]["text"], "a <|media_pad|> " + rows[1]["text"], "<|media_pad|> a"]
    batch = processor(images=list(rows["image"]), text=texts, padding=True, padding_side="right")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[labels == WORDS.index("<|media_pad|>")] = -100  # the model's own loss never predicts an image
    with torch.no_grad():
        own = model(**batch, labels=labels).loss
        hidden = model.base_model(**batch).last_hidden_state
        logits = model.get_output_embeddings()(hidden)
    assert hidden.shape[:2] == batch["input_ids"].shape
    scored = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(scored, own)


def test_trl_sft_trainer_fine_tunes_on_image_conversations(tmp_path):
    """TRL's SFTTrainer with images and a chat template: its collator runs the processor's template, its fused LM
    head runs ``base_model`` and scores the hidden states itself."""
    from trl import SFTConfig, SFTTrainer

    processor = caption_processor()
    processor.chat_template = CHAT_TEMPLATE
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=12, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, max_length=None,
    )  # fmt: skip
    trainer = SFTTrainer(model=caption_model(), args=args, train_dataset=conversations(32), processing_class=processor)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses

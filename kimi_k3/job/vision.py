"""``kimi-k3-train --image_text_dataset ...``: fine-tune or train a Kimi K3 vision-language model on image-caption
pairs with ``transformers.Trainer``.

``main`` reads top-down: arguments -> data -> processor -> model -> trained parts -> optimizer and callbacks ->
Trainer -> save. ``--image_text_dataset shapes`` (the default when the flag is given without a folder or dataset)
draws the embedded synthetic image set at run time (`kimi_k3.vision.shapes`), so the default job runs offline on a
CPU in minutes: the default ``KimiK3Config()`` language model with a two-block tower, Per-Head Muon (the tower's
q/k/v per head), Quantile Balancing and QK-Clip on the language model.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from transformers import HfArgumentParser, Trainer, TrainingArguments, set_seed

from configuration_kimi_k3 import KimiK3Config
from configuration_kimi_k3_vision import KimiK3VisionConfig
from kimi_k3.attachments.seams import find_routers
from kimi_k3.checkpoint import run_folder
from kimi_k3.job.arguments import TRAINING_DEFAULTS, config_overrides, resolve_checkpoint
from kimi_k3.job.final_save import FINAL_MODEL_DIR, local_folder_name, save_final_model
from kimi_k3.job.main import claim_output_folder
from kimi_k3.job.threads import choose_intra_op_threads
from kimi_k3.job.trainer import SaveError
from kimi_k3.optim.muon import PerHeadMuonFactory
from kimi_k3.policies.qk_clip import QKClipCallback
from kimi_k3.policies.quantile_balancing import QuantileBalancingCallback
from kimi_k3.publishing.model_card import render_model_card
from kimi_k3.text.tokenizer import load_tokenizer, train_bpe_tokenizer
from kimi_k3.vision.data import ImageTextCollator, check_columns, image_folder_dataset
from kimi_k3.vision.freezing import TRAINED_PARTS, train_parts
from kimi_k3.vision.shapes import shapes_dataset
from modeling_kimi_k3_vision import KimiK3ForConditionalGeneration
from processing_kimi_k3 import KimiK3ImageProcessor, KimiK3Processor

FLAG = "--image_text_dataset"
SHAPES = "shapes"
IMAGE_TOKEN = "<|media_pad|>"
# QK-Clip's threshold in the K2 report's MuonClip, which K3 keeps.
QK_CLIP_TAU = 100.0
VISION_DEFAULTS = {**TRAINING_DEFAULTS, "output_dir": "outputs/kimi-k3-vl-small", "max_steps": 60, "eval_steps": 30,
                   "save_steps": 30, "logging_steps": 5, "remove_unused_columns": False}


@dataclass
class VisionArguments:
    image_text_dataset: str = field(
        default=SHAPES,
        metadata={"help": "Image-caption pairs: 'shapes' (drawn at run time), a folder of images each with a <name>.txt "
                          "caption, or a `datasets` dataset (hub id, cache or local folder) with image and text columns."},
    )
    shapes_num_images: int = field(default=512, metadata={"help": "Images of the 'shapes' set."})
    image_column: str = field(default="image", metadata={"help": "The dataset's image column."})
    text_column: str = field(default="text", metadata={"help": "The dataset's caption column."})
    validation_split_percentage: int = field(default=10, metadata={"help": "Held out for evaluation (0-50)."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Fine-tune this vision-language folder (ours or the released layout)."}
    )
    vision_train_parts: str = field(
        default="all", metadata={"help": f"What trains: {', '.join(TRAINED_PARTS)}."}
    )
    optimizer: str = field(default="per_head_muon", metadata={"help": "per_head_muon or adamw."})
    tokenizer_vocab_size: int = field(default=512, metadata={"help": "A new tokenizer's size (BPE on the captions)."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "A new model's language-model fields as JSON, over KimiK3Config()'s."}
    )


def main(argv: list[str] | None = None) -> int:
    """Run the job; bad input exits with status 2 and a one-line message before anything is written, a failed final
    save with status 1, publishing nothing partial. The output folder is the text job's: locked, checked, resumed."""
    datasets.disable_progress_bars()
    lock = None
    try:
        try:
            args, training_args = parse_args(argv)
            run_folder.check_output_folder(training_args.output_dir)
            lock = claim_output_folder(training_args)
            checkpoint = resolve_checkpoint(training_args)
            print(f"kimi-k3-train: {choose_intra_op_threads()}")  # before data loading starts threads of its own
            set_seed(training_args.seed)
            splits = load_image_text(args, training_args.seed)
            processor = build_processor(args, splits["train"], checkpoint)
            model = build_model(args, processor)
            frozen = train_parts(model, args.vision_train_parts)
            trainer = build_trainer(args, training_args, model, processor, splits)
        except ValueError as error:
            print(f"kimi-k3-train: error: {error}", file=sys.stderr)
            return 2
        trainer.train(resume_from_checkpoint=checkpoint)
        metrics = trainer.evaluate()
        if not trainer.is_world_process_zero():  # one process writes the final folder
            return 0
        model_dir = Path(training_args.output_dir) / FINAL_MODEL_DIR
        card = render_model_card(model, Path(training_args.output_dir).name, local_folder=local_folder_name(model_dir))
        try:
            folder = save_final_model(model, processor, card, model_dir)
        except SaveError as error:
            print(f"kimi-k3-train: error: {error}", file=sys.stderr)
            return 1
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"kimi-k3-train: {trainer.state.global_step} steps, training loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"eval loss {metrics['eval_loss']:.3f}, {len(frozen)} frozen tensors; saved {folder}")
        return 0
    finally:
        if lock is not None:
            lock.release()


def parse_args(argv: list[str] | None) -> tuple[VisionArguments, TrainingArguments]:
    parser = HfArgumentParser((VisionArguments, TrainingArguments))
    parser.set_defaults(**VISION_DEFAULTS)
    args, training_args = parser.parse_args_into_dataclasses(args=argv)
    if args.optimizer not in ("per_head_muon", "adamw"):
        raise ValueError(f"--optimizer {args.optimizer!r}; allowed: per_head_muon, adamw")
    if not 0 <= args.validation_split_percentage <= 50:
        raise ValueError(f"--validation_split_percentage {args.validation_split_percentage}: between 0 and 50")
    return args, training_args


def load_image_text(args: VisionArguments, seed: int) -> dict[str, datasets.Dataset]:
    """The image-caption pairs, split into train and validation (the split does not move with the seed)."""
    source = args.image_text_dataset
    if source == SHAPES:
        dataset = shapes_dataset(args.shapes_num_images, seed)
    elif Path(source).is_dir() and not (Path(source) / "dataset_info.json").exists():
        dataset = image_folder_dataset(source)
    else:
        try:
            dataset = datasets.load_dataset(source, split="train")
        except (OSError, datasets.exceptions.DatasetNotFoundError) as error:  # FileNotFoundError is an OSError
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"{FLAG} {source}: {first}") from None
    check_columns(dataset, args.image_column, args.text_column)
    held_out = max(1, len(dataset) * args.validation_split_percentage // 100)
    split = dataset.train_test_split(test_size=held_out, seed=0)
    return {"train": split["train"], "validation": split["test"]}


def build_processor(
    args: VisionArguments, train_split: datasets.Dataset, checkpoint: str | None = None
) -> KimiK3Processor:
    """The resumed checkpoint's or the fine-tuned folder's image processor and tokenizer (read without its
    config.json, which is remote code), else the release's image processor with a BPE tokenizer learnt from the
    captions and the image placeholder as a special token."""
    folder = checkpoint or args.model_name_or_path
    if folder is not None:
        image_processor = KimiK3ImageProcessor.from_pretrained(folder)
        return KimiK3Processor(image_processor, load_tokenizer(folder), image_token=IMAGE_TOKEN)
    tokenizer = train_bpe_tokenizer(train_split[args.text_column], args.tokenizer_vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return KimiK3Processor(KimiK3ImageProcessor(), tokenizer, image_token=IMAGE_TOKEN)


def build_model(args: VisionArguments, processor: KimiK3Processor) -> KimiK3ForConditionalGeneration:
    """The fine-tuned folder's model, else the default language model with the tiny tower, sized by the tokenizer."""
    if args.model_name_or_path is not None:
        return KimiK3ForConditionalGeneration.from_pretrained(args.model_name_or_path)
    tokenizer = processor.tokenizer
    text = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, **config_overrides(args.config_overrides))
    vision = KimiK3VisionConfig.tiny(
        KimiK3Config(**text).hidden_size, media_placeholder_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    )
    return KimiK3ForConditionalGeneration(KimiK3Config(**text, vision_config=vision.to_dict()))


def build_trainer(args, training_args, model, processor, splits) -> Trainer:
    optimizer_cls_and_kwargs = None
    if args.optimizer == "per_head_muon":
        optimizer_cls_and_kwargs = PerHeadMuonFactory.from_training_args(training_args)
    callbacks = [QKClipCallback(QK_CLIP_TAU)]
    if find_routers(model):
        callbacks.append(QuantileBalancingCallback(model, per_layer_metrics=False))
    return Trainer(  # the processor goes into every checkpoint, where a resumed run reads it back
        model=model, args=training_args, train_dataset=splits["train"], eval_dataset=splits["validation"],
        processing_class=processor, data_collator=ImageTextCollator(processor, args.image_column, args.text_column),
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs, callbacks=callbacks,
    )  # fmt: skip

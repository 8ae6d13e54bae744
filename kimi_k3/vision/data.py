"""Image-caption data for ``KimiK3ForConditionalGeneration``: a folder of images with captions, a ``datasets``
dataset with an image and a text column, and the collator that turns rows into padded model inputs.

A training example is one image followed by its caption, ``<|media_pad|> caption</s>``; the loss is on the caption
(the image's tokens and the padding are labelled -100).
"""

from dataclasses import dataclass
from pathlib import Path

import datasets
import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")


def image_folder_dataset(folder: str | Path) -> datasets.Dataset:
    """Every image ``name.<ext>`` of ``folder`` with its caption, the text of ``name.txt`` beside it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--image_text_dataset {folder}: no such folder")
    images = sorted(path for path in folder.iterdir() if path.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise ValueError(f"--image_text_dataset {folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in the folder")
    missing = [path.name for path in images if not path.with_suffix(".txt").is_file()]
    if missing:
        raise ValueError(f"--image_text_dataset {folder}: no caption file (<name>.txt) for {missing[0]} and "
                         f"{len(missing) - 1} more")
    rows = {"image": [str(path) for path in images],
            "text": [path.with_suffix(".txt").read_text(encoding="utf-8").strip() for path in images]}
    return datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())


def check_columns(dataset: datasets.Dataset, image_column: str, text_column: str) -> None:
    missing = [name for name in (image_column, text_column) if name not in dataset.column_names]
    if missing:
        raise ValueError(f"the image-text dataset has no column {missing[0]!r}; its columns: {dataset.column_names}")


@dataclass
class ImageTextCollator:
    """Rows of ``{image_column: image, text_column: caption}`` -> ``input_ids``, ``attention_mask``, ``labels``,
    ``pixel_values`` and ``grid_thws``: captions padded to the longest, all images' patches one after another."""

    processor: object
    image_column: str = "image"
    text_column: str = "text"

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        tokenizer = self.processor.tokenizer
        prompts = [f"{self.processor.image_token} {row[self.text_column]}{tokenizer.eos_token}" for row in rows]
        batch = self.processor(images=[row[self.image_column] for row in rows], text=prompts, padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        batch["labels"] = labels.masked_fill(labels == tokenizer.convert_tokens_to_ids(self.processor.image_token), -100)
        return dict(batch)

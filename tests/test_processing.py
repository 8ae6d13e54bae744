"""The image processor and processor: the release's constants and resize rule, the pixels each image becomes, refusals
of unusable images, and saving and loading with a folder, offline."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoProcessor, PreTrainedTokenizerFast

from processing_kimi_k3 import KimiK3ImageProcessor, KimiK3Processor

# The release's preprocessor_config.json `media_proc_cfg` (moonshotai/Kimi-K3).
RELEASED_MEDIA_PROC_CFG = {
    "in_patch_limit": 65536,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "patch_limit_on_one_side": 512,
    "transparent_bg_config": {
        "pattern": "chessboard",
        "chessboard_square_size": 8,
        "chessboard_square_on_top_left": True,
        "chessboard_white_value": 255,
        "chessboard_gray_value": 180,
    },
    "transparent_bg_fill_stage": "after_resize",
}
WORDS = ["<pad>", "<s>", "</s>", "a", "photo", "of", "<|media_pad|>"]


def word_tokenizer() -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="</s>", additional_special_tokens=["<|media_pad|>"]
    )


def rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_defaults_are_the_released_constants():
    processor = KimiK3ImageProcessor()
    for name, value in RELEASED_MEDIA_PROC_CFG.items():
        assert getattr(processor, name) == value, name


@pytest.mark.parametrize("width,height", [(70, 50), (28, 28), (4000, 3000), (9000, 200), (20000, 20000), (3001, 17)])
def test_resize_plan_never_upscales_and_fits_the_budgets(width, height):
    processor = KimiK3ImageProcessor()
    new_width, new_height, padded_width, padded_height = processor.plan(width, height)
    assert new_width <= width and new_height <= height
    assert padded_width % 28 == 0 and padded_height % 28 == 0
    assert 0 <= padded_width - new_width < 28 and 0 <= padded_height - new_height < 28
    assert max(padded_width, padded_height) // 14 <= 512 + 1  # the side limit, plus the last merge group's padding
    assert processor.number_of_image_tokens(width, height) == (padded_width // 28) * (padded_height // 28) <= 16384
    if (width // 14) * (height // 14) <= 65536 and max(width, height) <= 512 * 14:
        assert (new_width, new_height) == (width, height)  # within both budgets: padded only
    else:
        budget = min(math.sqrt(65536 / ((width // 14) * (height // 14))), 7168 / width, 7168 / height)
        assert new_width <= min(int(width * budget), 7168) and new_height <= min(int(height * budget), 7168)


def test_pixels_are_normalised_padded_and_cut_row_by_row():
    image = rgb(42, 30)  # 42 x 30 -> padded to 56 x 56: 4 x 4 patches, the last column and rows partly padding
    out = KimiK3ImageProcessor()(image)
    assert out["grid_thws"].tolist() == [[1, 4, 4]]
    pixels = out["pixel_values"].reshape(4, 4, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 56, 56)
    expected = (torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    torch.testing.assert_close(pixels[:, :30, :42], expected, rtol=0, atol=1e-6)
    assert not pixels[:, 30:].any() and not pixels[:, :, 42:].any()


def test_transparent_pixels_show_the_chessboard():
    clear = Image.fromarray(np.zeros((28, 28, 4), dtype=np.uint8))
    pixels = KimiK3ImageProcessor()(clear)["pixel_values"]
    board = pixels.reshape(2, 2, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 28)[0]
    white, gray = 1.0, (180 / 255 - 0.5) / 0.5
    assert board[0, 0] == white and board[0, 8] == pytest.approx(gray) and board[8, 8] == white


@pytest.mark.parametrize(
    "image,message",
    [
        (rgb(13, 40), "image 0 is 13 x 40 pixels; each side needs at least one 14-pixel patch"),
        (np.zeros((0, 20, 3), dtype=np.uint8), "image 0 is 20 x 0 pixels"),
        (np.zeros((20, 20, 3), dtype=np.float32), "image 0: an array must be uint8"),
        ("cat.png", "image 0: expected a PIL image, numpy array or torch tensor, got str"),
    ],
)
def test_unusable_images_are_refused_in_one_line(image, message):
    with pytest.raises((ValueError, TypeError)) as error:
        KimiK3ImageProcessor()(image)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_processor_checks_placeholders_and_batches_text_and_images():
    processor = KimiK3Processor(KimiK3ImageProcessor(), word_tokenizer())
    images = [rgb(56, 28), rgb(28, 84, seed=1)]
    out = processor(images=images, text=["a photo <|media_pad|> of", "<|media_pad|> a"], padding=True)
    placeholder = WORDS.index("<|media_pad|>")
    assert out["input_ids"].tolist() == [[3, 4, placeholder, 5], [placeholder, 3, 0, 0]]
    assert out["grid_thws"].tolist() == [[1, 2, 4], [1, 6, 2]]
    assert out["pixel_values"].shape == (8 + 12, 3, 14, 14)
    with pytest.raises(ValueError, match="holds 1 <\\|media_pad\\|> placeholder\\(s\\) for 2 image"):
        processor(images=images, text="a <|media_pad|>")
    # One list of images per text (TRL's collators pass them so): the same batch as the flat list.
    nested = processor(images=[[images[0]], [images[1]]], text=["a photo <|media_pad|> of", "<|media_pad|> a"],
                       padding=True)
    assert all(torch.equal(nested[key], out[key]) for key in out)


def test_processor_saves_and_loads_offline_with_the_same_outputs(tmp_path):
    processor = KimiK3Processor(KimiK3ImageProcessor(in_patch_limit=1024), word_tokenizer())
    processor.save_pretrained(tmp_path)
    assert (tmp_path / "processing_kimi_k3.py").exists()
    loaded = AutoProcessor.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(loaded).__name__ == "KimiK3Processor" and loaded.image_processor.in_patch_limit == 1024
    inputs = dict(images=[rgb(500, 300)], text=["a photo of <|media_pad|>"])
    expected, actual = processor(**inputs), loaded(**inputs)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key

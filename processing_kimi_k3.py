"""Kimi K3 image processor and processor: images to the patches ``KimiK3ForConditionalGeneration`` reads.

The release's pipeline (its ``preprocessor_config.json`` ``media_proc_cfg``, and the NaViT resize of Kimi-VL,
arXiv:2504.07491): an image is scaled down, never up, until it holds at most ``in_patch_limit`` (65536) patches of
14 x 14 pixels and at most ``patch_limit_on_one_side`` (512) patches per side, resized bicubically, composited over a
chessboard where it is transparent (after the resize), padded with zeros on the right and bottom to a multiple of
28 pixels (one 2 x 2 merge group), normalised with mean 0.5 and std 0.5, and cut into patches row by row. Each image
becomes (h/28)·(w/28) language-model tokens, which replace the one ``<|media_pad|>`` the prompt holds for it.

Imports only numpy, PIL, torch and transformers, so ``save_pretrained`` copies it into a folder that loads with
``trust_remote_code=True``.
"""

import math

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.processing_utils import ProcessorMixin

# The release's transparent background: 8-pixel squares, white (255) at the top left, alternating with gray (180).
RELEASE_TRANSPARENT_BACKGROUND = {
    "pattern": "chessboard",
    "chessboard_square_size": 8,
    "chessboard_square_on_top_left": True,
    "chessboard_white_value": 255,
    "chessboard_gray_value": 180,
}
FILL_STAGES = ("before_resize", "after_resize")


def navit_plan(width: int, height: int, patch_size: int, merge_size: int, patch_limit: int, side_limit: int):
    """(new_width, new_height, padded_width, padded_height): the largest downscale-only size within both patch
    budgets, padded to whole merge groups. The budget counts whole patches of the original, at least one per side."""
    patches = max(1, width // patch_size) * max(1, height // patch_size)
    scale = min(1.0, math.sqrt(patch_limit / patches), side_limit * patch_size / width, side_limit * patch_size / height)
    new_width = min(max(1, int(width * scale)), side_limit * patch_size)
    new_height = min(max(1, int(height * scale)), side_limit * patch_size)
    group = merge_size * patch_size
    return new_width, new_height, math.ceil(new_width / group) * group, math.ceil(new_height / group) * group


def chessboard(width: int, height: int, config: dict) -> np.ndarray:
    """[height, width, 3] uint8 background of alternating squares."""
    size = config["chessboard_square_size"]
    rows, columns = np.arange(height)[:, None] // size, np.arange(width)[None, :] // size
    first = (rows + columns) % 2 == (0 if config["chessboard_square_on_top_left"] else 1)
    values = np.where(first, config["chessboard_white_value"], config["chessboard_gray_value"]).astype(np.uint8)
    return np.repeat(values[:, :, None], 3, axis=2)


def as_pil_image(image, index: int) -> Image.Image:
    """A PIL image from a PIL image, an [H, W, C] uint8 array or a [C, H, W] uint8 tensor; refused in one line
    otherwise."""
    if isinstance(image, torch.Tensor):
        image = image.permute(1, 2, 0).numpy() if image.ndim == 3 else image.numpy()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise TypeError(
                f"image {index}: an array must be uint8 [H, W], [H, W, C] or a tensor [C, H, W] with C in (1, 3, 4); "
                f"got {image.dtype} {list(image.shape)}"
            )
        image = Image.fromarray(image[:, :, 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"image {index}: expected a PIL image, numpy array or torch tensor, got {type(image).__name__}")
    return image


class KimiK3ImageProcessor(BaseImageProcessor):
    r"""
    The release's image pipeline (module docstring). Returns `pixel_values` [num_patches, 3, patch_size, patch_size]
    (all images one after another) and `grid_thws` [num_images, 3] (1, rows, columns of patches).
    """

    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(
        self,
        patch_size: int = 14,
        merge_kernel_size: int = 2,
        in_patch_limit: int = 65536,
        patch_limit_on_one_side: int = 512,
        image_mean: tuple[float, ...] = (0.5, 0.5, 0.5),
        image_std: tuple[float, ...] = (0.5, 0.5, 0.5),
        transparent_bg_config: dict | None = None,
        transparent_bg_fill_stage: str = "after_resize",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if transparent_bg_fill_stage not in FILL_STAGES:
            raise ValueError(f"transparent_bg_fill_stage={transparent_bg_fill_stage!r}; allowed: {FILL_STAGES}")
        self.patch_size = patch_size
        self.merge_kernel_size = merge_kernel_size
        self.in_patch_limit = in_patch_limit
        self.patch_limit_on_one_side = patch_limit_on_one_side
        self.image_mean = list(image_mean)
        self.image_std = list(image_std)
        self.transparent_bg_config = dict(transparent_bg_config or RELEASE_TRANSPARENT_BACKGROUND)
        self.transparent_bg_fill_stage = transparent_bg_fill_stage

    def plan(self, width: int, height: int) -> tuple[int, int, int, int]:
        """`navit_plan` within the budget, shrunk further while the padding takes the image past
        in_patch_limit / merge² tokens, as the release does."""
        limit, most_tokens = self.in_patch_limit, self.in_patch_limit // self.merge_kernel_size**2
        while True:
            plan = navit_plan(width, height, self.patch_size, self.merge_kernel_size, limit, self.patch_limit_on_one_side)
            tokens = self.tokens_of(plan)
            if tokens <= most_tokens:
                return plan
            limit = min(limit - 1, int(limit * most_tokens / tokens))

    def tokens_of(self, plan: tuple[int, int, int, int]) -> int:
        group = self.patch_size * self.merge_kernel_size
        return (plan[2] // group) * (plan[3] // group)

    def number_of_image_tokens(self, width: int, height: int) -> int:
        """Language-model tokens of a ``width`` x ``height`` image."""
        return self.tokens_of(self.plan(width, height))

    def fill_transparent(self, image: Image.Image) -> Image.Image:
        if image.mode not in ("RGBA", "LA", "PA") and "transparency" not in image.info:
            return image
        rgba = np.asarray(image.convert("RGBA"), dtype=np.float32)
        alpha = rgba[:, :, 3:] / 255.0
        background = chessboard(image.width, image.height, self.transparent_bg_config)
        return Image.fromarray((alpha * rgba[:, :, :3] + (1 - alpha) * background).astype(np.uint8))

    def pixels(self, image: Image.Image, index: int) -> np.ndarray:
        """[3, padded_height, padded_width] normalised float32 pixels of one image."""
        if image.width < self.patch_size or image.height < self.patch_size:
            raise ValueError(
                f"image {index} is {image.width} x {image.height} pixels; each side needs at least one "
                f"{self.patch_size}-pixel patch"
            )
        new_width, new_height, padded_width, padded_height = self.plan(image.width, image.height)
        if self.transparent_bg_fill_stage == "before_resize":
            image = self.fill_transparent(image)
        keeps_alpha = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
        image = image.convert("RGBA" if keeps_alpha else "RGB").resize((new_width, new_height), Image.Resampling.BICUBIC)
        rgb = np.asarray(self.fill_transparent(image).convert("RGB"), dtype=np.float32) / 255.0
        rgb = (rgb - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        padded = np.zeros((padded_height, padded_width, 3), np.float32)
        padded[:new_height, :new_width] = rgb
        return padded.transpose(2, 0, 1)

    def preprocess(self, images, return_tensors="pt", **kwargs) -> BatchFeature:
        images = images if isinstance(images, (list, tuple)) else [images]
        if not images:
            raise ValueError("no images given; pass at least one, or call the processor without `images`")
        patches, grids = [], []
        for index, image in enumerate(images):
            pixels = torch.from_numpy(self.pixels(as_pil_image(image, index), index))
            rows, columns = pixels.shape[1] // self.patch_size, pixels.shape[2] // self.patch_size
            cut = pixels.reshape(3, rows, self.patch_size, columns, self.patch_size).permute(1, 3, 0, 2, 4)
            patches.append(cut.reshape(rows * columns, 3, self.patch_size, self.patch_size))
            grids.append([1, rows, columns])
        data = {"pixel_values": torch.cat(patches), "grid_thws": torch.tensor(grids)}
        return BatchFeature(data=data, tensor_type=return_tensors)


class KimiK3Processor(ProcessorMixin):
    r"""
    Tokenises prompts and preprocesses their images. A prompt holds one ``image_token`` (the release's
    ``<|media_pad|>``) per image, in the order of `images`; the model replaces each with that image's tokens.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, image_token="<|media_pad|>", **kwargs):
        self.image_token = image_token
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, images=None, text=None, return_tensors="pt", **kwargs) -> BatchFeature:
        texts = [text] if isinstance(text, str) else list(text or [])
        images = [] if images is None else (images if isinstance(images, (list, tuple)) else [images])
        # One list per text, as TRL's collators pass them, flattened in order (single images may sit between them).
        images = [image for entry in images for image in (entry if isinstance(entry, (list, tuple)) else [entry])]
        placeholders = sum(prompt.count(self.image_token) for prompt in texts)
        if placeholders != len(images):
            raise ValueError(
                f"the text holds {placeholders} {self.image_token} placeholder(s) for {len(images)} image(s); put one "
                "where each image goes"
            )
        data = dict(self.tokenizer(texts, return_tensors=return_tensors, **kwargs)) if texts else {}
        if images:
            data.update(self.image_processor(images, return_tensors=return_tensors))
        return BatchFeature(data=data, tensor_type=return_tensors)

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "pixel_values", "grid_thws"]


KimiK3ImageProcessor.register_for_auto_class("AutoImageProcessor")
KimiK3Processor.register_for_auto_class("AutoProcessor")

__all__ = ["KimiK3ImageProcessor", "KimiK3Processor"]

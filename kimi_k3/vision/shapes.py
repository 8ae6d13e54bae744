"""An image-caption set drawn at run time: coloured shapes on plain backgrounds, each captioned with its colour and
shape ("a red circle"), so a vision-language run needs no download. Image sizes vary (28 to 84 pixels a side, not
square in general), so the tower sees several patch grids and its position table is interpolated.
"""

import random

import datasets
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = ((245, 245, 245), (30, 30, 30), (150, 150, 150))
SIDES = (28, 42, 56, 70, 84)


def draw_shape(shape: str, colour: tuple[int, int, int], width: int, height: int, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (width, height), rng.choice(BACKGROUNDS))
    size = rng.randint(min(width, height) // 2, min(width, height) - 4)
    left, top = rng.randint(0, width - size), rng.randint(0, height - size)
    box = (left, top, left + size - 1, top + size - 1)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(left + size // 2, top), (left, top + size - 1), (left + size - 1, top + size - 1)], fill=colour)
    return image


def shapes_dataset(num_images: int, seed: int = 0) -> datasets.Dataset:
    """``num_images`` rows of ``image`` (PIL) and ``text`` (its caption), the same for a given seed."""
    rng = random.Random(seed)
    rows = {"image": [], "text": []}
    for _ in range(num_images):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        rows["image"].append(draw_shape(shape, COLOURS[colour], rng.choice(SIDES), rng.choice(SIDES), rng))
        rows["text"].append(f"a {colour} {shape}")
    return datasets.Dataset.from_dict(rows, features=datasets.Features(image=datasets.Image(), text=datasets.Value("string")))

"""A captioned synthetic dataset drawn in code: coloured shapes on a coloured background.

Every image is a function of ``(seed, index)`` only: :func:`sample` seeds its own ``numpy`` generator from
``SeedSequence([seed, index])`` and draws with PIL, so the same pair gives the same pixels and caption on every
machine, in any order, in any process. One or two objects per image:

* one object: ``"a small red star at the top left on a blue background"``;
* two objects: ``"a large red circle left of a small green square on a blue background"`` (the relation is
  ``left of`` / ``right of`` when the columns differ, else ``above`` / ``below``).

The two objects always sit in different cells of a 3x3 grid, have different colours from the background, and differ
from each other in shape or colour (so the caption tells them apart). Shapes are drawn at 4x the output size and
downsampled with a box filter (clean antialiased edges); objects are flat colour, backgrounds a linear gradient of
their named colour with a light noise texture.

The labels of an image (what the classifier of :mod:`research.shapes.classifier` predicts) are those of its
*first* object (the one the caption names first) and the background. In a two-object caption the first object's
position is not named (only the relation is), so its label ``position_known`` is ``False`` there.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "SHAPES",
    "COLOURS",
    "COLOUR_RGB",
    "BACKGROUNDS",
    "SIZES",
    "POSITIONS",
    "LABEL_KEYS",
    "VOCABULARY",
    "sample",
    "object_mask",
    "batch",
    "label_indices",
    "to_image",
    "grid",
]

SHAPES: Tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
# Named colours far apart in RGB (every pair more than 100 apart; black is not used: the VAE's
# shading of dark shapes on dark backgrounds would be the hardest case for no gain)
COLOUR_RGB: Dict[str, Tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 130, 0),
    "yellow": (245, 230, 30),
    "green": (30, 170, 50),
    "cyan": (30, 210, 230),
    "blue": (30, 60, 220),
    "purple": (150, 40, 200),
    "white": (245, 245, 245),
}
COLOURS: Tuple[str, ...] = tuple(COLOUR_RGB)
# Backgrounds: also named colours, darker/paler than objects of the same name would be; an object never has the
# background's colour
BACKGROUND_RGB: Dict[str, Tuple[int, int, int]] = {
    "black": (25, 25, 30),
    "gray": (128, 128, 128),
    "blue": (40, 70, 160),
    "green": (40, 120, 60),
    "brown": (120, 75, 40),
    "white": (235, 235, 235),
}
BACKGROUNDS: Tuple[str, ...] = tuple(BACKGROUND_RGB)
SIZES: Tuple[str, ...] = ("small", "large")
_SIZE_RADIUS = {"small": 0.075, "large": 0.12}  # half the object's extent, as a fraction of the image side
# The 3x3 grid, row-major; the names are what the captions say after "at the"
POSITIONS: Tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)
LABEL_KEYS: Tuple[str, ...] = ("shape", "colour", "position", "background")
_CELL_CENTRES = (1 / 6, 3 / 6, 5 / 6)
_JITTER = 0.02  # fraction of the side an object's centre may move off its cell's centre
_SUPERSAMPLE = 4
_TWO_OBJECTS_PROBABILITY = 0.4


def _words() -> List[str]:
    words = ["a", "at", "the", "on", "background", "of", "above", "below"]
    words += list(SIZES) + list(SHAPES) + list(COLOURS) + list(BACKGROUNDS)
    for position in POSITIONS:
        words += position.split()
    return sorted(set(words))


VOCABULARY: Tuple[str, ...] = tuple(_words())  # every word a caption can hold


def _rng(seed: int, index: int) -> np.random.Generator:
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0; got seed={seed}, index={index}")
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(index)]))


def _shape_points(shape: str, cx: float, cy: float, r: float, angle: float) -> List[Tuple[float, float]]:
    """Polygon vertices of ``shape`` centred at ``(cx, cy)`` with circumradius ``r`` (pixels), rotated by ``angle``."""
    if shape == "square":
        corners = [np.pi / 4 + k * np.pi / 2 for k in range(4)]
        radii = [r] * 4
    elif shape == "triangle":
        corners = [-np.pi / 2 + k * 2 * np.pi / 3 for k in range(3)]
        radii = [r * 1.15] * 3
    elif shape == "star":
        corners = [-np.pi / 2 + k * np.pi / 5 for k in range(10)]
        radii = [r * 1.2 if k % 2 == 0 else r * 0.5 for k in range(10)]
    elif shape == "cross":
        arm = 0.36  # half the arm's width relative to r
        pts = [(arm, 1), (arm, arm), (1, arm), (1, -arm), (arm, -arm), (arm, -1),
               (-arm, -1), (-arm, -arm), (-1, -arm), (-1, arm), (-arm, arm), (-arm, 1)]
        corners = [np.arctan2(y, x) for x, y in pts]
        radii = [r * np.hypot(x, y) for x, y in pts]
    else:
        raise ValueError(f"shape must be one of {SHAPES} (circles are drawn as ellipses); got {shape!r}")
    return [(cx + rad * np.cos(a + angle), cy + rad * np.sin(a + angle)) for a, rad in zip(corners, radii)]


def _draw_object(draw: ImageDraw.ImageDraw, obj: Dict[str, Any], side: int, fill) -> None:
    """Draw ``obj`` on a canvas of ``side`` pixels (the supersampled one) with ``fill``."""
    cx, cy, r = obj["cx"] * side, obj["cy"] * side, _SIZE_RADIUS[obj["size"]] * side
    if obj["shape"] == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon(_shape_points(obj["shape"], cx, cy, r, obj["angle"]), fill=fill)


def _background(rng: np.random.Generator, name: str, size: int) -> np.ndarray:
    """A float ``[size, size, 3]`` gradient of background colour ``name`` with a light noise texture."""
    base = np.asarray(BACKGROUND_RGB[name], dtype=np.float64)
    direction = rng.uniform(0, 2 * np.pi)
    strength = rng.uniform(0.1, 0.25)
    axis = (np.arange(size) + 0.5) / size - 0.5
    ramp = np.cos(direction) * axis[None, :] + np.sin(direction) * axis[:, None]  # in [-0.71, 0.71]
    shade = 1.0 + strength * ramp
    pixels = base[None, None, :] * shade[:, :, None] + 20.0 * strength * ramp[:, :, None]
    pixels += rng.normal(0.0, 4.0, (size, size, 1))  # a grey grain, the same on all channels
    return pixels


def _draw_objects(rng: np.random.Generator, background: str) -> List[Dict[str, Any]]:
    count = 2 if rng.random() < _TWO_OBJECTS_PROBABILITY else 1
    cells = rng.choice(len(POSITIONS), size=count, replace=False)
    colours = [c for c in COLOURS if c != background]
    objects: List[Dict[str, Any]] = []
    for cell in cells:
        while True:
            shape, colour = SHAPES[rng.integers(len(SHAPES))], colours[rng.integers(len(colours))]
            if not any(o["shape"] == shape and o["colour"] == colour for o in objects):
                break
        row, column = divmod(int(cell), 3)
        objects.append({
            "shape": shape,
            "colour": colour,
            "size": SIZES[rng.integers(len(SIZES))],
            "position": POSITIONS[int(cell)],
            "row": row,
            "column": column,
            "cx": _CELL_CENTRES[column] + rng.uniform(-_JITTER, _JITTER),
            "cy": _CELL_CENTRES[row] + rng.uniform(-_JITTER, _JITTER),
            "angle": float(rng.uniform(-0.25, 0.25)),  # a slight tilt (radians) for polygons
        })
    return objects


def _relation(first: Dict[str, Any], second: Dict[str, Any]) -> str:
    """Where ``first`` is relative to ``second``: left of / right of when their columns differ, else above/below."""
    if first["column"] != second["column"]:
        return "left of" if first["column"] < second["column"] else "right of"
    return "above" if first["row"] < second["row"] else "below"


def _caption(objects: Sequence[Dict[str, Any]], background: str) -> str:
    first = objects[0]
    phrase = f"a {first['size']} {first['colour']} {first['shape']}"
    if len(objects) == 1:
        phrase += f" at the {first['position']}"
    else:
        second = objects[1]
        phrase += f" {_relation(first, second)} a {second['size']} {second['colour']} {second['shape']}"
    return f"{phrase} on a {background} background"


def _describe(seed: int, index: int) -> Tuple[np.random.Generator, str, List[Dict[str, Any]]]:
    rng = _rng(seed, index)
    background = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    return rng, background, _draw_objects(rng, background)


def sample(index: int, seed: int = 0, size: int = 64) -> Tuple[Image.Image, str, Dict[str, Any]]:
    """Image ``index`` of the dataset drawn from ``seed``: ``(RGB PIL image of size x size, caption, labels)``.

    ``labels`` holds ``shape``, ``colour``, ``position``, ``size`` (of the first object), ``background``,
    ``position_known`` (whether the caption names that position: one-object images), ``n_objects`` and
    ``objects`` (every object's fields, centres as fractions of the side).

    >>> image, caption, labels = sample(3, seed=0)
    >>> image.size, caption == sample(3, seed=0)[1]
    ((64, 64), True)
    """
    if size < 16:
        raise ValueError(f"size must be >= 16 pixels; got {size}")
    rng, background, objects = _describe(seed, index)
    big = size * _SUPERSAMPLE
    pixels = _background(rng, background, big)
    canvas = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(canvas)
    for obj in objects:
        _draw_object(draw, obj, big, COLOUR_RGB[obj["colour"]])
    image = canvas.resize((size, size), Image.BOX)
    first = objects[0]
    labels = {
        "shape": first["shape"],
        "colour": first["colour"],
        "position": first["position"],
        "size": first["size"],
        "background": background,
        "position_known": len(objects) == 1,
        "n_objects": len(objects),
        "objects": objects,
    }
    return image, _caption(objects, background), labels


def object_mask(labels: Dict[str, Any], which: int = 0, size: int = 64) -> np.ndarray:
    """Coverage in [0, 1] (float ``[size, size]``) of object ``which`` of an image with ``labels``: 1 where the
    object covers the whole pixel, fractions on its antialiased edge (the same supersampling as :func:`sample`;
    an object drawn later may cover part of it)."""
    big = size * _SUPERSAMPLE
    canvas = Image.new("L", (big, big), 0)
    _draw_object(ImageDraw.Draw(canvas), labels["objects"][which], big, 255)
    return np.asarray(canvas.resize((size, size), Image.BOX), dtype=np.float64) / 255.0


def label_indices(labels: Dict[str, Any]) -> Dict[str, int]:
    """The class indices of ``labels`` for the classifier: shape, colour, position and background. On two-object
    images the first object's shape, colour and position are ``-1`` (no target): the image alone does not tell
    which object the caption names first, and the caption does not name the position."""
    single = labels["n_objects"] == 1
    return {
        "shape": SHAPES.index(labels["shape"]) if single else -1,
        "colour": COLOURS.index(labels["colour"]) if single else -1,
        "position": POSITIONS.index(labels["position"]) if single else -1,
        "background": BACKGROUNDS.index(labels["background"]),
    }


def batch(
    indices: Sequence[int], seed: int = 0, size: int = 64
) -> Tuple[np.ndarray, List[str], Dict[str, np.ndarray]]:
    """Images ``indices`` of the dataset drawn from ``seed`` as ``(float32 [N, 3, size, size] in [-1, 1],
    captions, {label key: int64 [N] class indices})`` (see :func:`label_indices`)."""
    images, captions = [], []
    targets: Dict[str, List[int]] = {key: [] for key in LABEL_KEYS}
    for index in indices:
        image, caption, labels = sample(int(index), seed, size)
        images.append(np.asarray(image, dtype=np.float32).transpose(2, 0, 1))
        captions.append(caption)
        for key, value in label_indices(labels).items():
            targets[key].append(value)
    if not images:
        raise ValueError("indices must name at least one image")
    array = np.stack(images) / 127.5 - 1.0
    return array.astype(np.float32), captions, {k: np.asarray(v, dtype=np.int64) for k, v in targets.items()}


def to_image(array: np.ndarray) -> Image.Image:
    """A ``[3, H, W]`` (or ``[H, W, 3]``) float array in [-1, 1] as a PIL image (for looking at batches)."""
    if array.ndim != 3:
        raise ValueError(f"array must have 3 dimensions; got shape {array.shape}")
    if array.shape[0] == 3 and array.shape[-1] != 3:
        array = array.transpose(1, 2, 0)
    return Image.fromarray(np.clip(np.rint((array + 1.0) * 127.5), 0, 255).astype(np.uint8), "RGB")


def grid(images: Sequence[Image.Image], columns: int = 8, pad: int = 2) -> Image.Image:
    """``images`` (same size) tiled into one picture, ``columns`` per row, ``pad`` grey pixels apart."""
    if not images:
        raise ValueError("images must hold at least one image")
    w, h = images[0].size
    rows = -(-len(images) // columns)
    sheet = Image.new("RGB", (columns * (w + pad) + pad, rows * (h + pad) + pad), (90, 90, 90))
    for k, image in enumerate(images):
        r, c = divmod(k, columns)
        sheet.paste(image, (pad + c * (w + pad), pad + r * (h + pad)))
    return sheet


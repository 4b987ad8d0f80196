"""The README figure: what one ToMe plan does to a token grid, drawn from a real plan of the merge core.

Three panels on a ``grid x grid`` token image: the tokens; the plan (dst tokens outlined, every merged src token
filled with the colour of the dst it joined, unmerged src left plain); and ``unmerge(merge(tokens))``, the image
the attention layer effectively sees.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import paddle
from PIL import Image, ImageDraw, ImageFont

from . import merge

__all__ = ["scene_tokens", "draw_plan_figure", "side_by_side", "save_png", "row_layout", "RowLayout", "MIN_TILE"]


def scene_tokens(grid: int) -> np.ndarray:
    """A small RGB scene (sky gradient, sun, hills, a lake) as a ``grid x grid x 3`` array in [0, 1]: large flat
    areas that ToMe merges freely, and edges that it keeps."""
    y, x = np.mgrid[0:grid, 0:grid] / max(grid - 1, 1)
    sky = np.stack([0.35 + 0.4 * y, 0.55 + 0.3 * y, 0.95 - 0.2 * y], axis=-1)
    image = sky.copy()
    sun = (x - 0.72) ** 2 + (y - 0.22) ** 2 < 0.012
    image[sun] = (1.0, 0.85, 0.3)
    hills = y > 0.55 + 0.12 * np.sin(x * 7.0)
    image[hills] = np.stack([0.2 + 0.1 * x, 0.5 - 0.2 * y, 0.2 + 0 * x], axis=-1)[hills]
    lake = (y > 0.8) & (np.abs(x - 0.35) < 0.22)
    image[lake] = (0.2, 0.35, 0.7)
    return image


def _group_colours(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    hues = rng.permutation(count) / max(count, 1)
    return np.array([colorsys.hsv_to_rgb(h, 0.65, 0.95) for h in hues])


def draw_plan_figure(ratio: float = 0.5, grid: int = 24, cell: int = 14, seed: int = 0) -> Tuple[Image.Image, dict]:
    """Draw the three panels for one plan at ``ratio`` (2 x 2 strides, random dst per cell); returns the image and
    a few numbers about the plan (tokens, dst, merged).

    >>> image, info = draw_plan_figure(ratio=0.5, grid=8, cell=4)
    >>> info["tokens"], info["merged"]
    (64, 32)
    """
    tokens = scene_tokens(grid)
    r = int(grid * grid * ratio)
    # the same pixels on every machine: the CPU kernels always (the GPU branch rounds its means differently), the
    # plan keyed by ``seed`` alone (never Paddle's global RNG), and colours rounded, not truncated, to 8 bits
    # (asked of this plan only: the process-wide DEVICE_OVERRIDE of another thread is neither read nor changed)
    metric = paddle.to_tensor(tokens.reshape(1, grid * grid, 3).astype("float32"), place=paddle.CPUPlace())
    plan = merge.bipartite_soft_matching_random2d(metric, grid, grid, 2, 2, r, generator=seed, kind="cpu")
    round_trip = plan.unmerge(plan.merge(metric)).numpy().reshape(grid, grid, 3)

    dst = plan.dst_pos.numpy() if plan.dst_pos is not None else np.zeros(0, dtype=np.int64)  # none when r == 0
    colours = _group_colours(len(dst), seed)
    colour_of = {int(p): colours[i] for i, p in enumerate(dst)}
    plan_rgb = tokens * 0.35 + 0.65  # unmerged src: a pale version of the token
    for pos in dst:
        plan_rgb[pos // grid, pos % grid] = colour_of[int(pos)]
    if not plan.is_identity:
        for pos, into in zip(plan.merged_pos.numpy()[0], plan.merged_into.numpy()[0]):
            plan_rgb[pos // grid, pos % grid] = colour_of[int(into)]

    side, gap, label = grid * cell, 10, 18
    canvas = Image.new("RGB", (3 * side + 4 * gap, side + label + gap), "white")
    draw = ImageDraw.Draw(canvas)
    titles = ("tokens", f"plan: ratio {ratio:g} (outlined = dst)", "unmerge(merge(tokens))")
    for panel, (rgb, title) in enumerate(zip((tokens, plan_rgb, round_trip), titles)):
        left = gap + panel * (side + gap)
        pixels = (np.clip(rgb, 0, 1) * 255).round().astype("uint8").repeat(cell, 0).repeat(cell, 1)
        canvas.paste(Image.fromarray(pixels), (left, label))
        draw.text((left, 3), title, fill="black")
        if panel == 1:
            for pos in dst:
                y0, x0 = label + (pos // grid) * cell, left + (pos % grid) * cell
                draw.rectangle([x0, y0, x0 + cell - 1, y0 + cell - 1], outline="black", width=2)
    info = {"tokens": grid * grid, "dst": len(dst), "merged": plan.r, "grid": grid, "ratio": ratio}
    return canvas, info


def save_png(image: Image.Image, path: str) -> None:
    """Save ``image`` as a PNG that depends on its pixels alone: no text chunks (software, dates) and fixed
    compression settings, so that the same figure gives the same bytes every time with one Pillow and zlib."""
    image.save(path, format="PNG", optimize=False, compress_level=9)


@dataclass
class RowLayout:
    """Where :func:`side_by_side` puts everything: the canvas ``size``, the nearest-neighbour ``scale`` of the
    images, the ``tile`` size every image is shown at, the label ``font_size``, one ``tile_boxes`` and one
    ``text_boxes`` entry per image (``(left, top, right, bottom)``; a text box is the ink of the label as drawn)
    and the ``labels`` as drawn (shortened with ``...`` only when one would not fit its tile even at the smallest
    font size)."""

    size: Tuple[int, int]
    scale: int
    tile: Tuple[int, int]
    font_size: int
    label_height: int
    tile_boxes: List[Tuple[int, int, int, int]]
    text_boxes: List[Tuple[int, int, int, int]]
    labels: List[str]


MIN_TILE = 128  # px: the shortest side an image is shown at in a labelled row
GAP = 6  # px of white between two tiles
_PAD = 3  # px around a label
_FONT_SIZES = tuple(range(16, 7, -1))  # largest first; the labels of one row share the largest that fits


def _font(size: int) -> ImageFont.ImageFont:
    """Pillow's built-in font at ``size`` px (its fixed-size bitmap font when Pillow has no FreeType)."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # pragma: no cover - Pillow < 10.1 or without FreeType
        return ImageFont.load_default()


def _text_width(font: ImageFont.ImageFont, text: str) -> int:
    left, _, right, _ = font.getbbox(text)
    return int(right - left)


def _shorten(font: ImageFont.ImageFont, text: str, room: int) -> str:
    if _text_width(font, text) <= room:
        return text
    while text and _text_width(font, text + "...") > room:
        text = text[:-1]
    return text + "..."


def row_layout(sizes: Sequence[Tuple[int, int]], labels: Sequence[str], min_tile: int = MIN_TILE) -> RowLayout:
    """The layout of a labelled row of images of ``sizes`` (``(width, height)``; every image is shown at the size
    of the first): images whose shorter side is under ``min_tile`` px are enlarged by a whole factor (nearest
    neighbour, so each pixel stays a sharp square), the labels sit in their own row above the tiles, centred,
    in one font size that fits every label inside its tile, and tiles are ``GAP`` px apart, so no two labels touch.

    >>> layout = row_layout([(32, 32)] * 3, ["vanilla", "ToMe 0.50", "|diff| x4 (0.50)"])
    >>> layout.scale, layout.tile
    (4, (128, 128))
    """
    if not sizes or len(sizes) != len(labels):
        raise ValueError(f"side_by_side needs one label per image and at least one image; got {len(sizes)} images "
                         f"and {len(labels)} labels")
    width, height = sizes[0]
    if min(width, height) < 1 or min_tile < 1:
        raise ValueError(f"images must be at least 1 px and min_tile at least 1; got {width}x{height}, {min_tile}")
    scale = max(1, math.ceil(min_tile / min(width, height)))
    tile = (width * scale, height * scale)
    room = tile[0] - 2 * _PAD
    font_size = next((s for s in _FONT_SIZES if all(_text_width(_font(s), t) <= room for t in labels)),
                     _FONT_SIZES[-1])
    font = _font(font_size)
    drawn = [_shorten(font, text, room) for text in labels]
    ascent, descent = font.getmetrics()
    label_height = ascent + descent + 2 * _PAD
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    tile_boxes, text_boxes = [], []
    for i, text in enumerate(drawn):
        left = i * (tile[0] + GAP)
        tile_boxes.append((left, label_height, left + tile[0], label_height + tile[1]))
        x = left + (tile[0] - _text_width(font, text)) // 2 - font.getbbox(text)[0]
        text_boxes.append(tuple(int(v) for v in probe.textbbox((x, _PAD), text, font=font)))
    size = (len(drawn) * tile[0] + (len(drawn) - 1) * GAP, label_height + tile[1])
    return RowLayout(size, scale, tile, font_size, label_height, tile_boxes, text_boxes, drawn)


def side_by_side(images: Sequence[Image.Image], labels: Sequence[str], min_tile: int = MIN_TILE) -> Image.Image:
    """The images in one row, each under its label (see :func:`row_layout`: small images are enlarged to at least
    ``min_tile`` px with nearest neighbour, every image is shown at the size of the first, labels in a row of
    their own that fit their tile).

    >>> from PIL import Image
    >>> row = side_by_side([Image.new("RGB", (8, 8)), Image.new("RGB", (8, 8))], ["vanilla", "ToMe"])
    >>> row.size[0], row.size[1] > 128  # two 128 px tiles 6 px apart, the label row above them
    (262, True)
    """
    layout = row_layout([image.size for image in images], labels, min_tile)
    canvas = Image.new("RGB", layout.size, "white")
    draw = ImageDraw.Draw(canvas)
    font = _font(layout.font_size)
    for image, tile_box, text_box, text in zip(images, layout.tile_boxes, layout.text_boxes, layout.labels):
        shown = image.convert("RGB")
        if shown.size != layout.tile:
            shown = shown.resize(layout.tile, Image.NEAREST)
        canvas.paste(shown, tile_box[:2])
        x = tile_box[0] + (layout.tile[0] - _text_width(font, text)) // 2 - font.getbbox(text)[0]
        draw.text((x, _PAD), text, fill="black", font=font)
    return canvas

"""Images for the demo: labelled rows of images (small ones enlarged with sharp pixels) and reproducible PNGs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

__all__ = ["MIN_TILE", "RowLayout", "annotate", "label_font", "row_layout", "save_png", "side_by_side"]


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

    size: tuple[int, int]
    scale: int
    tile: tuple[int, int]
    font_size: int
    label_height: int
    tile_boxes: list[tuple[int, int, int, int]]
    text_boxes: list[tuple[int, int, int, int]]
    labels: list[str]


MIN_TILE = 128  # px: the shortest side an image is shown at in a labelled row
GAP = 6  # px of white between two tiles
_PAD = 3  # px around a label
_FONT_SIZES = tuple(range(16, 7, -1))  # largest first; the labels of one row share the largest that fits


def label_font(size: int) -> ImageFont.ImageFont:
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


def row_layout(sizes: Sequence[tuple[int, int]], labels: Sequence[str], min_tile: int = MIN_TILE) -> RowLayout:
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
    font_size = next((s for s in _FONT_SIZES if all(_text_width(label_font(s), t) <= room for t in labels)),
                     _FONT_SIZES[-1])
    font = label_font(font_size)
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
    font = label_font(layout.font_size)
    for image, tile_box, text_box, text in zip(images, layout.tile_boxes, layout.text_boxes, layout.labels):
        shown = image.convert("RGB")
        if shown.size != layout.tile:
            shown = shown.resize(layout.tile, Image.NEAREST)
        canvas.paste(shown, tile_box[:2])
        x = tile_box[0] + (layout.tile[0] - _text_width(font, text)) // 2 - font.getbbox(text)[0]
        draw.text((x, _PAD), text, fill="black", font=font)
    return canvas


SCALE_HEIGHT = 10  # px of the grey ramp of a scale bar


def _wrapped(font: ImageFont.ImageFont, text: str, width: int) -> list[str]:
    """``text`` cut into lines no wider than ``width`` px (whole words; a word wider than the line stands alone)."""
    lines: list[str] = []
    for word in text.split():
        if lines and _text_width(font, lines[-1] + " " + word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def annotate(row: Image.Image, scale_box: tuple[int, int, int, int] | None = None, low: str = "0",
             high: str = "1", caption: str = "") -> Image.Image:
    """``row`` with, below it, a scale bar under the tile at ``scale_box`` (a black-to-white ramp from ``low`` to
    ``high``, labelled at its ends) and ``caption`` wrapped to the row's width.

    >>> from PIL import Image
    >>> image = annotate(Image.new("RGB", (200, 100), "white"), (100, 20, 200, 100), "0", "0.25", "a note")
    >>> image.size[0], image.size[1] > 100
    (200, True)
    """
    font = label_font(12)
    ascent, descent = font.getmetrics()
    line = ascent + descent + 2 * _PAD
    lines = _wrapped(font, caption, row.size[0] - 2 * _PAD) if caption else []
    bar = SCALE_HEIGHT + line + _PAD if scale_box is not None else 0
    canvas = Image.new("RGB", (row.size[0], row.size[1] + bar + len(lines) * line), "white")
    canvas.paste(row, (0, 0))
    draw = ImageDraw.Draw(canvas)
    if scale_box is not None:
        left, right, top = scale_box[0], scale_box[2], row.size[1] + _PAD
        for x in range(left, right):
            shade = round(255 * (x - left) / max(right - left - 1, 1))
            draw.line([(x, top), (x, top + SCALE_HEIGHT - 1)], fill=(shade, shade, shade))
        draw.rectangle([left, top, right - 1, top + SCALE_HEIGHT - 1], outline="black")
        draw.text((left, top + SCALE_HEIGHT), low, fill="black", font=font)
        draw.text((right - _text_width(font, high) - font.getbbox(high)[0], top + SCALE_HEIGHT), high, fill="black",
                  font=font)
    for i, text in enumerate(lines):
        draw.text((_PAD, row.size[1] + bar + i * line + _PAD), text, fill="black", font=font)
    return canvas

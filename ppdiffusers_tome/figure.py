"""The README figure: what one ToMe plan does to a token grid, drawn from a real plan of the merge core.

Three panels on a ``grid x grid`` token image: the tokens; the plan (dst tokens outlined, every merged src token
filled with the colour of the dst it joined, unmerged src left plain); and ``unmerge(merge(tokens))``, the image
the attention layer effectively sees.
"""

from __future__ import annotations

import colorsys
from typing import Sequence, Tuple

import numpy as np
import paddle
from PIL import Image, ImageDraw

from .merge import bipartite_soft_matching_random2d

__all__ = ["scene_tokens", "draw_plan_figure", "side_by_side"]


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
    metric = paddle.to_tensor(tokens.reshape(1, grid * grid, 3).astype("float32"))
    r = int(grid * grid * ratio)
    plan = bipartite_soft_matching_random2d(metric, grid, grid, 2, 2, r, generator=seed)
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
        pixels = (np.clip(rgb, 0, 1) * 255).astype("uint8").repeat(cell, 0).repeat(cell, 1)
        canvas.paste(Image.fromarray(pixels), (left, label))
        draw.text((left, 3), title, fill="black")
        if panel == 1:
            for pos in dst:
                y0, x0 = label + (pos // grid) * cell, left + (pos % grid) * cell
                draw.rectangle([x0, y0, x0 + cell - 1, y0 + cell - 1], outline="black", width=2)
    info = {"tokens": grid * grid, "dst": len(dst), "merged": plan.r, "grid": grid, "ratio": ratio}
    return canvas, info


def side_by_side(images: Sequence[Image.Image], labels: Sequence[str]) -> Image.Image:
    """The images in one row (each as large as the first), each with its label above it.

    >>> from PIL import Image
    >>> side_by_side([Image.new("RGB", (8, 8)), Image.new("RGB", (8, 8))], ["vanilla", "ToMe"]).size
    (16, 22)
    """
    width, height = images[0].size
    canvas = Image.new("RGB", (width * len(images), height + 14), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (image, label) in enumerate(zip(images, labels)):
        canvas.paste(image.convert("RGB"), (i * width, 14))
        draw.text((i * width + 2, 1), label, fill="black")
    return canvas

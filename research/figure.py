"""The plan figure of the docs: what one ToMe plan does to a token grid, drawn from a real plan of the merge core.

Three panels on a ``grid x grid`` token image: the tokens; the plan (dst tokens outlined, every merged src token
filled with the colour of the dst it joined, unmerged src left plain); and ``unmerge(merge(tokens))``, the image
the attention layer effectively sees.
"""

from __future__ import annotations

import argparse
import colorsys
import os
import sys
from typing import Optional, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw

import ppdiffusers_tome  # noqa: F401  (imported before Paddle: it keeps Paddle's import-time warnings quiet)
import paddle
from ppdiffusers_tome.ops.global_plan import bipartite_soft_matching_random2d
from ppdiffusers_tome.tools.images import save_png

__all__ = ["draw_plan_figure", "main", "scene_tokens"]


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
    metric = paddle.to_tensor(tokens.reshape(1, grid * grid, 3).astype("float32"), place=paddle.CPUPlace())
    plan = bipartite_soft_matching_random2d(metric, grid, grid, 2, 2, r, generator=seed, kind="cpu")
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




def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m research.figure [--ratio R] [--grid N] [--seed S] [--output PATH]``: draw the figure as a PNG."""
    parser = argparse.ArgumentParser(prog="python -m research.figure", description="draw one ToMe plan on a grid")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe ratio of the plan, in [0, 0.75)")
    parser.add_argument("--grid", type=int, default=24, help="tokens per side (>= 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random dst per cell and of the colours")
    parser.add_argument("--output", default=os.path.join("outputs", "tome_plan.png"), help="the PNG to write")
    args = parser.parse_args(argv)
    if not 0 <= args.ratio < 0.75:
        parser.error(f"--ratio must be in [0, 0.75) for 2x2 cells; got {args.ratio}")
    if args.grid < 2:
        parser.error(f"--grid must be an integer >= 2; got {args.grid}")
    if os.path.isdir(args.output):
        parser.error(f"--output {args.output} is a folder; give the path of the PNG to write")
    image, info = draw_plan_figure(ratio=args.ratio, grid=args.grid, seed=args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    save_png(image, args.output)
    print(f"{info['grid']}x{info['grid']} tokens, {info['dst']} dst, {info['merged']} merged at ratio "
          f"{args.ratio:g}: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

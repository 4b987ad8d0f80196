"""Reporting the ``demo`` command (one pipeline, vanilla and ToMe at one resolution, measured by the
:class:`~ppdiffusers_tome.tools.bench.Runner`): its result rows (:func:`demo_rows`), table (:func:`format_demo_table`)
and legend, the PNG grid of images (:func:`image_grid`), and the warning when its timed runs were noisy
(:func:`noise_warning`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from ..images import annotate, row_layout, side_by_side
from ..measure import median, render_table
from .report import merges_nothing, speedup_label, speedup_range, spread_warning, unstable
from .runner import Cell, RunOutputs

MIB = 1024.0 * 1024.0

DEMO_LEGEND = (
    "s/image: one pipeline call; UNet s/call: median UNet forward; speed-up: vanilla's s/image over the row's\n"
    "peak MiB: the most memory the process held during the call (resident set on CPU, Paddle's allocated bytes on "
    "GPU)\n"
    "added MiB: that peak minus what the process already held before the call (the call's own working memory)\n"
    "max |diff|: largest pixel difference to vanilla, pixels in 0..1; PSNR dB: against vanilla, higher is closer "
    "(inf: identical)"
)


def demo_label(method: str, ratio: float, cache: int | None = None) -> str:
    """``"vanilla"``, ``"ToMe 0.50"``, ``"ToDo"``, ``"cache 3"`` or ``"ToMe 0.50 + cache 3"``: how the demo names a
    row.

    >>> demo_label("tome", 0.5), demo_label("tome", 0.5, 3), demo_label("cache", 0.0, 3), demo_label("todo", 0.0)
    ('ToMe 0.50', 'ToMe 0.50 + cache 3', 'cache 3', 'ToDo')
    """
    if method == "cache":
        return f"cache {cache}"
    label = {"vanilla": "vanilla", "todo": "ToDo"}.get(method, f"ToMe {ratio:.2f}")
    return label if cache is None else f"{label} + cache {cache}"


def row_label(row: dict[str, Any]) -> str:
    return demo_label(row["method"], row["ratio"], row.get("cache"))


def first_image(outputs: RunOutputs) -> np.ndarray:
    """The first decoded image of a method's last timed run (float64, pixels in 0..1)."""
    return outputs.images[0]


def demo_rows(cells: Sequence[Cell], outputs: dict[str, RunOutputs]) -> list[dict[str, Any]]:
    """The demo's result rows from a one-resolution, batch-1 run of the runner (``cells[0]`` is vanilla). The UNet
    time is the median of every forward of every timed run (the first forward of each left out)."""
    reference = first_image(outputs[cells[0].label])
    rows = []
    for cell in cells:
        kept = outputs[cell.label]
        rows.append({
            "method": cell.method,
            "ratio": cell.ratio,
            "seconds_per_image": cell.seconds_per_image,
            "unet_seconds": median([t for run in kept.forward_seconds for t in run]),
            "speedup": cell.speedup,
            "peak_memory_bytes": cell.peak_memory_bytes,
            "added_memory_bytes": cell.added_memory_bytes,
            "memory_kind": cell.memory_kind,
            "max_abs_diff": float(np.abs(first_image(kept) - reference).max()),
            "psnr_db": cell.psnr_db,
            "runs_seconds": list(cell.runs_seconds),
            "speedup_range": list(speedup_range(cells[0].runs_seconds, cell.runs_seconds)),
            "merges_nothing": merges_nothing(cell),  # vanilla's twin: its speed-up is shown as "= vanilla"
            "cache": (cell.options.get("cache") or {}).get("interval"),  # the step cache's interval, or None
        })
    return rows


NOT_MEASURED = "?x (1 run)"  # the demo's speed-up from a single timed run: no number, since it is not a measurement


def _speedup(row: dict[str, Any]) -> str:
    """The speed-up column: ``"1.31x"``; ``"= vanilla"`` for a configuration that merged nothing; and no number
    (:data:`NOT_MEASURED`) from one timed run, where a busy machine alone can make it read 0.44x."""
    twin = bool(row.get("merges_nothing"))
    if row["method"] != "vanilla" and len(row["runs_seconds"]) == 1 and not twin:
        return NOT_MEASURED
    return speedup_label(row["speedup"], False, twin)


def single_run_note(rows: Sequence[dict[str, Any]], repeats: int = 1) -> str | None:
    """The note under the table when the speed-ups come from one timed run, else ``None``: the table shows none of
    them, and the note says why and what to run to measure. ``repeats`` is the number of timed runs per method asked
    for: 1 (``--repeats 1``), or more when a run stopped by Ctrl-C kept only its first round, which the note then says
    instead of naming an option the user did not pass.

    >>> single_run_note([{"method": "vanilla", "runs_seconds": [1.0]}, {"method": "tome", "runs_seconds": [0.9]}])[:60]
    'NOTE: one timed run per method (--repeats 1) checks that the'
    >>> single_run_note([{"method": "tome", "runs_seconds": [0.9]}], repeats=3)[:77]
    'NOTE: one timed run per method (the run was stopped after the first of its 3)'
    """
    if not any(row["method"] != "vanilla" and len(row["runs_seconds"]) == 1 for row in rows):
        return None
    why = "--repeats 1" if repeats == 1 else f"the run was stopped after the first of its {repeats}"
    measure = ("Run with --repeats 3 (the default) or more to measure it." if repeats == 1 else
               f"A run that finishes its {repeats} timed runs per method measures it.")
    return (f"NOTE: one timed run per method ({why}) checks that the demo runs; it does not measure speed. A "
            "single run on a shared machine is often 20% off either way and far more on a busy one (ToMe can then "
            f"look slower than vanilla), so the speed-up column reads '{NOT_MEASURED}' instead of a number. {measure}")


def _method_cell(row: dict[str, Any]) -> str:
    """The table's method column: ``tome``, ``todo``, ``cache 3``, ``tome + cache 3``."""
    if row.get("cache") is None:
        return row["method"]
    return f"cache {row['cache']}" if row["method"] == "cache" else f"{row['method']} + cache {row['cache']}"


def format_demo_table(rows: list[dict[str, Any]]) -> str:
    """The demo's table: one row per method with time, speed-up, memory and difference to vanilla."""
    header = ["method", "ratio", "s/image", "UNet s/call", "speed-up", "peak MiB", "added MiB", "max |diff|", "PSNR dB"]
    lines = [header]
    for row in rows:
        lines.append(
            [
                _method_cell(row),
                f"{row['ratio']:.2f}",
                f"{row['seconds_per_image']:.2f}",
                f"{row['unet_seconds']:.3f}",
                _speedup(row),
                f"{row['peak_memory_bytes'] / MIB:.0f}",
                f"{row['added_memory_bytes'] / MIB:.0f}",
                f"{row['max_abs_diff']:.4f}",
                "inf" if row["psnr_db"] == float("inf") else f"{row['psnr_db']:.1f}",
            ]
        )
    return render_table(lines)


DIFF_GAIN = 4.0  # the difference panel shows |ToMe - vanilla| x 4: white is a difference of 1/4 or more
SHAPES_CAPTION = ("What the shapes model can show: it draws the background colour a caption names and, most of the "
                  "time, the shape's colour; it does not draw a shape's outline or position reliably. Compare colours "
                  "and flat regions, not shapes.")
SHAPES_SD3_CAPTION = ("The SD3 shapes model (six MMDiT blocks, 256 image tokens) on the same task: compare colours and "
                      "flat regions; its scores are in docs/benchmarks.md.")


def image_grid(tiles: Sequence[np.ndarray], labels: Sequence[str]) -> Image.Image:
    """The images side by side (pixels in 0..1), each under its label:
    :func:`~ppdiffusers_tome.tools.images.side_by_side`, so images smaller than
    :data:`~ppdiffusers_tome.tools.images.MIN_TILE` px are enlarged (nearest neighbour) and the labels stay readable."""
    images = [Image.fromarray((np.clip(tile, 0, 1) * 255).round().astype("uint8")) for tile in tiles]
    return side_by_side(images, labels)


def demo_grid(rows: Sequence[dict[str, Any]], images: Sequence[np.ndarray], caption: str = "") -> Image.Image:
    """Vanilla's image, each ratio's, and the difference of the last one to vanilla (x :data:`DIFF_GAIN`),
    labelled; a scale bar under the difference (black 0, white 1/DIFF_GAIN or more, in pixel values 0..1) and
    ``caption`` under the row."""
    diff = np.clip(np.abs(images[-1] - images[0]) * DIFF_GAIN, 0, 1)
    last = rows[-1]
    against = f"{last['ratio']:.2f}" if last.get("cache") is None else row_label(last)
    labels = [row_label(r) for r in rows] + [f"|diff| x{DIFF_GAIN:g} ({against})"]
    tiles = list(images) + [diff]
    layout = row_layout([(tile.shape[1], tile.shape[0]) for tile in tiles], labels)
    return annotate(image_grid(tiles, labels), layout.tile_boxes[-1], "diff 0", f">= {1 / DIFF_GAIN:g}", caption)


def unstable_runs(rows: Sequence[dict[str, Any]], tolerance: float = 0.25) -> list[str]:
    """The rows whose timed runs spread by more than ``tolerance`` of their median (``(max - min) / median``),
    as ``"vanilla 1.00-4.00 s"``. Non-empty means the machine was busy while the demo ran.

    >>> unstable_runs([{"method": "vanilla", "ratio": 0.0, "runs_seconds": [1.0, 1.1, 4.0]},
    ...                {"method": "tome", "ratio": 0.5, "runs_seconds": [0.5, 0.52, 0.51]}])
    ['vanilla 1.00-4.00 s']
    """
    return unstable([(row_label(row), row["runs_seconds"]) for row in rows], tolerance)


def noise_warning(rows: Sequence[dict[str, Any]], tolerance: float = 0.25) -> str | None:
    """A warning for the demo's output when its timed runs varied by more than ``tolerance`` (see
    :func:`unstable_runs` and :func:`~ppdiffusers_tome.tools.bench.report.spread_warning`): the range each speed-up
    could take judged by single runs, and whether that range includes 1.00x (then the speed-up is not
    meaningful). ``None`` when the runs agree. ``rows[0]`` is vanilla."""
    named = [(row_label(row), row["runs_seconds"]) for row in rows]
    ranged = [name for (name, _), row in zip(named[1:], rows[1:]) if not row.get("merges_nothing")]
    return spread_warning(named, tolerance, ranged=ranged)

"""Reporting the ``demo`` command (one pipeline, vanilla and ToMe at one resolution, measured by the
:class:`~ppdiffusers_tome.bench.Runner`): its result rows (:func:`demo_rows`), table (:func:`format_demo_table`)
and legend, the PNG grid of images (:func:`image_grid`), and the warning when its timed runs were noisy
(:func:`noise_warning`)."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from ..figure import side_by_side
from ..measure import median, render_table
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


def demo_label(method: str, ratio: float) -> str:
    """``"vanilla"`` or ``"ToMe 0.50"``: how the demo names a row."""
    return "vanilla" if method == "vanilla" else f"ToMe {ratio:.2f}"


def first_image(outputs: RunOutputs) -> np.ndarray:
    """The first decoded image of a method's last timed run (float64, pixels in 0..1)."""
    return outputs.images[0]


def demo_rows(cells: Sequence[Cell], outputs: Dict[str, RunOutputs]) -> List[Dict[str, Any]]:
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
        })
    return rows


def format_demo_table(rows: List[Dict[str, Any]]) -> str:
    """The demo's table: one row per method with time, speed-up, memory and difference to vanilla."""
    header = ["method", "ratio", "s/image", "UNet s/call", "speed-up", "peak MiB", "added MiB", "max |diff|", "PSNR dB"]
    lines = [header]
    for row in rows:
        lines.append(
            [
                row["method"],
                f"{row['ratio']:.2f}",
                f"{row['seconds_per_image']:.2f}",
                f"{row['unet_seconds']:.3f}",
                f"{row['speedup']:.2f}x",
                f"{row['peak_memory_bytes'] / MIB:.0f}",
                f"{row['added_memory_bytes'] / MIB:.0f}",
                f"{row['max_abs_diff']:.4f}",
                "inf" if row["psnr_db"] == float("inf") else f"{row['psnr_db']:.1f}",
            ]
        )
    return render_table(lines)


def image_grid(tiles: Sequence[np.ndarray], labels: Sequence[str]) -> Image.Image:
    """The images side by side (pixels in 0..1), each under its label: :func:`~ppdiffusers_tome.figure.side_by_side`,
    so images smaller than :data:`~ppdiffusers_tome.figure.MIN_TILE` px are enlarged (nearest neighbour) and the
    labels stay readable."""
    images = [Image.fromarray((np.clip(tile, 0, 1) * 255).round().astype("uint8")) for tile in tiles]
    return side_by_side(images, labels)


def demo_grid(rows: Sequence[Dict[str, Any]], images: Sequence[np.ndarray]) -> Image.Image:
    """Vanilla's image, each ratio's, and the difference of the last one to vanilla (x4), labelled."""
    diff = np.clip(np.abs(images[-1] - images[0]) * 4.0, 0, 1)
    labels = [demo_label(r["method"], r["ratio"]) for r in rows] + [f"|diff| x4 ({rows[-1]['ratio']:.2f})"]
    return image_grid(list(images) + [diff], labels)


def unstable_runs(rows: Sequence[Dict[str, Any]], tolerance: float = 0.25) -> List[str]:
    """The rows whose timed runs spread by more than ``tolerance`` of their median (``(max - min) / median``),
    as ``"vanilla 1.00-4.00 s"``. Non-empty means the machine was busy while the demo ran.

    >>> unstable_runs([{"method": "vanilla", "ratio": 0.0, "runs_seconds": [1.0, 1.1, 4.0]},
    ...                {"method": "tome", "ratio": 0.5, "runs_seconds": [0.5, 0.52, 0.51]}])
    ['vanilla 1.00-4.00 s']
    """
    found = []
    for row in rows:
        runs = [float(t) for t in row["runs_seconds"]]
        if len(runs) > 1 and (max(runs) - min(runs)) > tolerance * statistics.median(runs):
            found.append(f"{demo_label(row['method'], row['ratio'])} {min(runs):.2f}-{max(runs):.2f} s")
    return found


def speedup_range(vanilla_runs: Sequence[float], runs: Sequence[float]) -> Tuple[float, float]:
    """The lowest and highest speed-up that pairs of single runs give: ``min(vanilla_runs) / max(runs)`` (fastest
    vanilla run against the slowest one) to ``max(vanilla_runs) / min(runs)``.

    >>> speedup_range([1.0, 4.0], [1.5, 2.0])
    (0.5, 2.6666666666666665)
    """
    return min(vanilla_runs) / max(runs), max(vanilla_runs) / min(runs)


def noise_warning(rows: Sequence[Dict[str, Any]], tolerance: float = 0.25) -> Optional[str]:
    """A warning for the demo's output when its timed runs varied by more than ``tolerance`` (see
    :func:`unstable_runs`): the range each speed-up could take judged by single runs, and whether that range
    includes 1.00x (then the speed-up is not meaningful). ``None`` when the runs agree. ``rows[0]`` is vanilla."""
    spread = unstable_runs(rows, tolerance)
    if not spread:
        return None
    ranges = [(demo_label(row["method"], row["ratio"]), *speedup_range(rows[0]["runs_seconds"], row["runs_seconds"]))
              for row in rows[1:]]
    between = ", ".join(f"{label} lies between {lo:.2f}x and {hi:.2f}x" for label, lo, hi in ranges)
    text = (
        f"WARNING: the timed runs varied a lot ({'; '.join(spread)}), so the machine was busy. Judged by single "
        f"runs, the speed-up of {between}."
    )
    if any(lo <= 1.0 <= hi for _, lo, hi in ranges):
        text += " Where that range includes 1.00x, the speed-up is not meaningful."
    return text + " Run again on an idle machine, or with more --repeats."

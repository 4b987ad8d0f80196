"""``bench --calibrate``: where merging starts to pay on this GPU, and the ``min_work`` line to paste.

On a GPU the default policy of :func:`ppdiffusers_tome.apply_tome` skips the blocks whose attention work,
``batch * tokens**2``, is below ``min_work``: there a plan costs more kernel launches than the attention it saves.
The default threshold comes from one GPU (docs/gpu.md); this measures it on the user's: one denoiser forward per
size, vanilla and every candidate forced to merge at every eligible block (the policy's own plan with ``min_work=0``,
and tomesd's plan), side by side, and takes the break-even of the policy's plan between the largest work at which
it lost and the smallest at which it gained.

The timing and the model are injected (:func:`calibrate` takes ``forward_for`` and ``timer``), so the logic is
tested on a CPU with stand-ins; the command itself refuses to run anywhere but on a GPU.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...api import apply_tome, remove_tome
from ...tome.policy import POOL_MIN_WORK
from ..measure import render_table

__all__ = ["CANDIDATES", "CalibrationPoint", "as_dict", "break_even", "calibrate", "format_calibration", "gpu_timer"]

# what is timed against vanilla: the policy's plan wherever a block is eligible, and tomesd's plan
CANDIDATES: dict[str, dict[str, Any]] = {"policy": {"min_work": 0}, "tomesd": {"policy": "tomesd"}}


@dataclass
class CalibrationPoint:
    """One size: ``work`` = UNet batch x finest-level tokens squared, and the seconds of one forward of vanilla and
    of each candidate."""

    resolution: int
    images: int
    unet_batch: int
    tokens: int
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def work(self) -> int:
        return self.unet_batch * self.tokens * self.tokens

    def speedup(self, candidate: str = "policy") -> float:
        return self.seconds["vanilla"] / self.seconds[candidate]


def break_even(points: Sequence[CalibrationPoint], candidate: str = "policy") -> int | None:
    """The ``min_work`` that separates the sizes where ``candidate`` lost (speed-up below 1) from those where it
    gained: the geometric mean of the largest losing work and the smallest gaining work above it. ``0`` when it
    gained everywhere; None when it gained at no size above every loss (then no threshold is safe).

    >>> p = lambda work, speedup: CalibrationPoint(0, 1, work, 1, {"vanilla": speedup, "policy": 1.0})
    >>> break_even([p(2**25, 0.9), p(2**27, 0.97), p(2**29, 1.1), p(2**31, 1.3)])
    268435456
    >>> break_even([p(2**25, 1.05)]), break_even([p(2**25, 0.9)])
    (0, None)
    """
    ordered = sorted(points, key=lambda point: point.work)
    losing = [point.work for point in ordered if point.speedup(candidate) < 1.0]
    if not losing:
        return 0
    above = [point.work for point in ordered if point.speedup(candidate) >= 1.0 and point.work > max(losing)]
    if not above:
        return None
    return int(round(math.sqrt(max(losing) * min(above))))


def calibrate(pipe: Any, resolutions: Sequence[int], images: Sequence[int],
              forward_for: Callable[[int, int], Callable[[], Any]], timer: Callable[[Callable[[], Any]], float],
              tokens_at: Callable[[int], int]) -> list[CalibrationPoint]:
    """Time one denoiser forward per size: vanilla, then every :data:`CANDIDATES` entry applied to ``pipe``.

    ``forward_for(resolution, images)`` returns a function that runs one forward of ``pipe``'s denoiser;
    ``timer(fn)`` returns its seconds (on a GPU: synchronised, median of repeats); ``tokens_at(resolution)`` the
    finest level's tokens. All methods run at one size before the next size starts, so that a drifting machine
    hits them alike. ToMe is off again when this returns.
    """
    points = []
    try:
        for resolution in resolutions:
            for count in images:
                forward = forward_for(resolution, count)
                point = CalibrationPoint(resolution, count, 2 * count, tokens_at(resolution))
                remove_tome(pipe)
                point.seconds["vanilla"] = timer(forward)
                for name, options in CANDIDATES.items():
                    apply_tome(pipe, ratio=0.5, **options)
                    point.seconds[name] = timer(forward)
                    remove_tome(pipe)
                points.append(point)
    finally:
        remove_tome(pipe)
    return points


def gpu_timer(synchronize: Callable[[], Any], clock: Callable[[], float], repeats: int = 5, warmup: int = 2
              ) -> Callable[[Callable[[], Any]], float]:
    """A timer for :func:`calibrate`: ``warmup`` untimed runs, then the median of ``repeats`` runs, each between two
    device synchronisations.

    >>> ticks = iter(range(100))
    >>> timer = gpu_timer(lambda: None, lambda: next(ticks), repeats=3, warmup=1)
    >>> timer(lambda: None)
    1.0
    """
    def timer(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            synchronize()
            start = clock()
            fn()
            synchronize()
            times.append(clock() - start)
        return float(statistics.median(times))

    return timer


def format_calibration(points: Sequence[CalibrationPoint]) -> str:
    """The table of the measured sizes, the policy's break-even and the line to paste."""
    names = list(CANDIDATES)
    rows = [["size", "images", "batch x tokens^2", "vanilla ms"] + [f"{name} ms (speed-up)" for name in names]]
    for point in sorted(points, key=lambda p: p.work):
        rows.append([f"{point.resolution}^2", str(point.images), f"{point.work:.3g}",
                     f"{point.seconds['vanilla'] * 1e3:.1f}"]
                    + [f"{point.seconds[name] * 1e3:.1f} ({point.speedup(name):.2f}x)" for name in names])
    found = break_even(points)
    lines = [render_table(rows), ""]
    if found is None:
        lines.append("The policy's plan gained at no measured size above its losses on this GPU: keep the default "
                     f"(min_work={POOL_MIN_WORK}) or measure larger sizes (--resolutions, --batch-sizes).")
    else:
        lines.append(f"Break-even of the policy's plan on this GPU: batch x tokens^2 = {found:.3g} (the default: "
                     f"{POOL_MIN_WORK:.3g}). Paste:")
        lines.append(f"    pipe.apply_tome(ratio=0.5, min_work={found})")
    return "\n".join(lines) + "\n"


def as_dict(points: Sequence[CalibrationPoint]) -> dict[str, Any]:
    """The JSON record of a calibration."""
    return {
        "points": [dict(vars(point), work=point.work, speedup={name: point.speedup(name) for name in CANDIDATES})
                   for point in points],
        "candidates": CANDIDATES, "break_even": break_even(points), "default_min_work": POOL_MIN_WORK,
    }

"""Plots of a benchmark (PNG files, with matplotlib): speed-up against ratio, peak memory against resolution or
ratio, the time split (:func:`write_plots`) and speed-up against fidelity with the Pareto front
(:func:`write_pareto_plot`). matplotlib is an optional dependency, imported only when a plot is drawn."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .report import effective_speedup, merges_nothing, pareto_front
from .runner import Cell

_MIB = 2**20


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend. Imported here, not at the top: matplotlib is optional
    (only plots need it) and slow to import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, ax: Any, path: str, xlabel: str | None, ylabel: str) -> str:
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # the same bytes for the same plot
    plt.close(fig)
    return path


def _speedup_plot(plt: Any, ok: list[Cell], folder: str) -> str:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for size, batch in sorted({(c.resolution, c.batch) for c in ok}):
        for name in ("tome", "builtin", "bound"):
            pts = sorted(  # a configuration that merged nothing is vanilla: drawn at 1.0, whatever its timing
                (c.ratio, effective_speedup(c)) for c in ok
                if (c.resolution, c.batch, c.method) == (size, batch, name) and c.speedup and not c.options
            )
            if pts:
                ax.plot([0.0] + [p[0] for p in pts], [1.0] + [p[1] for p in pts], marker="o",
                        linestyle="-" if name == "tome" else "--", label=f"{name} {size}px b{batch}")
    return _save(plt, fig, ax, os.path.join(folder, "speedup_vs_ratio.png"), "ratio", "speed-up vs vanilla")


def _memory_plot(plt: Any, ok: list[Cell], folder: str) -> str:
    """Memory against resolution, one line per method; with one resolution, against ratio (vanilla is ratio 0
    of each method's line)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    smallest_batch = min((c.batch for c in ok), default=1)
    rows = [c for c in ok if c.batch == smallest_batch and c.added_memory_bytes is not None]
    ylabel = "peak memory added by the call (MiB)"
    if len({c.resolution for c in rows}) > 1:
        for label in sorted({c.label for c in rows}):
            pts = sorted((c.resolution, c.added_memory_bytes / _MIB) for c in rows if c.label == label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        return _save(plt, fig, ax, os.path.join(folder, "memory_vs_resolution.png"), "resolution (px)", ylabel)
    vanilla = [c for c in rows if c.method == "vanilla"]
    for name in ("tome", "builtin", "bound"):
        pts = sorted((c.ratio, c.added_memory_bytes / _MIB) for c in rows if c.method == name and not c.options)
        if pts:
            pts = [(0.0, vanilla[0].added_memory_bytes / _MIB)] + pts if vanilla else pts
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    size = rows[0].resolution if rows else 0
    return _save(plt, fig, ax, os.path.join(folder, "memory_vs_ratio.png"), f"ratio ({size}px)", ylabel)


def _time_split_plot(plt: Any, split: dict[str, dict[str, float]], folder: str) -> str:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = list(split)
    bottom = np.zeros(len(names))
    for part in ("attention", "matching", "rest"):
        values = np.array([split[n][part] for n in names])
        ax.bar(names, values, bottom=bottom, label=part)
        bottom += values
    return _save(plt, fig, ax, os.path.join(folder, "time_split.png"), None, "seconds per UNet forward")


def write_plots(cells: list[Cell], split: dict[str, dict[str, float]], folder: str) -> list[str]:
    """Speed-up vs ratio per resolution, peak memory vs resolution (vs ratio when there is one resolution), the
    Pareto plots when there are more than two configurations, and the time split; returns the PNG paths."""
    plt = _pyplot()
    ok = [c for c in cells if c.status == "ok"]
    paths = [_speedup_plot(plt, ok, folder), _memory_plot(plt, ok, folder)]
    if len({c.label for c in ok if c.method != "bound"}) > 2:
        paths.extend(write_pareto_plot(cells, folder))
    if split:
        paths.append(_time_split_plot(plt, split, folder))
    return paths


def _pareto_groups(cells: list[Cell]) -> dict[tuple[int, int], list[Cell]]:
    """The points of each Pareto plot: every measured configuration but the bound and vanilla's twins."""
    groups: dict[tuple[int, int], list[Cell]] = {}
    for cell in cells:
        if cell.status == "ok" and cell.speedup is not None and cell.method != "bound" and not merges_nothing(cell):
            groups.setdefault((cell.resolution, cell.batch), []).append(cell)
    return groups


def _twins(cells: list[Cell], size: int, batch: int) -> list[str]:
    return [c.label for c in cells if (c.resolution, c.batch) == (size, batch) and merges_nothing(c)]


def write_pareto_plot(cells: list[Cell], folder: str) -> list[str]:
    """Speed-up against fidelity (PSNR when the cells have images, else relative L2), one point per
    configuration and one file per resolution x batch, the Pareto front joined by a line; a configuration that
    merged nothing is named beside vanilla instead of drawn at its timing; returns the paths."""
    plt = _pyplot()
    paths: list[str] = []
    for (size, batch), group in _pareto_groups(cells).items():
        use_psnr = all(c.psnr_db is not None for c in group)
        finite = [c.psnr_db for c in group if use_psnr and c.psnr_db != float("inf")]
        top = (max(finite) + 3.0) if finite else 1.0

        def y(c: Cell) -> float:
            if use_psnr:
                return top if c.psnr_db == float("inf") else c.psnr_db
            return c.rel_l2 if c.rel_l2 is not None else float("nan")

        twins = _twins(cells, size, batch)
        fig, ax = plt.subplots(figsize=(6, 4))
        front = sorted(pareto_front(group), key=lambda c: c.speedup)
        ax.plot([c.speedup for c in front], [y(c) for c in front], color="0.7", zorder=1, label="Pareto front")
        for c in group:
            colour = "tab:green" if c.method.startswith("todo") else "black" if c.method == "vanilla" else "tab:blue"
            ax.scatter([c.speedup], [y(c)], color=colour, zorder=2)
            # a configuration that merged nothing is no point of its own: it is named beside vanilla
            label = c.label if c.method != "vanilla" or not twins else f"vanilla = {', '.join(twins)}"
            ax.annotate(label, (c.speedup, y(c)), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel("speed-up vs vanilla")
        ax.set_ylabel("PSNR vs vanilla (dB; vanilla drawn at the top)" if use_psnr else "relative L2 to vanilla")
        if not use_psnr:
            ax.invert_yaxis()  # closer to vanilla is up in both kinds of plot
        ax.set_title(f"{size}x{size}, batch {batch}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
        fig.tight_layout()
        path = os.path.join(folder, f"pareto_{size}_b{batch}.png")
        fig.savefig(path, dpi=110, metadata={"Software": None})  # the same bytes for the same plot
        plt.close(fig)
        paths.append(path)
    return paths

"""Reporting a benchmark: the text tables (:func:`format_grid_table` in the layout of the published ToMe tables,
:func:`format_details`, :func:`format_pareto` with the :func:`pareto_front`, :func:`format_time_split`) and the
``results.json`` record (:func:`record`, :func:`save_json`, and :func:`load_cells` to read its cells back)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple

from ..measure import environment, render_table
from .methods import BenchSettings, Method
from .runner import Cell


def _grid_entry(cell: Optional[Cell]) -> str:
    if cell is None:
        return "-"
    if cell.status != "ok":
        return cell.status
    if cell.method == "vanilla":
        return f"{cell.seconds_per_image:.2f} s"
    gain = (cell.speedup - 1.0) * 100.0 if cell.speedup is not None else float("nan")
    return f"{cell.seconds_per_image:.2f} s ({gain:+.1f}%)"


def format_grid_table(cells: List[Cell], methods: List[Method]) -> str:
    """The layout of the published ToMe tables: one row per resolution x batch, one column per method, each cell
    the seconds per image and the gain over vanilla."""
    labels = [m.label for m in methods]
    rows = [["resolution", "batch"] + labels]
    by_key: Dict[Tuple[int, int], Dict[str, Cell]] = {}
    for cell in cells:
        by_key.setdefault((cell.resolution, cell.batch), {})[cell.label] = cell
    for (size, batch), row_cells in by_key.items():
        rows.append([f"{size}x{size}", str(batch)] + [_grid_entry(row_cells.get(label)) for label in labels])
    return render_table(rows)


def _fmt(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def format_details(cells: List[Cell]) -> str:
    """Every number of every cell, one row per cell."""
    header = ["resolution", "batch", "method", "status", "s/image", "UNet s", "speed-up", "added MiB", "PSNR", "rel L2",
              "of bound", "reused", "ops/block"]
    rows = [header]
    for c in cells:
        rows.append([
            str(c.resolution), str(c.batch), c.label, c.status,
            _fmt(c.seconds_per_image, "{:.3f}"), _fmt(c.unet_seconds, "{:.3f}"), _fmt(c.speedup, "{:.2f}x"),
            _fmt(None if c.added_memory_bytes is None else c.added_memory_bytes / 2**20, "{:.0f}"),
            "inf" if c.psnr_db == float("inf") else _fmt(c.psnr_db, "{:.1f}"), _fmt(c.rel_l2, "{:.4f}"),
            _fmt(c.fraction_of_bound, "{:.1%}"), _fmt(c.plans_reused_share, "{:.0%}"), _fmt(c.ops_per_block, "{:.1f}"),
        ])
    return render_table(rows)


def _fidelity(c: Cell) -> float:
    if c.psnr_db is not None:
        return c.psnr_db
    return -c.rel_l2 if c.rel_l2 is not None else float("-inf")


def pareto_front(cells: List[Cell]) -> List[Cell]:
    """The cells (of one resolution and batch) that no other cell beats on both speed-up and fidelity: PSNR of
    the image when there is one, else the relative L2 of the first noise prediction. The ``bound`` (a speed
    reference that ruins images) takes no part."""
    ok = [c for c in cells if c.status == "ok" and c.speedup is not None and c.method != "bound"]
    front = []
    for c in ok:
        beaten = any(
            o is not c and o.speedup >= c.speedup and _fidelity(o) >= _fidelity(c)
            and (o.speedup > c.speedup or _fidelity(o) > _fidelity(c))
            for o in ok
        )
        if not beaten:
            front.append(c)
    return front


def format_pareto(cells: List[Cell]) -> str:
    """One row per configuration, fastest first, with its fidelity to vanilla and whether it is on the Pareto
    front of speed-up vs fidelity (for its resolution and batch)."""
    header = ["resolution", "batch", "method", "speed-up", "PSNR dB", "rel L2", "reused", "Pareto"]
    rows = [header]
    groups: Dict[Tuple[int, int], List[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.resolution, cell.batch), []).append(cell)
    for (size, batch), group in groups.items():
        front = {id(c) for c in pareto_front(group)}
        ranked = sorted((c for c in group if c.status == "ok" and c.speedup is not None and c.method != "bound"),
                        key=lambda c: -c.speedup)
        for c in ranked:
            rows.append([
                f"{size}x{size}", str(batch), c.label, f"{c.speedup:.2f}x",
                "inf" if c.psnr_db == float("inf") else ("-" if c.psnr_db is None else f"{c.psnr_db:.1f}"),
                "-" if c.rel_l2 is None else f"{c.rel_l2:.4f}",
                "-" if c.plans_reused_share is None else f"{c.plans_reused_share:.0%}",
                "yes" if id(c) in front else "",
            ])
    return render_table(rows)


def format_time_split(split: Dict[str, Dict[str, float]]) -> str:
    """The time split of one UNet forward per configuration, on one line.

    >>> format_time_split({"tome@0.5": {"attention": 0.5, "matching": 0.125, "rest": 1.0}})
    'time split of one UNet forward (s): tome@0.5: attention 0.500, matching 0.125, rest 1.000'
    """
    return "time split of one UNet forward (s): " + "; ".join(
        f"{k}: attention {v['attention']:.3f}, matching {v['matching']:.3f}, rest {v['rest']:.3f}"
        for k, v in split.items()
    )


def record(cells: List[Cell], settings: BenchSettings, source: str, threads: int, dtype: str,
           split: Dict[str, Dict[str, float]]) -> Dict[str, Any]:
    """The ``results.json`` record of a ``bench`` run (before its ``plots`` entry)."""
    return {
        "command": "bench",
        "source": source,
        "environment": environment(threads, dtype),
        "settings": asdict(settings),
        "cells": [asdict(c) for c in cells],
        "time_split": split,
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def save_json(data: Dict[str, Any], path: str) -> None:
    """Write ``data`` as strict JSON: infinities and NaN become the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_safe(data), f, indent=2)


def load_cells(data: Dict[str, Any]) -> List[Cell]:
    """The cells of a ``results.json`` written by :func:`save_json`, as :class:`Cell` objects again (e.g. to
    draw :func:`~ppdiffusers_tome.bench.write_pareto_plot` again from a finished run)."""
    fields = set(Cell.__dataclass_fields__)
    cells = []
    for raw in data["cells"]:
        values = {k: v for k, v in raw.items() if k in fields}
        for key in ("psnr_db", "rel_l2", "speedup"):
            if isinstance(values.get(key), str):  # save_json writes inf and nan as strings
                values[key] = float(values[key])
        cells.append(Cell(**values))
    return cells

"""Reporting a benchmark: the text tables (:func:`format_grid_table` in the layout of the published ToMe tables,
:func:`format_details`, :func:`format_pareto` with the :func:`pareto_front`, :func:`format_time_split`) and the
``results.json`` record (:func:`record`, :func:`save_json`, and :func:`load_cells` to read its cells back)."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ..measure import environment, render_table
from .methods import BenchSettings, Method
from .runner import Cell

INF = float("inf")
TWIN = "= vanilla"  # how a configuration that merged nothing shows its speed-up
TWIN_LEGEND = (f"{TWIN}: the configuration merged nothing, so it computed exactly what vanilla computes; any "
               "difference in its time is noise, and it is not a point of its own on the Pareto front")


def merges_nothing(cell: Cell) -> bool:
    """Whether ``cell`` is vanilla's twin: a configuration that merged (or downsampled) nothing in its runs, e.g.
    ``max_downsample=1`` on SDXL (no transformer block at the first level) or a ratio too small to merge one token.
    Counted by this package's patch (:attr:`Cell.merges` is 0); for a method it does not count (ppdiffusers'
    built-in port), judged by an output bit-identical to vanilla's (relative L2 exactly 0, PSNR infinite or not
    measured). Vanilla itself is not its own twin.

    >>> merges_nothing(Cell(512, 1, "tome", 0.5, merges=0)), merges_nothing(Cell(512, 1, "tome", 0.5, merges=12))
    (True, False)
    >>> merges_nothing(Cell(512, 1, "builtin", 0.5, rel_l2=0.0, psnr_db=float("inf")))
    True
    """
    if cell.method == "vanilla" or cell.status != "ok":
        return False
    if cell.merges is not None:
        return cell.merges == 0
    return cell.rel_l2 == 0.0 and (cell.psnr_db is None or cell.psnr_db == INF)


def single_run(cell: Cell) -> bool:
    """Whether ``cell``'s time comes from one timed run (``--repeats 1``): its speed-up is one sample of a noisy
    quantity, not a measurement."""
    return len(cell.runs_seconds) == 1


def effective_speedup(cell: Cell) -> float | None:
    """The speed-up to report: 1.0 for vanilla's twin (see :func:`merges_nothing`), else the measured one."""
    if cell.speedup is None:
        return None
    return 1.0 if merges_nothing(cell) else cell.speedup


def speedup_text(cell: Cell) -> str:
    """The speed-up as the tables show it: ``"1.31x"``, ``"1.31x (1 run)"`` when it comes from a single timed
    run, ``"= vanilla"`` for a configuration that merged nothing, ``"-"`` when there is none.

    >>> speedup_text(Cell(512, 1, "tome", 0.5, speedup=1.31, runs_seconds=[1.0]))
    '1.31x (1 run)'
    >>> speedup_text(Cell(512, 1, "tome", 0.5, speedup=1.33, merges=0, runs_seconds=[1.0, 1.1]))
    '= vanilla'
    """
    if cell.speedup is None:
        return "-"
    return speedup_label(cell.speedup, cell.method != "vanilla" and single_run(cell), merges_nothing(cell))


def speedup_label(speedup: float, one_run: bool, twin: bool = False) -> str:
    """How every table writes a speed-up: ``"1.31x"``, ``"1.31x (1 run)"`` from a single timed run, ``"= vanilla"``
    (``twin``) for a configuration that merged nothing.

    >>> speedup_label(1.314, True), speedup_label(1.2, False, twin=True)
    ('1.31x (1 run)', '= vanilla')
    """
    if twin:
        return TWIN
    text = f"{speedup:.2f}x"
    return text + " (1 run)" if one_run else text


def single_run_text(what: str, default_hint: str = "or more") -> str:
    """The note under a table whose speed-ups come from one timed run per ``what`` (``--repeats 1``)."""
    return (f"NOTE: one timed run per {what} (--repeats 1): each speed-up marked '1 run' is a single sample, not a "
            f"measurement; on a shared machine one run is often 20% off either way. Use --repeats 3 {default_hint} "
            "before quoting a speed-up.")


def _grid_entry(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    if cell.status != "ok":
        return cell.status
    if cell.method == "vanilla":
        return f"{cell.seconds_per_image:.2f} s"
    if merges_nothing(cell):
        return f"{cell.seconds_per_image:.2f} s ({TWIN})"
    gain = (cell.speedup - 1.0) * 100.0 if cell.speedup is not None else float("nan")
    return f"{cell.seconds_per_image:.2f} s ({gain:+.1f}%{', 1 run' if single_run(cell) else ''})"


def format_grid_table(cells: list[Cell], methods: list[Method]) -> str:
    """The layout of the published ToMe tables: one row per resolution x batch, one column per method, each cell
    the seconds per image and the gain over vanilla."""
    labels = [m.label for m in methods]
    rows = [["resolution", "batch"] + labels]
    by_key: dict[tuple[int, int], dict[str, Cell]] = {}
    for cell in cells:
        by_key.setdefault((cell.resolution, cell.batch), {})[cell.label] = cell
    for (size, batch), row_cells in by_key.items():
        rows.append([f"{size}x{size}", str(batch)] + [_grid_entry(row_cells.get(label)) for label in labels])
    return render_table(rows)


def _fmt(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def format_details(cells: list[Cell]) -> str:
    """Every number of every cell, one row per cell."""
    header = ["resolution", "batch", "method", "status", "s/image", "UNet s", "speed-up", "added MiB", "PSNR", "rel L2",
              "of bound", "reused", "ops/block"]
    rows = [header]
    for c in cells:
        rows.append([
            str(c.resolution), str(c.batch), c.label, c.status,
            _fmt(c.seconds_per_image, "{:.3f}"), _fmt(c.unet_seconds, "{:.3f}"), speedup_text(c),
            _fmt(None if c.added_memory_bytes is None else c.added_memory_bytes / 2**20, "{:.0f}"),
            "inf" if c.psnr_db == float("inf") else _fmt(c.psnr_db, "{:.1f}"), _fmt(c.rel_l2, "{:.4f}"),
            _fmt(c.fraction_of_bound, "{:.1%}"), _fmt(c.plans_reused_share, "{:.0%}"), _fmt(c.ops_per_block, "{:.1f}"),
        ])
    return render_table(rows)


def _fidelity(c: Cell) -> float:
    if c.psnr_db is not None:
        return c.psnr_db
    return -c.rel_l2 if c.rel_l2 is not None else float("-inf")


def pareto_front(cells: list[Cell]) -> list[Cell]:
    """The cells (of one resolution and batch) that no other cell beats on both speed-up and fidelity: PSNR of
    the image when there is one, else the relative L2 of the first noise prediction. The ``bound`` (a speed
    reference that ruins images) takes no part, nor does a configuration that merged nothing
    (:func:`merges_nothing`): it is vanilla again, whatever its single timings say, so it can never push vanilla
    off the front."""
    ok = [c for c in cells if c.status == "ok" and c.speedup is not None and c.method != "bound"
          and not merges_nothing(c)]
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


def format_pareto(cells: list[Cell]) -> str:
    """One row per configuration, fastest first, with its fidelity to vanilla and whether it is on the Pareto
    front of speed-up vs fidelity (for its resolution and batch). A configuration that merged nothing shows
    ``= vanilla`` for its speed-up and its place on the front (it ranks with vanilla)."""
    header = ["resolution", "batch", "method", "speed-up", "PSNR dB", "rel L2", "reused", "Pareto"]
    rows = [header]
    groups: dict[tuple[int, int], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.resolution, cell.batch), []).append(cell)
    for (size, batch), group in groups.items():
        front = {id(c) for c in pareto_front(group)}
        ranked = sorted((c for c in group if c.status == "ok" and c.speedup is not None and c.method != "bound"),
                        key=lambda c: (-effective_speedup(c), merges_nothing(c)))
        for c in ranked:
            rows.append([
                f"{size}x{size}", str(batch), c.label, speedup_text(c),
                "inf" if c.psnr_db == INF else ("-" if c.psnr_db is None else f"{c.psnr_db:.1f}"),
                "-" if c.rel_l2 is None else f"{c.rel_l2:.4f}",
                "-" if c.plans_reused_share is None else f"{c.plans_reused_share:.0%}",
                TWIN if merges_nothing(c) else "yes" if id(c) in front else "",
            ])
    return render_table(rows)


# noise -------------------------------------------------------------------------------------------------------------
def unstable(named_runs: Sequence[tuple[str, Sequence[float]]], tolerance: float = 0.25) -> list[str]:
    """The entries of ``(name, timed runs in seconds)`` whose runs spread by more than ``tolerance`` of their
    median (``(max - min) / median``), as ``"vanilla 1.00-4.00 s"``.

    >>> unstable([("vanilla", [1.0, 1.1, 4.0]), ("tome@0.5", [0.5, 0.52, 0.51])])
    ['vanilla 1.00-4.00 s']
    """
    found = []
    for name, runs in named_runs:
        runs = [float(t) for t in runs]
        if len(runs) > 1 and (max(runs) - min(runs)) > tolerance * statistics.median(runs):
            found.append(f"{name} {min(runs):.2f}-{max(runs):.2f} s")
    return found


def speedup_range(vanilla_runs: Sequence[float], runs: Sequence[float]) -> tuple[float, float]:
    """The lowest and highest speed-up that pairs of single runs give: ``min(vanilla_runs) / max(runs)`` (fastest
    vanilla run against the slowest one) to ``max(vanilla_runs) / min(runs)``.

    >>> speedup_range([1.0, 4.0], [1.5, 2.0])
    (0.5, 2.6666666666666665)
    """
    return min(vanilla_runs) / max(runs), max(vanilla_runs) / min(runs)


def spread_warning(named_runs: Sequence[tuple[str, Sequence[float]]], tolerance: float = 0.25, where: str = "",
                   ranged: Sequence[str] | None = None) -> str | None:
    """A warning when the timed runs of ``named_runs`` (vanilla first) varied by more than ``tolerance`` (see
    :func:`unstable`): the range each speed-up could take judged by single runs (for the names in ``ranged``;
    default every entry after vanilla), and whether that range includes 1.00x (then the speed-up is not
    meaningful). ``where`` (e.g. ``"512x512 batch 1: "``) starts the text. ``None`` when the runs agree.

    >>> print(spread_warning([("vanilla", [1.0, 1.5]), ("tome@0.5", [0.9, 1.0])]))  # doctest: +NORMALIZE_WHITESPACE
    WARNING: the timed runs varied a lot (vanilla 1.00-1.50 s), so the machine was busy. Judged by single runs,
    the speed-up of tome@0.5 lies between 1.00x and 1.67x. Where that range includes 1.00x, the speed-up is not
    meaningful. Run again on an idle machine, or with more --repeats.
    """
    spread = unstable(named_runs, tolerance)
    if not spread:
        return None
    vanilla_runs = named_runs[0][1]
    wanted = set(ranged) if ranged is not None else {name for name, _ in named_runs[1:]}
    ranges = [(name, *speedup_range(vanilla_runs, runs)) for name, runs in named_runs[1:] if name in wanted and runs]
    text = f"WARNING: {where}the timed runs varied a lot ({'; '.join(spread)}), so the machine was busy."
    if ranges:
        between = ", ".join(f"{name} lies between {lo:.2f}x and {hi:.2f}x" for name, lo, hi in ranges)
        text += f" Judged by single runs, the speed-up of {between}."
    if any(lo <= 1.0 <= hi for _, lo, hi in ranges):
        text += " Where that range includes 1.00x, the speed-up is not meaningful."
    return text + " Run again on an idle machine, or with more --repeats."


def noise_warnings(cells: list[Cell], tolerance: float = 0.25) -> list[str]:
    """:func:`spread_warning` for every resolution x batch of a ``bench`` run whose timed runs were noisy, as the
    demo warns: the ``bound`` and configurations that merged nothing count for the spread but get no speed-up
    range (the first is a reference, the second is vanilla)."""
    groups: dict[tuple[int, int], list[Cell]] = {}
    for cell in cells:
        if cell.status == "ok" and cell.runs_seconds:
            groups.setdefault((cell.resolution, cell.batch), []).append(cell)
    warnings = []
    for (size, batch), group in groups.items():
        group.sort(key=lambda c: c.method != "vanilla")  # vanilla first (stable: the rest keep their order)
        if group[0].method != "vanilla":
            continue
        ranged = [c.label for c in group[1:] if c.method != "bound" and not merges_nothing(c)]
        text = spread_warning([(c.label, c.runs_seconds) for c in group], tolerance, f"{size}x{size} batch {batch}: ",
                              ranged)
        if text:
            warnings.append(text)
    return warnings


def single_run_note(cells: list[Cell]) -> str | None:
    """A note when speed-ups come from a single timed run per configuration (``--repeats 1``), else ``None``."""
    if not any(c.status == "ok" and c.method != "vanilla" and single_run(c) for c in cells):
        return None
    return single_run_text("configuration")


def format_time_split(split: dict[str, dict[str, float]]) -> str:
    """The time split of one UNet forward per configuration, on one line.

    >>> format_time_split({"tome@0.5": {"attention": 0.5, "matching": 0.125, "rest": 1.0}})
    'time split of one UNet forward (s): tome@0.5: attention 0.500, matching 0.125, rest 1.000'
    """
    return "time split of one UNet forward (s): " + "; ".join(
        f"{k}: attention {v['attention']:.3f}, matching {v['matching']:.3f}, rest {v['rest']:.3f}"
        for k, v in split.items()
    )


def record(cells: list[Cell], settings: BenchSettings, source: str, threads: int, dtype: str,
           split: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The ``results.json`` record of a ``bench`` run (before its ``plots`` entry)."""
    return {
        "command": "bench",
        "source": source,
        "environment": environment(threads, dtype),
        "settings": asdict(settings),
        "cells": [asdict(c) for c in cells],
        "time_split": split,
        # configurations that merged nothing: their speed-up is reported as vanilla's (see merges_nothing)
        "vanilla_twins": [f"{c.label} {c.resolution}x{c.resolution} batch {c.batch}"
                          for c in cells if merges_nothing(c)],
        "warnings": [text for text in [single_run_note(cells)] + noise_warnings(cells) if text],
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def save_json(data: dict[str, Any], path: str) -> None:
    """Write ``data`` as strict JSON: infinities and NaN become the strings ``"inf"``, ``"-inf"``, ``"nan"``. The
    file is written beside ``path`` and then moved over it, so a run stopped while writing (Ctrl-C) leaves the
    previous complete file, never half of one."""
    partial = f"{path}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(_json_safe(data), f, indent=2)
        os.replace(partial, path)
    except BaseException:  # (Ctrl-C included) no half-written file is left beside the complete one
        if os.path.exists(partial):
            os.remove(partial)
        raise


def load_cells(data: dict[str, Any]) -> list[Cell]:
    """The cells of a ``results.json`` written by :func:`save_json`, as :class:`Cell` objects again (e.g. to
    draw :func:`~ppdiffusers_tome.tools.bench.write_pareto_plot` again from a finished run)."""
    fields = set(Cell.__dataclass_fields__)
    cells = []
    for raw in data["cells"]:
        values = {k: v for k, v in raw.items() if k in fields}
        for key in ("psnr_db", "rel_l2", "speedup"):
            if isinstance(values.get(key), str):  # save_json writes inf and nan as strings
                values[key] = float(values[key])
        cells.append(Cell(**values))
    return cells

"""How many power iterations feature order's axes need: ``local_plans.py`` with extra configurations that differ
only in the squarings of the second moment (a planner's ``squarings``: 3 squarings = 8 power iterations, 4 = 16).

Every configuration named ``local16f_sqK`` / ``local32f_sqK`` (``K`` from ``--squarings``) is ``local16f`` /
``local32f`` planned with ``K`` squarings; all run side by side in one run of :mod:`local_plans` (same seeds,
same rotating order), so their distances from vanilla compare paired, seed by seed. The remaining options are those of
``local_plans.py``; ``--configs`` may name the extra configurations, e.g.

    bash run.sh python benchmarks/axis_iterations.py --squarings 3 4 --presets sd15-narrow --resolutions 768 \\
        --seeds 8 --threads 2 --configs tome local16f_sq3 local16f_sq4 local32f_sq3 local32f_sq4 \\
        --output outputs/axis_iterations

It prints, after the tables of ``local_plans.py``, each configuration's mean rel L2 relative to ``tome`` in the
same seeds, the mean paired difference and ``tome``'s own seed-to-seed spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import local_plans  # noqa: E402


def variants(squarings) -> Dict[str, Dict[str, Any]]:
    """``local16f_sqK`` and ``local32f_sqK`` for each ``K``: :data:`local_plans.CONFIGS`' ``local16f`` /
    ``local32f`` with ``_squarings`` (which :func:`local_plans.apply` sets on the UNet's planner)."""
    return {f"local{window}f_sq{k}": {**local_plans.CONFIGS[f"local{window}f"], "_squarings": k}
            for k in squarings for window in (16, 32)}


def summary(result) -> str:
    """Each configuration of each cell against ``tome`` in the same seeds (:func:`local_plans.against_tome`)."""
    lines = []
    for cell in result["cells"]:
        if "tome" not in cell["configs"]:
            continue
        spread = statistics.pstdev(cell["configs"]["tome"]["rel_l2"])
        lines.append(f"{cell['preset']} at {cell['resolution']}px, {cell['seeds']} seeds, against tome "
                     f"(tome's seed-to-seed spread {spread:.5f}):")
        for name in cell["configs"]:
            if name in ("vanilla", "tome"):
                continue
            a = local_plans.against_tome(cell, name)
            lines.append(f"  {name}: {a['relative']:+.1%}, mean paired difference {a['mean_diff']:+.5f}, further in "
                         f"{a['further_in']}/{a['seeds']} seeds, {'within' if a['within_spread'] else 'outside'} "
                         f"the spread")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--squarings", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--output", default=os.path.join("outputs", "axis_iterations"))
    args, rest = parser.parse_known_args(argv)
    if any(k < 1 or k > 4 for k in args.squarings):
        parser.error("--squarings: each value must be in 1..4 (a fifth squaring underflows float32)")
    local_plans.main(rest + ["--output", args.output], extra_configs=variants(args.squarings))
    if "--render" in rest:
        return
    with open(os.path.join(args.output, "results.json"), encoding="utf-8") as f:
        print(summary(json.load(f)))


if __name__ == "__main__":
    main()

"""Micro-benchmark of the merge core: plan + merge + unmerge, ours against ppdiffusers' built-in port.

Both run in the same process, interleaved, on the same inputs ([2, 4096, 320] and [2, 1024, 640] by default,
r = N/2, random partition). Prints a table and writes JSON. Not a test: timings on shared machines are noisy, so
read the ratios, not the seconds.

    python benchmarks/merge_core.py --threads 1 --output outputs/merge_core.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import paddle

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ppdiffusers_tome.measure import environment, median, set_threads  # noqa: E402
from ppdiffusers_tome.merge import bipartite_soft_matching_random2d  # noqa: E402


def builtin_port():
    from ppdiffusers.patches.tomesd_patch_utils import bipartite_soft_matching_random2d as builtin

    return builtin


def time_parts(fn_plan, x, repeats):
    """Median seconds of plan, merge and unmerge over ``repeats`` runs (after one warm-up run)."""
    parts = {"plan": [], "merge": [], "unmerge": []}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        merge, unmerge = fn_plan(x)
        t1 = time.perf_counter()
        y = merge(x)
        t2 = time.perf_counter()
        z = unmerge(y)
        t3 = time.perf_counter()
        assert z.shape == x.shape
        if i:  # the first run warms up kernels and caches
            parts["plan"].append(t1 - t0)
            parts["merge"].append(t2 - t1)
            parts["unmerge"].append(t3 - t2)
    out = {k: median(v) for k, v in parts.items()}
    out["total"] = median([a + b + c for a, b, c in zip(parts["plan"], parts["merge"], parts["unmerge"])])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["2x4096x320", "2x1024x640"], help="BxNxC, N a square")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="Paddle CPU threads (default: all cores)")
    parser.add_argument("--output", default=os.path.join("outputs", "merge_core.json"))
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    builtin = builtin_port()
    rows = []
    for shape in args.shapes:
        b, n, c = (int(v) for v in shape.split("x"))
        side = int(math.isqrt(n))
        assert side * side == n, f"N must be a square, got {n}"
        x = paddle.to_tensor(np.random.default_rng(0).standard_normal((b, n, c)).astype("float32"))
        r = n // 2
        rng = np.random.default_rng(1)
        ours = lambda t: bipartite_soft_matching_random2d(t, side, side, 2, 2, r, generator=rng)  # noqa: E731
        theirs = lambda t: builtin(t, side, side, 2, 2, r, no_rand=False)  # noqa: E731
        results = {"ours": [], "builtin": []}
        for _ in range(3):  # interleave blocks of runs so machine drift hits both
            results["ours"].append(time_parts(ours, x, max(args.repeats // 3, 1)))
            results["builtin"].append(time_parts(theirs, x, max(args.repeats // 3, 1)))
        merged = {
            name: {part: median([run[part] for run in runs]) for part in runs[0]} for name, runs in results.items()
        }
        rows.append(
            {
                "shape": [b, n, c],
                "r": r,
                "ours_ms": {k: v * 1e3 for k, v in merged["ours"].items()},
                "builtin_ms": {k: v * 1e3 for k, v in merged["builtin"].items()},
                "speedup": merged["builtin"]["total"] / merged["ours"]["total"],
            }
        )
    header = f"{'shape':>14} | {'part':>7} | {'builtin ms':>10} | {'ours ms':>8} | {'ratio':>6}"
    lines = [f"merge core micro-benchmark, {threads} thread(s), median of {args.repeats} runs", header, "-" * len(header)]
    for row in rows:
        shape = "x".join(str(v) for v in row["shape"])
        for part in ("plan", "merge", "unmerge", "total"):
            mine, other = row["ours_ms"][part], row["builtin_ms"][part]
            lines.append(f"{shape:>14} | {part:>7} | {other:10.2f} | {mine:8.2f} | {other / mine:5.2f}x")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"environment": environment(threads, "float32"), "rows": rows}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

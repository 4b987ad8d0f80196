"""Micro-benchmark of the merge core: plan + merge + unmerge, ours against ppdiffusers' built-in port.

Both run in the same process, interleaved, on the same inputs ([2, 4096, 320] and [2, 1024, 640] by default,
r = N/2, random partition). Prints a table and writes JSON. Not a test: timings on shared machines are noisy, so
read the ratios, not the seconds.

    bash run.sh python benchmarks/merge_core.py --threads 1 --output outputs/merge_core.json

``--baseline REV`` adds the merge core of an earlier git revision (its standalone ``merge.py``) as a third
contender, interleaved with the other two, for before/after numbers from one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import paddle

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ppdiffusers_tome.measure import environment, median, set_threads  # noqa: E402
from ppdiffusers_tome.merge import bipartite_soft_matching_random2d  # noqa: E402


def builtin_port():
    from ppdiffusers.patches.tomesd_patch_utils import bipartite_soft_matching_random2d as builtin

    return builtin


def baseline_port(revision):
    """``bipartite_soft_matching_random2d`` of ``ppdiffusers_tome/merge.py`` at git ``revision``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "show", f"{revision}:ppdiffusers_tome/merge.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "merge_baseline.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("merge_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.bipartite_soft_matching_random2d


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
    parser.add_argument("--baseline", default=None, metavar="REV", help="also time merge.py of this git revision")
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    builtin = builtin_port()
    baseline = baseline_port(args.baseline) if args.baseline else None
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
        contenders = {"ours": ours, "builtin": theirs}
        if baseline is not None:
            contenders["baseline"] = lambda t: baseline(t, side, side, 2, 2, r, generator=rng)  # noqa: E731
        results = {name: [] for name in contenders}
        for _ in range(3):  # interleave blocks of runs so machine drift hits all
            for name, fn in contenders.items():
                results[name].append(time_parts(fn, x, max(args.repeats // 3, 1)))
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
        if baseline is not None:
            rows[-1]["baseline"] = args.baseline
            rows[-1]["baseline_ms"] = {k: v * 1e3 for k, v in merged["baseline"].items()}
    extra = f" | {'baseline ms':>11} | {'vs baseline':>11}" if baseline is not None else ""
    header = f"{'shape':>14} | {'part':>7} | {'builtin ms':>10} | {'ours ms':>8} | {'ratio':>6}{extra}"
    lines = [f"merge core micro-benchmark, {threads} thread(s), median of {args.repeats} runs", header, "-" * len(header)]
    for row in rows:
        shape = "x".join(str(v) for v in row["shape"])
        for part in ("plan", "merge", "unmerge", "total"):
            mine, other = row["ours_ms"][part], row["builtin_ms"][part]
            line = f"{shape:>14} | {part:>7} | {other:10.2f} | {mine:8.2f} | {other / mine:5.2f}x"
            if baseline is not None:
                before = row["baseline_ms"][part]
                line += f" | {before:11.2f} | {before / mine:10.2f}x"
            lines.append(line)
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"environment": environment(threads, "float32"), "rows": rows}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""Micro-benchmark of the merge core: plan + merge + unmerge, ours against ppdiffusers' built-in port.

Both run in the same process on the same inputs ([2, 4096, 320] and [2, 1024, 640] by default, r = N/2, random
partition), one run each in turn with the order rotating every round, so that drift of a shared machine hits all
contenders alike. Prints a table (medians, and the median and range of the per-round ratio of neighbouring runs) and
writes JSON. Not a test: timings on shared machines are noisy, so read the ratios, not the seconds.

    bash run.sh python benchmarks/merge_core.py --threads 1 --output outputs/merge_core.json

``--baseline REV`` adds the merge core of an earlier git revision (its standalone ``merge.py``) as a third
contender, interleaved with the other two, for before/after numbers from one run. ``--match-window W`` adds local
matching (``apply_tome(match_window=W)``: each src matched within its ``W x W`` window, the same r) as another
contender (``--match-order feature`` cuts its windows along the features, ``apply_tome(match_order="feature")``),
and ``--kind gpu`` runs our kernels' GPU branch on the CPU (what a GPU would execute: the dense local
plan, the token-dtype similarity) — ratios against the built-in port then compare different algorithms, so read
the per-part rows: plan (built once per level with ``share_plan="level"``) and merge + unmerge (every block).
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

from ppdiffusers_tome.tools.measure import environment, median, set_threads  # noqa: E402
from ppdiffusers_tome.ops import (  # noqa: E402
    LocalMergePlan,
    bipartite_soft_matching_random2d,
    step_key,
    window_partition_table,
    window_sides,
)


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


def local_contender(side, window, r, kind, order="grid"):
    """Plan function of local matching on a ``side x side`` grid with windows of about ``window`` tokens per side,
    merging ``r`` tokens in all (the same share in every window), as ``apply_tome(match_window=window)`` does."""
    wy, wx = window_sides(side, side, window)
    count = (side // wy) * (side // wx)
    window_r = r // count
    partition = window_partition_table(side, side, wy, wx, 2, 2, step_key(999), seed=1, blocks=1)[0]
    windows = (side, side, wy, wx, 2, 2)
    return lambda t: LocalMergePlan.from_matching(t, windows, partition, window_r, kind, order=order)  # noqa: E731


def time_once(fn_plan, x):
    """Seconds of one plan, merge and unmerge."""
    t0 = time.perf_counter()
    merge, unmerge = fn_plan(x)
    t1 = time.perf_counter()
    y = merge(x)
    t2 = time.perf_counter()
    z = unmerge(y)
    t3 = time.perf_counter()
    assert z.shape == x.shape
    return {"plan": t1 - t0, "merge": t2 - t1, "unmerge": t3 - t2, "total": t3 - t0}


def interleaved(contenders, x, repeats):
    """Time every contender ``repeats`` times, one run each in turn (the order rotating every round, after one
    warm-up run each), so that drift of a shared machine hits all of them alike. Returns the runs per contender."""
    names = list(contenders)
    for name in names:
        time_once(contenders[name], x)
    runs = {name: [] for name in names}
    for i in range(repeats):
        for name in names[i % len(names):] + names[: i % len(names)]:
            runs[name].append(time_once(contenders[name], x))
    return runs


def paired_ratio(runs, slower, faster):
    """Median and range of ``slower/faster`` total time over rounds (each round's runs are neighbours in time)."""
    ratios = [a["total"] / b["total"] for a, b in zip(runs[slower], runs[faster])]
    return {"median": median(ratios), "min": min(ratios), "max": max(ratios)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["2x4096x320", "2x1024x640"], help="BxNxC, N a square")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="Paddle CPU threads (default: all cores)")
    parser.add_argument("--output", default=os.path.join("outputs", "merge_core.json"))
    parser.add_argument("--baseline", default=None, metavar="REV", help="also time merge.py of this git revision")
    parser.add_argument("--match-window", type=int, default=None, metavar="W",
                        help="also time local matching in windows of about W tokens per side (default: off)")
    parser.add_argument("--match-order", choices=("grid", "feature"), default="grid",
                        help="how --match-window's windows are cut (default: grid)")
    parser.add_argument("--kind", choices=("auto", "cpu", "gpu"), default="auto",
                        help="our kernels: from the place (auto, the default), or a forced branch")
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
        kind = None if args.kind == "auto" else args.kind
        ours = lambda t: bipartite_soft_matching_random2d(t, side, side, 2, 2, r, generator=rng, kind=kind)  # noqa: E731
        theirs = lambda t: builtin(t, side, side, 2, 2, r, no_rand=False)  # noqa: E731
        contenders = {"ours": ours, "builtin": theirs}
        if baseline is not None:
            contenders["baseline"] = lambda t: baseline(t, side, side, 2, 2, r, generator=rng)  # noqa: E731
        if args.match_window:
            contenders["local"] = local_contender(side, args.match_window, r, kind, args.match_order)
        runs = interleaved(contenders, x, args.repeats)
        merged = {name: {part: median([run[part] for run in r]) for part in r[0]} for name, r in runs.items()}
        rows.append(
            {
                "shape": [b, n, c],
                "r": r,
                "ours_ms": {k: v * 1e3 for k, v in merged["ours"].items()},
                "builtin_ms": {k: v * 1e3 for k, v in merged["builtin"].items()},
                "speedup": merged["builtin"]["total"] / merged["ours"]["total"],
                "speedup_paired": paired_ratio(runs, "builtin", "ours"),
            }
        )
        if baseline is not None:
            rows[-1]["baseline"] = args.baseline
            rows[-1]["baseline_ms"] = {k: v * 1e3 for k, v in merged["baseline"].items()}
            rows[-1]["vs_baseline_paired"] = paired_ratio(runs, "baseline", "ours")
        if args.match_window:
            rows[-1]["match_window"], rows[-1]["match_order"] = args.match_window, args.match_order
            rows[-1]["local_ms"] = {k: v * 1e3 for k, v in merged["local"].items()}
            rows[-1]["local_vs_ours_paired"] = paired_ratio(runs, "ours", "local")
    extra = f" | {'baseline ms':>11} | {'vs baseline':>11}" if baseline is not None else ""
    extra += f" | {'local ms':>9} | {'ours/local':>10}" if args.match_window else ""
    header = f"{'shape':>14} | {'part':>7} | {'builtin ms':>10} | {'ours ms':>8} | {'ratio':>6}{extra}"
    title = f"merge core micro-benchmark, {threads} thread(s), median of {args.repeats} runs, kernels: {args.kind}"
    if args.match_window:
        title += f", local = windows of about {args.match_window} tokens per side"
    lines = [title, header, "-" * len(header)]
    for row in rows:
        shape = "x".join(str(v) for v in row["shape"])
        for part in ("plan", "merge", "unmerge", "total"):
            mine, other = row["ours_ms"][part], row["builtin_ms"][part]
            line = f"{shape:>14} | {part:>7} | {other:10.2f} | {mine:8.2f} | {other / mine:5.2f}x"
            if baseline is not None:
                before = row["baseline_ms"][part]
                line += f" | {before:11.2f} | {before / mine:10.2f}x"
            if args.match_window:
                local = row["local_ms"][part]
                line += f" | {local:9.2f} | {mine / local:9.2f}x"
            lines.append(line)
        paired = [("builtin/ours", row["speedup_paired"])]
        paired += [("baseline/ours", row["vs_baseline_paired"])] if baseline else []
        paired += [("ours/local", row["local_vs_ours_paired"])] if args.match_window else []
        lines.append(f"{shape:>14} | paired per-round total ratio (median, range): " + "; ".join(
            f"{name} {p['median']:.2f}x [{p['min']:.2f}, {p['max']:.2f}]" for name, p in paired))
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"environment": environment(threads, "float32"), "kind": args.kind, "rows": rows}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""Step caching on whole pipeline calls, over several seeds: time per image, speed-up and distance of the final image
from vanilla's, per configuration (vanilla, ToMe 0.5, cache 2 / 3 / 5, ToMe 0.5 + cache 3, ToDo + cache 3, and the
finer branches cache 3 with layers 2 / 1 and ToMe 0.5 + cache 3 with layers 1).

For every seed the preset's pipeline (random weights built once from ``--weights-seed``) makes one call per
configuration from the same initial latents (generator seed = seed), the configurations in a rotated order so that
none is always first; every configuration first runs one untimed 2-step call. Per configuration: the median seconds
per image and the range of the per-seed speed-ups (vanilla's time of the same seed over the configuration's), and
the mean and seed-to-seed standard deviation of the PSNR (dB, images in [0, 1]) and the relative L2 distance of the
final image to vanilla's. With random weights the images are noise: the distances rank the configurations, they do
not judge images (``benchmarks/shapes_fidelity.py`` does that on the trained shapes model). Writes ``results.json``
and ``table.md``.

    bash run.sh python benchmarks/cache_pipelines.py --preset sd15-narrow --resolution 256 --seeds 4 \\
        --output outputs/cache_pipelines_sd15narrow_256
    bash run.sh python benchmarks/cache_pipelines.py --render outputs/cache_pipelines_sd15narrow_256/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppdiffusers_tome  # noqa: E402  (registers apply_tome; quiets Paddle's import)
from ppdiffusers_tome import presets  # noqa: E402
from ppdiffusers_tome.tools.bench.inputs import pipeline_kwargs  # noqa: E402
from ppdiffusers_tome.tools.bench.methods import Method, configure  # noqa: E402
from ppdiffusers_tome.tools.measure import environment, psnr, render_table, set_threads  # noqa: E402

CONFIGS: Dict[str, Method] = {
    "vanilla": Method("vanilla"),
    "ToMe 0.5": Method("tome", 0.5),
    "cache 2": Method("cache", cache={"interval": 2}),
    "cache 3": Method("cache", cache={"interval": 3}),
    "cache 5": Method("cache", cache={"interval": 5}),
    "ToMe 0.5 + cache 3": Method("tome", 0.5, cache={"interval": 3}),
    "ToDo + cache 3": Method("todo", cache={"interval": 3}),
    # the whole first level on a cached step (DeepCache's branch 2 on SD-1.5; the default before 0.14.0)
    "cache 3, whole level": Method("cache", cache={"interval": 3, "layers": None}),
    "ToMe 0.5 + cache 3, whole level": Method("tome", 0.5, cache={"interval": 3, "layers": None}),
    # DeepCache's finer branches: a cached step runs only the last 2 (1) layers of the last up block; the cache's
    # default (layers="auto") is layers 1 since 0.14.0, so "cache 3" above is "cache 3, layers 1"
    "cache 3, layers 2": Method("cache", cache={"interval": 3, "layers": 2}),
    "cache 3, layers 1": Method("cache", cache={"interval": 3, "layers": 1}),
    "ToMe 0.5 + cache 3, layers 1": Method("tome", 0.5, cache={"interval": 3, "layers": 1}),
}
PROMPT = "a lighthouse on a cliff at sunset"


def rel_l2(reference: np.ndarray, test: np.ndarray) -> float:
    """``||test - reference|| / ||reference||`` over the whole image batch, in float64."""
    reference, test = np.asarray(reference, np.float64), np.asarray(test, np.float64)
    return float(np.linalg.norm(test - reference) / np.linalg.norm(reference))


def mean_sd(values: Sequence[float]) -> Dict[str, float]:
    return {"mean": float(np.mean(values)), "sd": float(statistics.stdev(values)) if len(values) > 1 else 0.0}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    threads = set_threads(args.threads)
    pipe = presets.preset_pipeline(args.preset, seed=args.weights_seed)
    names = ["vanilla"] + [name for name in (args.configs or list(CONFIGS)) if name != "vanilla"]
    for name in names:  # untimed warm-up: first-call allocations and caches
        configure(pipe, CONFIGS[name], "auto")
        pipe(**pipeline_kwargs(pipe, args.resolution, 1, 2, 0, PROMPT))
    per_seed: Dict[str, List[Dict[str, float]]] = {name: [] for name in names}
    for seed in range(args.seeds):
        shift = seed % len(names)
        images: Dict[str, np.ndarray] = {}
        seconds: Dict[str, float] = {}
        for name in names[shift:] + names[:shift]:
            configure(pipe, CONFIGS[name], "auto")
            began = time.perf_counter()
            images[name] = np.asarray(pipe(**pipeline_kwargs(pipe, args.resolution, 1, args.steps, seed,
                                                             PROMPT)).images, dtype=np.float64)
            seconds[name] = time.perf_counter() - began
            print(f"seed {seed} {name:>20}: {seconds[name]:.2f} s", flush=True)
        for name in names:
            row = {"seconds": seconds[name], "speedup": seconds["vanilla"] / seconds[name]}
            if name != "vanilla":  # (vanilla's own PSNR is infinite: left out, keeping the JSON standard)
                row["psnr_db"] = psnr(images["vanilla"], images[name])
                row["rel_l2"] = rel_l2(images["vanilla"], images[name])
            per_seed[name].append(row)
    configure(pipe, Method("vanilla"), "auto")
    summary = {}
    for name, rows in per_seed.items():
        speedups = [r["speedup"] for r in rows]
        summary[name] = {"seconds_median": float(np.median([r["seconds"] for r in rows])),
                         "speedup_min": min(speedups), "speedup_median": float(np.median(speedups)),
                         "speedup_max": max(speedups)}
        if name != "vanilla":
            summary[name]["psnr_db"] = mean_sd([r["psnr_db"] for r in rows])
            summary[name]["rel_l2"] = mean_sd([r["rel_l2"] for r in rows])
    return {
        "command": " ".join(["benchmarks/cache_pipelines.py"] + sys.argv[1:]),
        "version": ppdiffusers_tome.__version__,
        "environment": environment(threads, "float32"),
        "settings": {"preset": args.preset, "resolution": args.resolution, "steps": args.steps, "seeds": args.seeds,
                     "weights_seed": args.weights_seed, "images_per_call": 1, "guidance": "pipeline default",
                     "prompt": PROMPT},
        "per_seed": per_seed,
        "summary": summary,
    }


def table_rows(data: Dict[str, Any]) -> List[List[str]]:
    rows = [["configuration", "s / image (median)", "speed-up (median, range)", "PSNR to vanilla dB",
             "rel. L2 to vanilla"]]
    for name, s in data["summary"].items():
        distance = ["inf", "0"] if name == "vanilla" else [
            f"{s['psnr_db']['mean']:.1f} ± {s['psnr_db']['sd']:.1f}",
            f"{s['rel_l2']['mean']:.3f} ± {s['rel_l2']['sd']:.3f}"]
        rows.append([name, f"{s['seconds_median']:.2f}",
                     f"{s['speedup_median']:.2f}× ({s['speedup_min']:.2f}–{s['speedup_max']:.2f})", *distance])
    return rows


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="sd15-narrow", help="a preset of ppdiffusers_tome.presets")
    parser.add_argument("--resolution", type=int, default=256, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per call")
    parser.add_argument("--seeds", type=int, default=4, help="initial-latent seeds (>= 2 for a spread)")
    parser.add_argument("--weights-seed", type=int, default=0, help="seed of the preset's random weights")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None, metavar="NAME",
                        help=f"configurations (default: all; vanilla always): {', '.join(CONFIGS)}")
    parser.add_argument("--output", default=os.path.join("outputs", "cache_pipelines"))
    parser.add_argument("--render", default=None, help="print the table of an earlier results.json and exit")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            data = json.load(f)
    else:
        if args.seeds < 1 or args.steps < 1 or args.resolution < 64 or args.resolution % 64:
            parser.error("--seeds and --steps must be >= 1, --resolution a multiple of 64")
        data = run(args)
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "results.json"), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    rows = table_rows(data)
    print(render_table(rows))
    text = "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
                     + ["| " + " | ".join(row) + " |" for row in rows[1:]])
    if not args.render:
        with open(os.path.join(args.output, "table.md"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"wrote {args.output}/results.json and table.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

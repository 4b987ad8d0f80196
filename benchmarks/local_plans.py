"""Local matching, shared plans and ToDo against tomesd's plan, side by side on the CPU (issue #17).

For every preset and resolution: one UNet forward per configuration and seed (classifier-free-guidance batch 2,
timestep 500, latents and text states drawn from the seed), the configurations timed in a rotating order inside
each seed so that drift of a shared machine hits all of them alike. Printed per cell:

* speed-up over vanilla: median over seeds of vanilla's time / the configuration's time in the same seed (range);
* distance from vanilla: rel L2 of the UNet output, and PSNR of the decoded one-step prediction of the clean
  image (``x0`` from the predicted noise, through the preset's VAE), mean and standard deviation over seeds;
* plans per call (``tome_stats``), eager ops per merging block and per call with the GPU branch forced (what a GPU
  would launch; counted on the same layout at a small latent, since the count does not depend on the size, except
  for feature order, counted at the cell's size), and
  the peak temporaries of one plan + merge + unmerge at the resolution's finest-level shape (GPU branch forced,
  Paddle's host memory statistics).

Writes JSON and a Pareto plot (speed-up against PSNR) per cell. Not a test: read the ratios, not the seconds.

    bash run.sh python benchmarks/local_plans.py --presets sd15-narrow sd15 --resolutions 512 768 \\
        --seeds 4 --threads 2 --output outputs/local_plans
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import numpy as np
import paddle

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppdiffusers_tome  # noqa: E402
import ppdiffusers_tome.ops as merge_module  # noqa: E402
from ppdiffusers_tome.tools.measure import (  # noqa: E402
    count_forward_ops, environment, median, ops_added_per_block, psnr, relative_l2, render_table, set_threads,
)
from ppdiffusers_tome.presets import preset_pipeline  # noqa: E402
from ppdiffusers_tome.testing import gpu_kernels  # noqa: E402

CONFIGS: Dict[str, Any] = {
    "vanilla": None,
    "tome": {},  # tomesd's plan: global matching, every block plans
    "tome+share": {"share_plan": "level"},
    "local16": {"match_window": 16},
    "local16+share": {"match_window": 16, "share_plan": "level"},
    "local32": {"match_window": 32},
    "local32+share": {"match_window": 32, "share_plan": "level"},
    "local16f": {"match_window": 16, "match_order": "feature"},
    "local16f+share": {"match_window": 16, "match_order": "feature", "share_plan": "level"},
    "local32f": {"match_window": 32, "match_order": "feature"},
    "local32f+share": {"match_window": 32, "match_order": "feature", "share_plan": "level"},
    "todo": {"method": "todo"},
}
DEFAULT_CONFIGS = ["vanilla", "tome", "tome+share", "local16", "local16+share", "todo"]


def unet_inputs(unet, resolution: int, vae_scale: int, seed: int):
    rng = np.random.default_rng(seed)
    side = resolution // vae_scale
    sample = rng.standard_normal((2, unet.config.in_channels, side, side)).astype("float32")
    context = rng.standard_normal((2, 77, unet.config.cross_attention_dim)).astype("float32")
    return paddle.to_tensor(sample), paddle.to_tensor([500, 500], dtype="int64"), paddle.to_tensor(context)


def apply(pipe, options) -> None:
    """Put ``options`` on the UNet at ratio 0.5 (``None``: vanilla)."""
    ppdiffusers_tome.remove_tome(pipe.unet)
    if options is not None:
        ppdiffusers_tome.apply_tome(pipe.unet, ratio=0.5, **options)


def decoded_x0(pipe, sample, eps) -> np.ndarray:
    """The clean image the predicted noise implies at t = 500, decoded: what one step of the sampler aims at."""
    alpha = float(pipe.scheduler.alphas_cumprod[500])
    x0 = (sample - (1 - alpha) ** 0.5 * eps) / alpha**0.5
    image = pipe.vae.decode(x0 / pipe.vae.config.scaling_factor).sample
    return np.clip((image.numpy() + 1) / 2, 0, 1)


def measure_cell(pipe, resolution: int, vae_scale: int, seeds: int, configs: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    names = list(configs)
    times = {n: [] for n in names}
    outputs = {n: [] for n in names}
    plans = {}
    for seed in range(seeds):
        sample, timestep, context = unet_inputs(pipe.unet, resolution, vae_scale, seed)
        if seed == 0:  # warm-up of every configuration
            for name in names:
                apply(pipe, configs[name])
                with paddle.no_grad():
                    pipe.unet(sample, timestep, context)
        order = names[seed % len(names):] + names[: seed % len(names)]
        for name in order:
            apply(pipe, configs[name])
            with paddle.no_grad():
                start = time.perf_counter()
                eps = pipe.unet(sample, timestep, context).sample
                times[name].append(time.perf_counter() - start)
                image = decoded_x0(pipe, sample, eps)
            outputs[name].append((eps.numpy(), image))
            if configs[name] is not None:
                stats = ppdiffusers_tome.tome_stats(pipe.unet)["UNet2DConditionModel"]
                plans[name] = stats["plans_computed"] / max(stats["calls"], 1)
        print(f"  seed {seed}: " + ", ".join(f"{n} {times[n][-1]:.1f}s" for n in names), flush=True)
    apply(pipe, None)
    cell = {}
    for name in names:
        ratios = [v / t for v, t in zip(times["vanilla"], times[name])]
        rel = [relative_l2(v[0], o[0]) for v, o in zip(outputs["vanilla"], outputs[name])]
        peaks = [psnr(v[1], o[1]) for v, o in zip(outputs["vanilla"], outputs[name])]
        finite = [p for p in peaks if np.isfinite(p)]
        cell[name] = {
            "seconds": times[name], "speedup": median(ratios), "speedup_range": [min(ratios), max(ratios)],
            "rel_l2": rel, "rel_l2_mean": statistics.mean(rel), "rel_l2_sd": statistics.pstdev(rel),
            "psnr": peaks, "psnr_mean": statistics.mean(finite) if finite else float("inf"),
            "psnr_sd": statistics.pstdev(finite) if len(finite) > 1 else 0.0, "plans_per_call": plans.get(name, 0.0),
        }
    return cell


def count_gpu_ops(pipe, vae_scale: int, configs: Dict[str, Any], latent: int = 32) -> Dict[str, Dict[str, float]]:
    """Eager ops added by each configuration's own plan, GPU branch forced, at a ``latent x latent`` latent: per
    merging block and per call. The configurations are counted under ``policy="tomesd"`` (unless they set the policy),
    since the default policy skips such small blocks on GPU kernels. The count does not depend on the size; feature
    order, whose cost did in earlier versions, is counted again at each cell's own size by :func:`main`."""
    with gpu_kernels():
        sample, timestep, context = unet_inputs(pipe.unet, latent * vae_scale, vae_scale, 0)

        def run():
            with paddle.no_grad():
                return pipe.unet(sample, timestep, context)

        apply(pipe, None)
        vanilla = count_forward_ops(run, pipe.unet)
        counts = {}
        for name, options in configs.items():
            if options is None:
                continue
            own_plan = options if "policy" in options or "min_work" in options else dict(options, policy="tomesd")
            apply(pipe, own_plan)
            patched = count_forward_ops(run, pipe.unet)
            added = patched.total - vanilla.total
            counts[name] = {"merging_blocks": patched.merging_blocks, "per_call": added,
                            "per_block": ops_added_per_block(vanilla.total, patched.total, patched.merging_blocks)}
        apply(pipe, None)
        return counts


def feature_ops_at(pipe, vae_scale: int, configs: Dict[str, Any], resolution: int,
                   small_ops: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    """``small_ops`` with the configurations in feature order counted again at ``resolution``."""
    feature = {n: o for n, o in configs.items() if o is not None and o.get("match_order") == "feature"}
    if not feature:
        return small_ops
    return {**small_ops, **count_gpu_ops(pipe, vae_scale, feature, latent=resolution // vae_scale)}


def plan_peaks(tokens: int, channels: int) -> Dict[str, float]:
    """Peak temporaries (MiB) of one plan + merge + unmerge at ``[2, tokens, channels]``, GPU branch forced."""
    side = int(round(tokens ** 0.5))
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((2, tokens, channels)).astype("float32"))
    core = paddle.base.core
    def local(window, order="grid"):
        wy, wx = merge_module.window_sides(side, side, window)
        table = merge_module.window_partition_table(side, side, wy, wx, 2, 2, merge_module.step_key(500), 0, 1)
        return lambda: merge_module.LocalMergePlan.from_matching(x, (side, side, wy, wx, 2, 2), table[0], (wy * wx) // 2,
                                                                 order=order)

    runs = {
        "global": lambda: merge_module.bipartite_soft_matching_random2d(x, side, side, 2, 2, tokens // 2, generator=0),
        "local16": local(16),
        "local32": local(32),
        "local16f": local(16, "feature"),
        "local32f": local(32, "feature"),
        "todo": lambda: merge_module.DownsamplePlan(tokens, 2, side, side, 2),
    }
    peaks = {}
    with gpu_kernels():
        for name, build in runs.items():
            def once():
                plan = build()
                if isinstance(plan, merge_module.DownsamplePlan):
                    return plan.keys_values(x)
                return plan.unmerge(plan.merge(x))
            once()
            before = core.host_memory_stat_current_value("Allocated", 0)
            core.host_memory_stat_reset_peak_value("Allocated", 0)
            once()
            peaks[name] = (core.host_memory_stat_peak_value("Allocated", 0) - before) / 2**20
    return peaks


def peak_of(name: str) -> Any:
    """The :func:`plan_peaks` entry that configuration ``name`` would have: its plan's (``+share`` shares the same
    plan; tomesd's is the global one), or None for vanilla. Callers show "–" for an entry that was not measured."""
    if name == "vanilla":
        return None
    plan = name.split("+")[0]
    return "global" if plan == "tome" else plan


def main(argv=None) -> None:
    known = CONFIGS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["sd15-narrow"])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[512])
    parser.add_argument("--seeds", type=int, default=4, help="seeds per cell (>= 2 for a spread)")
    parser.add_argument("--threads", type=int, default=None, help="Paddle CPU threads (default: all cores)")
    parser.add_argument("--output", default=os.path.join("outputs", "local_plans"))
    parser.add_argument("--render", nargs="+", metavar="RESULTS_JSON",
                        help="measure nothing: merge these results.json files, print the README tables (with the "
                             "distance of each configuration next to tome's in the same seeds; † = further from vanilla "
                             "than tome by more than tome's seed spread) and draw one Pareto plot into --output")
    parser.add_argument("--configs", nargs="+", choices=list(known), default=DEFAULT_CONFIGS,
                        help=f"configurations to compare (default: {' '.join(DEFAULT_CONFIGS)}); vanilla is always one")
    args = parser.parse_args(argv)
    if args.render:
        render(args.render, args.output)
        return
    configs = {name: known[name] for name in ["vanilla"] + [c for c in args.configs if c != "vanilla"]}
    threads = set_threads(args.threads)
    os.makedirs(args.output, exist_ok=True)
    result = {"environment": environment(threads, "float32"), "version": ppdiffusers_tome.__version__,
              "configs": configs, "cells": []}
    for preset in args.presets:
        pipe = preset_pipeline(preset)
        vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        small_ops = count_gpu_ops(pipe, vae_scale, configs)
        for resolution in args.resolutions:
            print(f"{preset} at {resolution}px:", flush=True)
            cell = measure_cell(pipe, resolution, vae_scale, args.seeds, configs)
            ops = feature_ops_at(pipe, vae_scale, configs, resolution, small_ops)
            tokens = (resolution // vae_scale) ** 2
            peaks = plan_peaks(tokens, pipe.unet.config.block_out_channels[0])
            rows = [["config", "speed-up (range)", "rel L2", "PSNR dB", "plans/call", "ops/block", "ops/call",
                     "peak MiB"]]
            for name, c in cell.items():
                o = ops.get(name)
                rows.append([
                    name, f"{c['speedup']:.2f}x ({c['speedup_range'][0]:.2f}-{c['speedup_range'][1]:.2f})",
                    f"{c['rel_l2_mean']:.4f} ± {c['rel_l2_sd']:.4f}",
                    "inf" if not np.isfinite(c["psnr_mean"]) else f"{c['psnr_mean']:.1f} ± {c['psnr_sd']:.1f}",
                    f"{c['plans_per_call']:.1f}", "-" if o is None else f"{o['per_block']:.1f}",
                    "-" if o is None else str(o["per_call"]),
                    "-" if peak_of(name) not in peaks else f"{peaks[peak_of(name)]:.1f}",
                ])
            print(render_table(rows), flush=True)
            result["cells"].append({"preset": preset, "resolution": resolution, "seeds": args.seeds, "tokens": tokens,
                                    "configs": cell, "gpu_ops": ops, "peak_mib": peaks})
            with open(os.path.join(args.output, "results.json"), "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2, default=float)
    write_pareto(result, args.output)
    print(f"wrote {os.path.join(args.output, 'results.json')}")


def pareto_names(cell: Dict[str, Any]) -> List[str]:
    """Configurations of ``cell`` that no other one beats on both speed-up and PSNR (vanilla: 1.0 and infinite)."""
    points = {n: (c["speedup"], c["psnr_mean"]) for n, c in cell["configs"].items()}
    return [n for n, p in points.items()
            if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for m, q in points.items() if m != n)]


def against_tome(cell: Dict[str, Any], name: str) -> Dict[str, Any]:
    """Distance of ``name`` from vanilla next to tomesd's plan (``tome``) in the same seeds: the mean paired
    difference of rel L2, how many seeds it is further on, and whether it is no further from vanilla than ``tome``
    plus ``tome``'s seed-to-seed spread (population standard deviation): closer always counts as within."""
    mine, tome = cell["configs"][name]["rel_l2"], cell["configs"]["tome"]["rel_l2"]
    diffs = [a - b for a, b in zip(mine, tome)]
    return {"mean_diff": statistics.mean(diffs), "relative": statistics.mean(mine) / statistics.mean(tome) - 1,
            "further_in": sum(d > 0 for d in diffs), "seeds": len(diffs),
            "within_spread": statistics.mean(diffs) <= statistics.pstdev(tome)}


def markdown_tables(result: Dict[str, Any]) -> str:
    """The README tables of a (merged) result: one per preset and resolution."""
    out = []
    for cell in result["cells"]:
        front = set(pareto_names(cell))
        out += [f"**{cell['preset']}, {cell['resolution']}²** ({cell['tokens']} tokens at the finest level, "
                f"{cell['seeds']} seeds)", "",
                "| configuration | CPU speed-up (range over seeds) | rel L2 ± sd | vs `tome` (seeds further) "
                "| PSNR dB ± sd "
                "| plans / call | GPU ops / block | GPU ops / call | peak MiB | Pareto |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, c in cell["configs"].items():
            ops, peak = cell["gpu_ops"].get(name), peak_of(name)
            if name == "vanilla":
                speed, rel, versus, quality = "1.00×", "0", "", "∞"
            else:
                speed = f"{c['speedup']:.2f}× ({c['speedup_range'][0]:.2f}–{c['speedup_range'][1]:.2f})"
                rel = f"{c['rel_l2_mean']:.4f} ± {c['rel_l2_sd']:.4f}"
                quality = f"{c['psnr_mean']:.1f} ± {c['psnr_sd']:.1f}"
                versus = ""
                if name != "tome" and "tome" in cell["configs"]:
                    t = against_tome(cell, name)
                    spread = "" if t["within_spread"] else " †"
                    versus = f"{t['relative']:+.0%} ({t['further_in']}/{t['seeds']}){spread}"
            peak_text = "–" if peak not in cell["peak_mib"] else f"{cell['peak_mib'][peak]:.1f}"
            per_block = "–" if ops is None else f"{ops['per_block']:.1f}"
            per_call = "–" if ops is None else str(ops["per_call"])
            label = "vanilla" if name == "vanilla" else f"`{name}`"
            pareto = "yes" if name in front else ""
            plans = f"{c['plans_per_call']:.0f}"
            out.append(f"| {label} | {speed} | {rel} | {versus} | {quality} | {plans} | {per_block} | {per_call} "
                       f"| {peak_text} | {pareto} |")
        out.append("")
    return "\n".join(out)


def render(paths: List[str], folder: str) -> None:
    """Merge the cells of several ``results.json`` files, print the README tables and draw one Pareto plot."""
    merged: Dict[str, Any] = {"cells": [], "versions": []}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        merged["cells"] += result["cells"]
        merged["versions"].append(result.get("version"))
    print(markdown_tables(merged))
    os.makedirs(folder, exist_ok=True)
    write_pareto(merged, folder)
    print(f"versions: {sorted(set(map(str, merged['versions'])))}; wrote {os.path.join(folder, 'pareto.png')}")


def write_pareto(result: Dict[str, Any], folder: str) -> None:
    """Per cell: distance from vanilla (rel L2, seed spread as error bars) against the eager ops the configuration
    adds to a UNet call on a GPU (the launch budget), each point labelled with its CPU speed-up. Every merging
    configuration at ratio 0.5 shortens attention alike, so on a GPU the cheaper and closer ones win: the grey line
    joins those that no other beats on both axes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - plots are optional
        print("matplotlib is not installed: no plot")
        return
    cells = result["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(4.6 * len(cells), 4.0), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        points = [(name, cell["gpu_ops"][name]["per_call"], c["rel_l2_mean"], c["rel_l2_sd"], c["speedup"])
                  for name, c in cell["configs"].items() if name in cell["gpu_ops"]]
        front = sorted((p for p in points if not any(q[1] <= p[1] and q[2] <= p[2] and q != p for q in points)),
                       key=lambda p: p[1])
        ax.plot([p[1] for p in front], [p[2] for p in front], "-", color="0.75", zorder=0)
        for name, ops, rel, spread, speed in points:
            ax.errorbar([ops], [rel], yerr=[spread], fmt="o", capsize=3, zorder=1)
            ax.annotate(f"{name} ({speed:.2f}x)", (ops, rel), textcoords="offset points", xytext=(6, -3),
                        fontsize=7)
        ax.set_title(f"{cell['preset']} {cell['resolution']}px, ratio 0.5", fontsize=9)
        ax.set_xlabel("eager ops added per UNet call, GPU branch (launches)", fontsize=8)
        ax.set_ylabel("rel L2 of the UNet output to vanilla", fontsize=8)
        ax.set_xlim(0, max(p[1] for p in points) * 1.45)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "pareto.png"), dpi=120, metadata={"Software": None})
    plt.close(fig)


if __name__ == "__main__":
    main()

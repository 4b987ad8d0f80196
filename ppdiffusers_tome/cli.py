"""Command line: ``ppdiffusers-tome demo|bench|figure`` (also ``python -m ppdiffusers_tome ...``).

``demo`` runs a pipeline with and without ToMe side by side at one resolution, prints a table (time, speed-up, peak
memory, difference to vanilla), and writes a PNG grid and a JSON record. With no ``--model`` it uses the embedded
default model (a Stable Diffusion pipeline built from a shipped config with random weights), so it needs no download.
``bench`` measures a grid of resolutions, batch sizes and methods (see :mod:`ppdiffusers_tome.bench`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

MIB = 1024.0 * 1024.0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _resolution(text: str) -> int:
    value = int(text)
    if value < 8 or value % 8:
        raise argparse.ArgumentTypeError(f"must be a multiple of 8 and >= 8, got {text}")
    return value


def _level(text: str):
    """``--max-downsample``: ``auto`` or an integer (validated by ToMeConfig with the allowed values)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or one of 1, 2, 4, 8; got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ppdiffusers-tome", description="Token Merging for ppdiffusers pipelines")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="vanilla vs ToMe side by side: table, PNG grid, JSON")
    source = demo.add_mutually_exclusive_group()
    source.add_argument("--model", help="a local pipeline folder (model_index.json); default: the embedded model")
    source.add_argument("--preset", default=None, help="a shipped config instead of the default (see presets.py)")
    demo.add_argument("--resolution", type=_resolution, default=256, help="image height and width in pixels")
    demo.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5], help="ToMe ratios to compare")
    demo.add_argument("--max-downsample", type=_level, default="auto", help="ToMe max_downsample (auto, 1, 2, 4 or 8)")
    demo.add_argument("--steps", type=_positive_int, default=8, help="denoising steps")
    demo.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per method (median reported)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--prompt", default="a lighthouse on a cliff at sunset, detailed oil painting")
    demo.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for Paddle (default: all)")
    demo.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    demo.add_argument("--output", default=os.path.join("outputs", "demo"), help="folder for demo.png/results.json")

    from .bench import ALL_METHODS
    from .presets import available_presets

    bench = sub.add_parser("bench", help="grid of resolutions x batch sizes x methods: table, JSON, plots")
    source = bench.add_mutually_exclusive_group()
    source.add_argument("--arch", choices=available_presets(), default=None,
                        help="model layout with random weights (default sd15-narrow)")
    source.add_argument("--model", help="a local pipeline folder instead of --arch")
    bench.add_argument("--resolutions", type=_resolution, nargs="+", default=[512])
    bench.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=[1], help="images per call")
    bench.add_argument("--ratios", type=float, nargs="+", default=[0.5])
    bench.add_argument("--methods", nargs="+", choices=ALL_METHODS, default=["vanilla", "tome", "tome-efficient", "bound"])
    bench.add_argument("--variants", nargs="+", default=[], metavar="METHOD:OPTION=VALUE,...",
                       help="extra configurations, e.g. tome:recompute_every=5 'tome:ratio=(0.6,0.3)' "
                            "todo:downsample_factor=4,downsample_mode=average")
    bench.add_argument("--compare-builtin", action="store_true", help="add ppdiffusers' built-in ToMe port")
    bench.add_argument("--steps", type=_positive_int, default=20, help="denoising steps per pipeline call")
    bench.add_argument("--unet-only", action="store_true", help="time one denoiser forward instead of a pipeline call")
    bench.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per method (median reported)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed runs per method before timing")
    bench.add_argument("--max-downsample", type=_level, default="auto",
                       help="auto (default: the finest level with attention, 2 on SDXL), 1, 2, 4 or 8")
    bench.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                       help="default: float16 on GPU, float32 on CPU")
    bench.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for Paddle (default: all)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--no-plots", action="store_true")
    bench.add_argument("--no-time-split", action="store_true", help="skip the attention/matching/rest split")
    bench.add_argument("--output", default=os.path.join("outputs", "bench"), help="folder for results.json and plots")

    figure = sub.add_parser("figure", help="draw the README figure: one ToMe plan on a token grid")
    figure.add_argument("--ratio", type=float, default=0.5)
    figure.add_argument("--grid", type=_positive_int, default=24, help="tokens per side")
    figure.add_argument("--seed", type=int, default=0)
    figure.add_argument("--output", default=os.path.join("outputs", "tome_plan.png"))
    return parser


def _run_once(pipe, args, size: int):
    from .bench import _pipeline_kwargs  # prompt, seed and, for ControlNet pipelines, a control image

    return pipe(**_pipeline_kwargs(pipe, size, 1, args.steps, args.seed, args.prompt)).images


def _check_dtype(dtype: str) -> None:
    from .measure import on_gpu

    if dtype != "float32" and not on_gpu():
        raise ValueError(f"--dtype {dtype} needs a GPU: Paddle's CPU build has no half-precision matmul")


def _grid(tiles: Sequence[np.ndarray], labels: Sequence[str]):
    from PIL import Image, ImageDraw

    h, w = tiles[0].shape[:2]
    strip = 14
    canvas = Image.new("RGB", (w * len(tiles), h + strip), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (tile, label) in enumerate(zip(tiles, labels)):
        canvas.paste(Image.fromarray((np.clip(tile, 0, 1) * 255).round().astype("uint8")), (i * w, strip))
        draw.text((i * w + 3, 1), label, fill="black")
    return canvas


def format_table(rows: List[Dict[str, Any]]) -> str:
    from .measure import format_table as render

    header = ["method", "ratio", "s/image", "UNet s/call", "speed-up", "peak MiB", "added MiB", "max |diff|", "PSNR dB"]
    lines = [header]
    for row in rows:
        lines.append(
            [
                row["method"],
                f"{row['ratio']:.2f}",
                f"{row['seconds_per_image']:.2f}",
                f"{row['unet_seconds']:.3f}",
                f"{row['speedup']:.2f}x",
                f"{row['peak_memory_bytes'] / MIB:.0f}",
                f"{row['added_memory_bytes'] / MIB:.0f}",
                f"{row['max_abs_diff']:.4f}",
                "inf" if row["psnr_db"] == float("inf") else f"{row['psnr_db']:.1f}",
            ]
        )
    return render(lines)


def run_demo(args: argparse.Namespace) -> Dict[str, Any]:
    import ppdiffusers_tome

    from .bench import save_json
    from .measure import ForwardTimer, PeakMemory, environment, median, psnr, set_threads
    from .presets import DEFAULT_PRESET, load_local_pipeline, preset_pipeline

    for ratio in args.ratios:  # validate every ratio before spending minutes on vanilla runs
        ppdiffusers_tome.ToMeConfig(ratio=ratio, max_downsample=args.max_downsample)
    _check_dtype(args.dtype)
    threads = set_threads(args.threads)
    if args.model:
        pipe, source = load_local_pipeline(args.model, dtype=args.dtype), os.path.abspath(args.model)
    else:
        preset = args.preset or DEFAULT_PRESET
        pipe, source = preset_pipeline(preset, seed=args.seed, dtype=args.dtype), f"preset:{preset} (random weights)"
    size = args.resolution
    logger.info("warming up (%s, %dx%d)", source, size, size)
    warm = argparse.Namespace(**{**vars(args), "steps": 1})
    _run_once(pipe, warm, size)

    methods = [("vanilla", 0.0)] + [("tome", float(r)) for r in args.ratios]
    times: Dict[int, List[float]] = {i: [] for i in range(len(methods))}
    unet_times: Dict[int, List[float]] = {i: [] for i in range(len(methods))}
    memory: Dict[int, Any] = {}
    images: Dict[int, np.ndarray] = {}
    for repeat in range(args.repeats):  # interleaved, so drift on a shared machine hits every method alike
        for i, (name, ratio) in enumerate(methods):
            ppdiffusers_tome.remove_tome(pipe)
            if name == "tome":
                ppdiffusers_tome.apply_tome(pipe, ratio=ratio, max_downsample=args.max_downsample)
            timer = ForwardTimer(pipe.unet)
            try:
                with PeakMemory() as mem:
                    start = time.perf_counter()
                    out = _run_once(pipe, args, size)
                    times[i].append(time.perf_counter() - start)
            finally:
                timer.remove()
                ppdiffusers_tome.remove_tome(pipe)
            unet_times[i].extend(timer.seconds[1:] or timer.seconds)  # the first call pays one-off set-up
            if i not in memory or mem.peak_bytes > memory[i].peak_bytes:
                memory[i] = mem
            images[i] = np.asarray(out[0], dtype=np.float64)
            logger.info("%s ratio=%.2f run %d: %.2f s", name, ratio, repeat + 1, times[i][-1])
    ppdiffusers_tome.remove_tome(pipe)

    base = median(times[0])
    rows = []
    for i, (name, ratio) in enumerate(methods):
        rows.append(
            {
                "method": name,
                "ratio": ratio,
                "seconds_per_image": median(times[i]),
                "unet_seconds": median(unet_times[i]),
                "speedup": base / median(times[i]),
                "peak_memory_bytes": int(memory[i].peak_bytes),
                "added_memory_bytes": int(memory[i].added_bytes),
                "memory_kind": memory[i].kind,
                "max_abs_diff": float(np.abs(images[i] - images[0]).max()),
                "psnr_db": psnr(images[0], images[i]),
                "runs_seconds": times[i],
            }
        )
    os.makedirs(args.output, exist_ok=True)
    last = len(methods) - 1
    diff = np.clip(np.abs(images[last] - images[0]) * 4.0, 0, 1)
    labels = ["vanilla"] + [f"ToMe {r:.2f}" for _, r in methods[1:]] + [f"|diff| x4 ({methods[last][1]:.2f})"]
    png = os.path.join(args.output, "demo.png")
    _grid([images[i] for i in range(len(methods))] + [diff], labels).save(png)
    record = {
        "command": "demo",
        "source": source,
        "environment": environment(threads, args.dtype),
        "settings": {
            "resolution": size,
            "steps": args.steps,
            "repeats": args.repeats,
            "seed": args.seed,
            "prompt": args.prompt,
            "max_downsample": args.max_downsample,
            "batch_size": 1,
        },
        "results": rows,
        "png": png,
    }
    path = os.path.join(args.output, "results.json")
    save_json(record, path)  # (PSNR of vanilla is inf: written as the string "inf", keeping the file valid JSON)
    env = record["environment"]
    sys.stdout.write(
        f"ToMe demo: {source}, {size}x{size}, {args.steps} steps, {env['dtype']} on {env['device']} "
        f"({threads} threads), median of {args.repeats} run(s)\n{format_table(rows)}\n"
        f"wrote {png} and {path}\n"
    )
    return record


def run_bench(args: argparse.Namespace) -> Dict[str, Any]:
    from tqdm import tqdm

    from . import bench
    from .measure import set_threads
    from .presets import DEFAULT_PRESET, load_local_pipeline, preset_pipeline

    from .measure import on_gpu

    dtype = args.dtype or ("float16" if on_gpu() else "float32")
    _check_dtype(dtype)
    max_downsample = args.max_downsample
    methods = list(args.methods) + (["builtin"] if args.compare_builtin and "builtin" not in args.methods else [])
    settings = bench.BenchSettings(
        resolutions=args.resolutions, batch_sizes=args.batch_sizes, ratios=args.ratios, methods=methods,
        variants=list(args.variants), steps=args.steps, repeats=args.repeats, warmup=max(args.warmup, 0),
        max_downsample=max_downsample, unet_only=args.unet_only, seed=args.seed,
    )
    for ratio in settings.ratios:  # validate before building anything
        from .config import ToMeConfig

        ToMeConfig(ratio=ratio, max_downsample=max_downsample)
    bench.method_list(settings)  # (parses and validates --variants)
    threads = set_threads(args.threads)
    if args.model:
        pipe, source = load_local_pipeline(args.model, dtype=dtype), os.path.abspath(args.model)
    else:
        preset = args.arch or DEFAULT_PRESET
        pipe, source = preset_pipeline(preset, seed=args.seed, dtype=dtype), f"preset:{preset} (random weights)"
    with tqdm(total=bench.grid_steps(settings), desc="bench", unit="run", disable=None) as bar:
        cells = bench.run_grid(pipe, settings, progress=lambda: bar.update(1))
    split: Dict[str, Dict[str, float]] = {}
    if not args.no_time_split:
        size, batch = settings.resolutions[0], settings.batch_sizes[0]
        split_methods = [bench.Method("vanilla")] + [bench.Method("tome", r) for r in settings.ratios]
        if "builtin" in methods:
            split_methods += [bench.Method("builtin", r) for r in settings.ratios]
        for method in split_methods:
            try:
                split[method.label] = bench.time_split(pipe, settings, size, batch, method)
            except Exception as error:  # noqa: BLE001
                if not bench.is_out_of_memory(error):
                    raise
                logger.warning("time split of %s skipped: out of memory", method.label)
    os.makedirs(args.output, exist_ok=True)
    data = bench.record(cells, settings, source, threads, dtype, split)
    data["plots"] = [] if args.no_plots else bench.write_plots(cells, split, args.output)
    path = os.path.join(args.output, "results.json")
    bench.save_json(data, path)
    env = data["environment"]
    kind = "one denoiser forward" if settings.unet_only else f"{settings.steps}-step pipeline call"
    lines = [
        f"ToMe bench: {source}, {kind}, {dtype} on {env['device']} ({threads} threads), median of {settings.repeats}",
        "seconds per image (speed-up vs vanilla):",
        bench.format_table(cells, bench.method_list(settings)),
        "",
        bench.format_details(cells),
        "",
        "speed-up vs fidelity to vanilla (Pareto: no other configuration is both faster and closer):",
        bench.format_pareto(cells),
    ]
    if split:
        lines += ["", "time split of one UNet forward (s): "
                  + "; ".join(f"{k}: attention {v['attention']:.3f}, matching {v['matching']:.3f}, rest {v['rest']:.3f}"
                              for k, v in split.items())]
    lines.append(f"wrote {path}" + (f" and {len(data['plots'])} plots" if data["plots"] else ""))
    sys.stdout.write("\n".join(lines) + "\n")
    return data


def run_figure(args: argparse.Namespace) -> Dict[str, Any]:
    from .config import ToMeConfig
    from .figure import draw_plan_figure

    ToMeConfig(ratio=args.ratio)
    image, info = draw_plan_figure(ratio=args.ratio, grid=args.grid, seed=args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    image.save(args.output)
    sys.stdout.write(
        f"{info['grid']}x{info['grid']} tokens, {info['dst']} dst, {info['merged']} merged at ratio {args.ratio:g}: "
        f"wrote {args.output}\n"
    )
    return info


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            run_demo(args)
        elif args.command == "bench":
            run_bench(args)
        elif args.command == "figure":
            run_figure(args)
    except ValueError as error:  # bad input: a clear message, not a traceback
        sys.stderr.write(f"ppdiffusers-tome {args.command}: error: {error}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

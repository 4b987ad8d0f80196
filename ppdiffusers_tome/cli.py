"""Command line: ``ppdiffusers-tome demo|bench|figure`` (also ``python -m ppdiffusers_tome ...``).

Paddle and ppdiffusers are imported inside the sub-command runners only, so ``--help`` and ``--version`` answer at
once (the package's ``__init__`` skips them too for those two flags).

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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import __version__
from .presets import DEFAULT_PRESET, available_presets, default_resolution, preset_summary

logger = logging.getLogger(__name__)

# bench.ALL_METHODS, repeated here so that ``--help`` does not import bench (and Paddle); a test keeps them equal
BENCH_METHODS = ("vanilla", "tome", "tome-efficient", "todo", "todo-efficient", "builtin", "bound")

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


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default after its help (unless the help already gives it, or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default is None or default is False or default == argparse.SUPPRESS \
                or default == [] or "default" in text:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _presets_epilog() -> str:
    lines = ["presets (random weights, built offline; default resolution in pixels):"]
    for name in available_presets():
        mark = " (default)" if name == DEFAULT_PRESET else ""
        lines.append(f"  {name:<18} {default_resolution(name):>5} px  {preset_summary(name)}{mark}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ppdiffusers-tome", description="Token Merging for ppdiffusers pipelines")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="vanilla vs ToMe side by side: table, PNG grid, JSON", formatter_class=_HelpFormatter,
        description="Run one pipeline without and with ToMe at the same seed, interleaved, and compare time,\n"
                    "memory and the images. Without --model it builds a preset with random weights (no download),\n"
                    "so its images are noise.",
        epilog=_presets_epilog(),
    )
    source = demo.add_mutually_exclusive_group()
    source.add_argument("--model", help="a local pipeline folder (model_index.json) instead of a preset")
    source.add_argument("--preset", "--arch", dest="preset", choices=available_presets(), metavar="PRESET",
                        default=DEFAULT_PRESET, help="a shipped model layout, listed below (--arch is an alias)")
    demo.add_argument("--resolution", type=_resolution, default=None,
                      help="image height and width in pixels (default: the preset's, listed below; for --model the "
                           "model's own sample size)")
    demo.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5], help="ToMe ratios to compare")
    demo.add_argument("--max-downsample", type=_level, default="auto", help="ToMe max_downsample (auto, 1, 2, 4 or 8)")
    demo.add_argument("--steps", type=_positive_int, default=8, help="denoising steps")
    demo.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per method (median reported)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the initial latents")
    demo.add_argument("--prompt", default="a lighthouse on a cliff at sunset, detailed oil painting", help="prompt")
    demo.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for Paddle (default: all)")
    demo.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                      help="float16 and bfloat16 need a GPU")
    demo.add_argument("--output", default=os.path.join("outputs", "demo"), help="folder for demo.png/results.json")

    bench = sub.add_parser("bench", help="grid of resolutions x batch sizes x methods: table, JSON, plots",
                           formatter_class=_HelpFormatter, epilog=_presets_epilog())
    source = bench.add_mutually_exclusive_group()
    source.add_argument("--preset", "--arch", dest="preset", choices=available_presets(), metavar="PRESET",
                        default=DEFAULT_PRESET,
                        help="model layout with random weights, listed below (--arch is an alias)")
    source.add_argument("--model", help="a local pipeline folder instead of --preset")
    bench.add_argument("--resolutions", type=_resolution, nargs="+", default=None,
                       help="image sizes in pixels (default: the preset's, listed below)")
    bench.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=[1], help="images per call")
    bench.add_argument("--ratios", type=float, nargs="+", default=[0.5])
    bench.add_argument("--methods", nargs="+", choices=BENCH_METHODS,
                       default=["vanilla", "tome", "tome-efficient", "bound"])
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
    bench.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                       help="gpu needs a CUDA build of PaddlePaddle (paddlepaddle-gpu); timing is synchronised and "
                            "memory is Paddle's max allocated bytes there")
    bench.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                       help="default: float16 with --device gpu, float32 on CPU")
    bench.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for Paddle (default: all)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--no-plots", action="store_true")
    bench.add_argument("--no-time-split", action="store_true", help="skip the attention/matching/rest split")
    bench.add_argument("--no-op-count", action="store_true",
                       help="skip the ops/block column (one extra profiled denoiser forward per cell and method)")
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


def _layout(args: argparse.Namespace):
    """``(layout, default resolution, label)`` of the model a demo or bench run will build, read from the preset's
    config or the folder's ``unet/config.json`` without building anything (layout ``None``: not a UNet)."""
    from .presets import folder_layout, preset_layout

    if args.model:
        layout = folder_layout(args.model)
        sample = layout[0].get("sample_size") if layout else None
        default = sample * layout[1] if isinstance(sample, int) else 512
        return layout, default, f"model {args.model}"
    return preset_layout(args.preset), default_resolution(args.preset), f"preset {args.preset!r}"


def _check_memory(
    args: argparse.Namespace, resolutions: Sequence[int], images: int, dtype: str, option: str, gpu: bool
) -> None:
    """Stop before building anything when the run's largest self-attention cannot fit in the memory available.
    CPU only (``gpu`` False): on a GPU, an attention that does not fit raises Paddle's out-of-memory error, which
    the run reports, instead of the operating system killing the process."""
    from .presets import check_attention_memory

    if not gpu:
        layout, _, label = _layout(args)
        check_attention_memory(layout, resolutions, images, dtype, label, option)


def _step_bar(pipe, steps: int, desc: str):
    """A progress bar on stderr that advances with every denoiser forward of ``pipe`` (one per step with
    classifier-free guidance batched). Returns ``(bar, hook handle)``; close the bar and remove the handle."""
    from .progress import ProgressBar

    bar = ProgressBar(total=steps, desc=desc, unit="steps")
    denoiser = getattr(pipe, "unet", None)
    denoiser = denoiser if denoiser is not None else getattr(pipe, "transformer", None)
    handle = denoiser.register_forward_post_hook(lambda *_: bar.update()) if denoiser is not None else None
    return bar, handle


def _run_with_bar(pipe, args: argparse.Namespace, size: int, desc: str):
    bar, handle = _step_bar(pipe, args.steps, desc)
    try:
        return _run_once(pipe, args, size)
    finally:
        if handle is not None:
            handle.remove()
        bar.close()


DEMO_LEGEND = (
    "s/image: one pipeline call; UNet s/call: median UNet forward; speed-up: vanilla's s/image over the row's\n"
    "peak MiB: the most memory the process held during the call (resident set on CPU, Paddle's allocated bytes on "
    "GPU)\n"
    "added MiB: that peak minus what the process already held before the call (the call's own working memory)\n"
    "max |diff|: largest pixel difference to vanilla, pixels in 0..1; PSNR dB: against vanilla, higher is closer "
    "(inf: identical)"
)


def _row_label(row: Dict[str, Any]) -> str:
    return "vanilla" if row["method"] == "vanilla" else f"ToMe {row['ratio']:.2f}"


def unstable_runs(rows: Sequence[Dict[str, Any]], tolerance: float = 0.25) -> List[str]:
    """The rows whose timed runs spread by more than ``tolerance`` of their median (``(max - min) / median``),
    as ``"vanilla 1.00-4.00 s"``. Non-empty means the machine was busy while the demo ran.

    >>> unstable_runs([{"method": "vanilla", "ratio": 0.0, "runs_seconds": [1.0, 1.1, 4.0]},
    ...                {"method": "tome", "ratio": 0.5, "runs_seconds": [0.5, 0.52, 0.51]}])
    ['vanilla 1.00-4.00 s']
    """
    import statistics

    found = []
    for row in rows:
        runs = [float(t) for t in row["runs_seconds"]]
        if len(runs) > 1 and (max(runs) - min(runs)) > tolerance * statistics.median(runs):
            found.append(f"{_row_label(row)} {min(runs):.2f}-{max(runs):.2f} s")
    return found


def speedup_range(vanilla_runs: Sequence[float], runs: Sequence[float]) -> Tuple[float, float]:
    """The lowest and highest speed-up that pairs of single runs give: ``min(vanilla_runs) / max(runs)`` (fastest
    vanilla run against the slowest one) to ``max(vanilla_runs) / min(runs)``.

    >>> speedup_range([1.0, 4.0], [1.5, 2.0])
    (0.5, 2.6666666666666665)
    """
    return min(vanilla_runs) / max(runs), max(vanilla_runs) / min(runs)


def noise_warning(rows: Sequence[Dict[str, Any]], tolerance: float = 0.25) -> Optional[str]:
    """A warning for the demo's output when its timed runs varied by more than ``tolerance`` (see
    :func:`unstable_runs`): the range each speed-up could take judged by single runs, and whether that range
    includes 1.00x (then the speed-up is not meaningful). ``None`` when the runs agree. ``rows[0]`` is vanilla."""
    spread = unstable_runs(rows, tolerance)
    if not spread:
        return None
    ranges = [(_row_label(row), *speedup_range(rows[0]["runs_seconds"], row["runs_seconds"])) for row in rows[1:]]
    between = ", ".join(f"{label} lies between {lo:.2f}x and {hi:.2f}x" for label, lo, hi in ranges)
    text = (
        f"WARNING: the timed runs varied a lot ({'; '.join(spread)}), so the machine was busy. Judged by single "
        f"runs, the speed-up of {between}."
    )
    if any(lo <= 1.0 <= hi for _, lo, hi in ranges):
        text += " Where that range includes 1.00x, the speed-up is not meaningful."
    return text + " Run again on an idle machine, or with more --repeats."


def run_demo(args: argparse.Namespace) -> Dict[str, Any]:
    import ppdiffusers_tome

    from .bench import save_json
    from .measure import ForwardTimer, PeakMemory, environment, median, on_gpu, psnr, set_threads
    from .presets import load_local_pipeline, preset_pipeline

    for ratio in args.ratios:  # validate every ratio before spending minutes on vanilla runs
        ppdiffusers_tome.ToMeConfig(ratio=ratio, max_downsample=args.max_downsample)
    _check_dtype(args.dtype)
    size = args.resolution or _layout(args)[1]
    _check_memory(args, [size], 1, args.dtype, "--resolution", gpu=on_gpu())  # before building anything
    threads = set_threads(args.threads)
    if args.model:
        logger.info("loading the pipeline in %s ...", args.model)
        pipe, source = load_local_pipeline(args.model, dtype=args.dtype), os.path.abspath(args.model)
    else:
        logger.info("building preset %s with random weights (its images are noise) ...", args.preset)
        pipe = preset_pipeline(args.preset, seed=args.seed, dtype=args.dtype)
        source = f"preset:{args.preset} (random weights)"
    logger.info("warming up (%s, %dx%d)", source, size, size)
    warm = argparse.Namespace(**{**vars(args), "steps": 1})
    _run_with_bar(pipe, warm, size, "warm-up")

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
            label = "vanilla" if name == "vanilla" else f"ToMe {ratio:.2f}"
            bar, handle = _step_bar(pipe, args.steps, f"{label} run {repeat + 1}/{args.repeats}")
            try:
                with PeakMemory() as mem:
                    start = time.perf_counter()
                    out = _run_once(pipe, args, size)
                    times[i].append(time.perf_counter() - start)
            finally:
                if handle is not None:
                    handle.remove()
                bar.close()
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
                "speedup_range": list(speedup_range(times[0], times[i])),
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
        "unstable_runs": unstable_runs(rows),  # (each row's "speedup_range" says how far the noise reaches)
        "png": png,
    }
    path = os.path.join(args.output, "results.json")
    save_json(record, path)  # (PSNR of vanilla is inf: written as the string "inf", keeping the file valid JSON)
    env = record["environment"]
    warning = noise_warning(rows)
    warning = warning + "\n" if warning else ""
    noise = "" if args.model else "The images are noise: a preset has random weights (use --model for real images).\n"
    sys.stdout.write(
        f"ToMe demo: {source}, {size}x{size}, {args.steps} steps, {env['dtype']} on {env['device']} "
        f"({threads} threads), median of {args.repeats} run(s)\n{format_table(rows)}\n{DEMO_LEGEND}\n"
        f"{warning}{noise}wrote {png} and {path}\n"
    )
    return record


def run_bench(args: argparse.Namespace) -> Dict[str, Any]:
    from . import bench
    from .measure import set_threads
    from .presets import load_local_pipeline, preset_pipeline
    from .progress import ProgressBar

    device = bench.select_device(args.device)  # a CPU-only build refuses --device gpu here, before anything is built
    dtype = args.dtype or ("float16" if device.name == "gpu" else "float32")
    _check_dtype(dtype)
    max_downsample = args.max_downsample
    methods = list(args.methods) + (["builtin"] if args.compare_builtin and "builtin" not in args.methods else [])
    settings = bench.BenchSettings(
        resolutions=args.resolutions or [_layout(args)[1]], batch_sizes=args.batch_sizes, ratios=args.ratios,
        methods=methods,
        variants=list(args.variants), steps=args.steps, repeats=args.repeats, warmup=max(args.warmup, 0),
        max_downsample=max_downsample, unet_only=args.unet_only, seed=args.seed, count_ops=not args.no_op_count,
    )
    for ratio in settings.ratios:  # validate before building anything
        from .config import ToMeConfig

        ToMeConfig(ratio=ratio, max_downsample=max_downsample)
    bench.method_list(settings)  # (parses and validates --variants)
    _check_memory(args, settings.resolutions, max(settings.batch_sizes), dtype, "--resolutions",
                  gpu=device.name == "gpu")
    threads = set_threads(args.threads)
    if args.model:
        pipe, source = load_local_pipeline(args.model, dtype=dtype), os.path.abspath(args.model)
    else:
        logger.info("building preset %s with random weights ...", args.preset)
        pipe = preset_pipeline(args.preset, seed=args.seed, dtype=dtype)
        source = f"preset:{args.preset} (random weights)"
    with ProgressBar(total=bench.grid_steps(settings), desc="bench", unit="runs") as bar:
        cells = bench.run_grid(pipe, settings, progress=lambda: bar.update(1), device=device)
    split: Dict[str, Dict[str, float]] = {}
    if not args.no_time_split:
        size, batch = settings.resolutions[0], settings.batch_sizes[0]
        split_methods = [bench.Method("vanilla")] + [bench.Method("tome", r) for r in settings.ratios]
        if "builtin" in methods:
            split_methods += [bench.Method("builtin", r) for r in settings.ratios]
        for method in split_methods:
            try:
                split[method.label] = bench.time_split(pipe, settings, size, batch, method, device=device)
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

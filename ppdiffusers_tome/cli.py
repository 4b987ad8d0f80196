"""Command line: ``ppdiffusers-tome demo`` (also ``python -m ppdiffusers_tome demo``).

``demo`` runs a pipeline with and without ToMe side by side at one resolution, prints a table (time, speed-up, peak
memory, difference to vanilla), and writes a PNG grid and a JSON record. With no ``--model`` it uses the embedded
default model (a Stable Diffusion pipeline built from a shipped config with random weights), so it needs no download.
"""

from __future__ import annotations

import argparse
import json
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ppdiffusers-tome", description="Token Merging for ppdiffusers pipelines")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="vanilla vs ToMe side by side: table, PNG grid, JSON")
    source = demo.add_mutually_exclusive_group()
    source.add_argument("--model", help="a local pipeline folder (model_index.json); default: the embedded model")
    source.add_argument("--preset", default=None, help="a shipped config instead of the default (see presets.py)")
    demo.add_argument("--resolution", type=_resolution, default=256, help="image height and width in pixels")
    demo.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5], help="ToMe ratios to compare")
    demo.add_argument("--max-downsample", type=int, default=1, help="ToMe max_downsample (1, 2, 4 or 8)")
    demo.add_argument("--steps", type=_positive_int, default=8, help="denoising steps")
    demo.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per method (median reported)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--prompt", default="a lighthouse on a cliff at sunset, detailed oil painting")
    demo.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for Paddle (default: all)")
    demo.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    demo.add_argument("--output", default=os.path.join("outputs", "demo"), help="folder for demo.png/results.json")
    return parser


def _run_once(pipe, args, height: int, width: int):
    import paddle

    return pipe(
        prompt=args.prompt,
        num_inference_steps=args.steps,
        height=height,
        width=width,
        generator=paddle.Generator().manual_seed(args.seed),
        output_type="np",
    ).images


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
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)) for line in lines]
    out.insert(1, "-+-".join("-" * wd for wd in widths))
    return "\n".join(out)


def run_demo(args: argparse.Namespace) -> Dict[str, Any]:
    import ppdiffusers_tome

    from .measure import ForwardTimer, PeakMemory, environment, median, psnr, set_threads
    from .presets import DEFAULT_PRESET, load_local_pipeline, preset_pipeline

    for ratio in args.ratios:  # validate every ratio before spending minutes on vanilla runs
        ppdiffusers_tome.ToMeConfig(ratio=ratio, max_downsample=args.max_downsample)
    threads = set_threads(args.threads)
    if args.model:
        pipe, source = load_local_pipeline(args.model, dtype=args.dtype), os.path.abspath(args.model)
    else:
        preset = args.preset or DEFAULT_PRESET
        pipe, source = preset_pipeline(preset, seed=args.seed, dtype=args.dtype), f"preset:{preset} (random weights)"
    size = args.resolution
    logger.info("warming up (%s, %dx%d)", source, size, size)
    warm = argparse.Namespace(**{**vars(args), "steps": 1})
    _run_once(pipe, warm, size, size)

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
            with PeakMemory() as mem:
                start = time.perf_counter()
                out = _run_once(pipe, args, size, size)
                times[i].append(time.perf_counter() - start)
            timer.remove()
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
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, default=float)
    env = record["environment"]
    sys.stdout.write(
        f"ToMe demo: {source}, {size}x{size}, {args.steps} steps, {env['dtype']} on {env['device']} "
        f"({threads} threads), median of {args.repeats} run(s)\n{format_table(rows)}\n"
        f"wrote {png} and {path}\n"
    )
    return record


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            run_demo(args)
    except ValueError as error:  # bad input: a clear message, not a traceback
        sys.stderr.write(f"ppdiffusers-tome {args.command}: error: {error}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

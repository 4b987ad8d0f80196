"""The options beyond tomesd side by side on one pipeline: plain ToMe, ToDo, plan caching and a ratio schedule.
Prints seconds and PSNR against vanilla (same seed) for each, and saves every image under a name that says
what it is (vanilla.png, tome_0.5.png, todo_x2.png, ...) plus all of them in one row, side_by_side.png.

    python examples/beyond_tomesd.py                                   # tiny built-in model, random weights
    python examples/beyond_tomesd.py --model /path/to/stable-diffusion-v1-5 --resolution 768 --steps 25

Timings of the tiny default say nothing about speed (its attention is too small for merging to pay).
"""

import argparse
import logging
import os
import time

import numpy as np

logger = logging.getLogger("beyond_tomesd")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""

# label: (file name, apply_tome options)
CONFIGS = {
    "vanilla": ("vanilla", None),
    "tome 0.5": ("tome_0.5", dict(ratio=0.5)),
    "todo x2": ("todo_x2", dict(method="todo", downsample_factor=2)),
    "tome 0.5, plans reused for 5 steps": ("tome_0.5_recompute_every_5", dict(ratio=0.5, recompute_every=5)),
    "tome 0.7 -> 0.3": ("tome_0.7_to_0.3", dict(ratio=(0.7, 0.3))),
}


def parse_args(argv=None):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help="local pipeline folder; none: the tiny built-in preset")
    parser.add_argument("--prompt", default="a harbour at dawn, fishing boats, mist", help="the prompt")
    parser.add_argument("--resolution", type=int, default=64, help="image height and width in pixels")
    parser.add_argument("--steps", type=int, default=6, help="denoising steps")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "beyond_tomesd"),
                        help="folder for the images")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    return parser, parser.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # noqa: F401  (imported before Paddle: it keeps Paddle's import-time warnings quiet)
    import paddle

    from ppdiffusers_tome.presets import TINY_TIMINGS, check_dtype, load_local_pipeline, preset_pipeline
    from ppdiffusers_tome.quiet import configure_logging
    from ppdiffusers_tome.tools.images import side_by_side
    from ppdiffusers_tome.tools.measure import psnr

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))

    pipe = load_local_pipeline(args.model, dtype=args.dtype) if args.model else preset_pipeline("tiny", dtype=args.dtype)
    os.makedirs(args.output, exist_ok=True)
    reference, images = None, []
    for label, (name, options) in CONFIGS.items():
        pipe.remove_tome()
        if options is not None:
            pipe.apply_tome(**options)
        # warm-up: a first call builds kernels, tables and caches that the timed one should not pay for
        pipe(args.prompt, height=args.resolution, width=args.resolution, num_inference_steps=1)
        start = time.perf_counter()
        image = pipe(args.prompt, height=args.resolution, width=args.resolution, num_inference_steps=args.steps,
                     generator=paddle.Generator().manual_seed(0)).images[0]
        seconds = time.perf_counter() - start
        pixels = np.asarray(image, dtype=np.float64) / 255.0
        reference = pixels if reference is None else reference
        path = os.path.join(args.output, f"{name}.png")
        image.save(path)
        images.append(image)
        logger.info("%-36s %6.2f s  PSNR %s dB  -> %s", label, seconds,
                    "inf" if options is None else f"{psnr(reference, pixels):.1f}", path)
    pipe.remove_tome()
    if not args.model:
        logger.info("%s", TINY_TIMINGS)
    side_by_side(images, [name for name, _ in CONFIGS.values()]).save(os.path.join(args.output, "side_by_side.png"))
    logger.info("saved %d images and side_by_side.png in %s", len(images), os.path.abspath(args.output))


if __name__ == "__main__":
    main()

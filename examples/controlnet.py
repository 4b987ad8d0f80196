"""ControlNet with ToMe: the same call patches the UNet and the ControlNet. Generates with and without ToMe
(same seed), each timed after a one-step warm-up call, prints the time of each, and saves control.png,
vanilla.png, tome.png and side_by_side.png (control | vanilla | ToMe).

    python examples/controlnet.py                                   # tiny built-in model with a ControlNet
    python examples/controlnet.py --model /path/to/sd15-controlnet-canny-pipeline --control edges.png --resolution 512

Timings of the tiny default say nothing about speed (its attention is too small for merging to pay).
"""

import argparse
import logging
import os
import time

import numpy as np
from PIL import Image

logger = logging.getLogger("controlnet")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def edge_map(size):
    """A white-on-black outline of a house, the kind of image a canny ControlNet expects."""
    canvas = np.zeros((size, size), dtype="uint8")
    a, b = size // 4, 3 * size // 4
    canvas[b, a:b] = canvas[size // 2 : b, a] = canvas[size // 2 : b, b] = 255
    for i in range(a, b + 1):  # the roof
        top = size // 2 - (size // 4 - abs(i - size // 2))
        canvas[max(top, 0), i] = 255
    return Image.fromarray(np.stack([canvas] * 3, axis=-1))


def parse_args(argv=None):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help="local StableDiffusionControlNetPipeline folder; none: the tiny preset")
    parser.add_argument("--control", help="control image; none: a generated edge map")
    parser.add_argument("--prompt", default="a cosy cottage in the woods, storybook illustration", help="the prompt")
    parser.add_argument("--resolution", type=int, default=64, help="image height and width in pixels")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe's ratio: the share of tokens merged")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "controlnet"),
                        help="folder for the images")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    return parser, parser.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # imported before Paddle: it keeps Paddle's import-time warnings quiet
    import paddle

    from ppdiffusers_tome.presets import TINY_TIMINGS, check_dtype, load_local_pipeline, preset_pipeline
    from ppdiffusers_tome.quiet import configure_logging
    from ppdiffusers_tome.tools.images import side_by_side

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))

    pipe = load_local_pipeline(args.model, dtype=args.dtype) if args.model else preset_pipeline("tiny-controlnet", dtype=args.dtype)
    control = Image.open(args.control).convert("RGB") if args.control else edge_map(args.resolution)
    os.makedirs(args.output, exist_ok=True)
    control.save(os.path.join(args.output, "control.png"))
    images = {}
    call = dict(image=control, height=args.resolution, width=args.resolution)
    for label in ("vanilla", "tome"):
        if label == "tome":
            pipe.apply_tome(ratio=args.ratio)  # UNet and ControlNet both
        # warm-up: a first call builds kernels, tables and caches that the timed one should not pay for
        pipe(args.prompt, num_inference_steps=1, **call)
        start = time.perf_counter()
        images[label] = pipe(args.prompt, num_inference_steps=args.steps, generator=paddle.Generator().manual_seed(0),
                             **call).images[0]
        seconds = time.perf_counter() - start
        path = os.path.join(args.output, f"{label}.png")
        images[label].save(path)
        logger.info("%s: %.2f s -> %s", "vanilla" if label == "vanilla" else f"ToMe ratio={args.ratio}",
                    seconds, path)
    logger.info("ToMe on each model: %s", ppdiffusers_tome.tome_status(pipe))
    if not args.model:
        logger.info("%s", TINY_TIMINGS)
    pipe.remove_tome()
    side_by_side([control.resize(images["vanilla"].size), images["vanilla"], images["tome"]],
                 ["control", "vanilla", f"ToMe {args.ratio}"]).save(os.path.join(args.output, "side_by_side.png"))
    logger.info("saved control.png, vanilla.png, tome.png and side_by_side.png in %s", os.path.abspath(args.output))


if __name__ == "__main__":
    main()

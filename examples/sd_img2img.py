"""Image-to-image with ToMe: re-paint a start image with and without token merging.

    python examples/sd_img2img.py                                   # tiny built-in model, random weights
    python examples/sd_img2img.py --model /path/to/stable-diffusion-v1-5 --image photo.png --resolution 512
"""

import argparse
import logging
import os

import numpy as np
from PIL import Image

logger = logging.getLogger("sd_img2img")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def start_image(path, size):
    if path:
        return Image.open(path).convert("RGB").resize((size, size))
    # a soft diagonal gradient with a bright disc, so there is structure to keep
    yy, xx = np.mgrid[0:size, 0:size] / max(size - 1, 1)
    disc = ((xx - 0.6) ** 2 + (yy - 0.4) ** 2 < 0.05).astype(float)
    rgb = np.stack([xx, yy, 1 - xx], axis=-1) * 0.7 + disc[..., None] * 0.3
    return Image.fromarray((rgb * 255).astype("uint8"))


def parse_args(argv=None):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help="local pipeline folder; none: the tiny built-in preset")
    parser.add_argument("--image", help="start image; none: a generated gradient")
    parser.add_argument("--prompt", default="an oil painting of a sunrise over the sea", help="the prompt")
    parser.add_argument("--resolution", type=int, default=64, help="image height and width in pixels")
    parser.add_argument("--strength", type=float, default=0.7, help="how much of the start image is re-painted")
    parser.add_argument("--steps", type=int, default=6, help="denoising steps")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe's ratio: the share of tokens merged")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "sd_img2img"),
                        help="folder for the images")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    return parser, parser.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # imported before Paddle: it keeps Paddle's import-time warnings quiet
    import paddle

    from ppdiffusers_tome.presets import check_dtype, load_local_pipeline, preset_pipeline
    from ppdiffusers_tome.quiet import configure_logging

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))

    import ppdiffusers

    base = load_local_pipeline(args.model, dtype=args.dtype) if args.model else preset_pipeline("tiny", dtype=args.dtype)
    pipe = ppdiffusers.StableDiffusionImg2ImgPipeline(**base.components)  # same weights, img2img pipeline
    pipe.set_progress_bar_config(disable=True)
    init = start_image(args.image, args.resolution)
    os.makedirs(args.output, exist_ok=True)
    init.save(os.path.join(args.output, "start.png"))
    for label in ("vanilla", "tome"):
        if label == "tome":
            pipe.apply_tome(ratio=args.ratio)
        image = pipe(args.prompt, image=init, strength=args.strength, num_inference_steps=args.steps,
                     generator=paddle.Generator().manual_seed(0)).images[0]
        image.save(os.path.join(args.output, f"{label}.png"))
        logger.info("%s -> %s", label, os.path.join(args.output, f"{label}.png"))
    logger.info("ToMe stats: %s", ppdiffusers_tome.tome_stats(pipe))


if __name__ == "__main__":
    main()

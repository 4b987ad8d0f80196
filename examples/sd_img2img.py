"""Image-to-image with ToMe: re-paint a start image with and without token merging.

    python examples/sd_img2img.py                                   # tiny built-in model, random weights
    python examples/sd_img2img.py --model /path/to/stable-diffusion-v1-5 --image photo.png --resolution 512
"""

import argparse
import logging
import os

import ppdiffusers_tome  # noqa: F401  (imported first: it keeps the import-time warnings of Paddle quiet)
import numpy as np
import paddle
from PIL import Image

from ppdiffusers_tome.presets import DTYPES, check_dtype, load_local_pipeline, preset_pipeline
from ppdiffusers_tome.quiet import configure_logging

logger = logging.getLogger("sd_img2img")


def start_image(path, size):
    if path:
        return Image.open(path).convert("RGB").resize((size, size))
    # a soft diagonal gradient with a bright disc, so there is structure to keep
    yy, xx = np.mgrid[0:size, 0:size] / max(size - 1, 1)
    disc = ((xx - 0.6) ** 2 + (yy - 0.4) ** 2 < 0.05).astype(float)
    rgb = np.stack([xx, yy, 1 - xx], axis=-1) * 0.7 + disc[..., None] * 0.3
    return Image.fromarray((rgb * 255).astype("uint8"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local pipeline folder; default: the tiny built-in preset")
    parser.add_argument("--image", help="start image; default: a generated gradient")
    parser.add_argument("--prompt", default="an oil painting of a sunrise over the sea")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--strength", type=float, default=0.7)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "sd_img2img"))
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    args = parser.parse_args(argv)
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

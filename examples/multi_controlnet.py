"""Two ControlNets at once (MultiControlNet) with ToMe: every net gets its own patch, and remove_tome takes
each one off again. Saves the two control images, vanilla.png, tome.png and side_by_side.png.

    python examples/multi_controlnet.py                             # tiny UNet with two tiny ControlNets
"""

import argparse
import logging
import os

import numpy as np
from PIL import Image

logger = logging.getLogger("multi_controlnet")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def conditions(size):
    """A vertical-stripes image and a centred-square image, one per ControlNet."""
    stripes = np.zeros((size, size, 3), dtype="uint8")
    stripes[:, :: max(size // 8, 2)] = 255
    square = np.zeros((size, size, 3), dtype="uint8")
    square[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = 255
    return [Image.fromarray(stripes), Image.fromarray(square)]


def parse_args(argv=None):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--prompt", default="stained glass", help="short: the tiny tokenizer keeps 14 characters")
    parser.add_argument("--resolution", type=int, default=32, help="image height and width in pixels")
    parser.add_argument("--steps", type=int, default=3, help="denoising steps")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe's ratio: the share of tokens merged")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "multi_controlnet"),
                        help="folder for the images")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    return parser, parser.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # imported before Paddle: it keeps Paddle's import-time warnings quiet
    import paddle

    from ppdiffusers_tome.tome.patch import get_patch
    from ppdiffusers_tome.presets import check_dtype
    from ppdiffusers_tome.quiet import configure_logging
    from ppdiffusers_tome.testing import tiny_controlnet_pipeline
    from ppdiffusers_tome.tools.images import side_by_side

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))

    pipe = tiny_controlnet_pipeline(num_controlnets=2)
    if args.dtype != "float32":
        pipe.to(dtype=args.dtype)
    controls = conditions(args.resolution)
    os.makedirs(args.output, exist_ok=True)
    for name, control in zip(("control_stripes", "control_square"), controls):
        control.save(os.path.join(args.output, f"{name}.png"))
    images = {}
    for label in ("vanilla", "tome"):
        if label == "tome":
            pipe.apply_tome(ratio=args.ratio)  # the UNet and each ControlNet, net by net
        images[label] = pipe(args.prompt, image=controls, controlnet_conditioning_scale=[1.0, 0.6],
                             height=args.resolution, width=args.resolution, num_inference_steps=args.steps,
                             generator=paddle.Generator().manual_seed(0)).images[0]
        images[label].save(os.path.join(args.output, f"{label}.png"))
    logger.info("ToMe on each model: %s", ppdiffusers_tome.tome_status(pipe))
    pipe.remove_tome()
    logger.info("after remove_tome, any net still patched: %s", any(get_patch(n) for n in pipe.controlnet.nets))
    side_by_side(controls + [images["vanilla"], images["tome"]],
                 ["stripes", "square", "vanilla", f"ToMe {args.ratio}"]).save(
        os.path.join(args.output, "side_by_side.png"))
    logger.info("saved the control images, vanilla.png, tome.png and side_by_side.png in %s",
                os.path.abspath(args.output))


if __name__ == "__main__":
    main()

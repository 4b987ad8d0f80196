"""SDXL with ToMe. SDXL's first UNet level has no attention; the default max_downsample="auto" finds the 2x level
on its own (tomesd's default of 1 would merge nothing there). Saves vanilla.png, tome.png and side_by_side.png.

    python examples/sdxl.py                                         # tiny SDXL-style model, random weights
    python examples/sdxl.py --model /path/to/stable-diffusion-xl-base-1.0 --resolution 1024 --steps 30
"""

import argparse
import logging
import os

logger = logging.getLogger("sdxl")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def parse_args(argv=None):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help="local SDXL pipeline folder; none: the tiny SDXL-style preset")
    parser.add_argument("--prompt", default="a red panda reading a book, studio light", help="the prompt")
    parser.add_argument("--resolution", type=int, default=64, help="image height and width in pixels")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe's ratio: the share of tokens merged")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "sdxl"),
                        help="folder for the images")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    return parser, parser.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # imported before Paddle: it keeps Paddle's import-time warnings quiet
    import paddle

    from ppdiffusers_tome.presets import check_dtype, load_local_pipeline, preset_pipeline
    from ppdiffusers_tome.quiet import configure_logging
    from ppdiffusers_tome.tools.images import side_by_side

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))

    pipe = load_local_pipeline(args.model, dtype=args.dtype) if args.model else preset_pipeline("tiny-sdxl", dtype=args.dtype)
    os.makedirs(args.output, exist_ok=True)
    images = {}
    for label in ("vanilla", "tome"):
        if label == "tome":
            pipe.apply_tome(ratio=args.ratio)  # max_downsample="auto": the 2x level on SDXL
        images[label] = pipe(args.prompt, height=args.resolution, width=args.resolution,
                             num_inference_steps=args.steps, generator=paddle.Generator().manual_seed(0)).images[0]
        images[label].save(os.path.join(args.output, f"{label}.png"))
    logger.info("ToMe stats: %s", ppdiffusers_tome.tome_stats(pipe))
    pipe.remove_tome()
    side_by_side([images["vanilla"], images["tome"]], ["vanilla", f"ToMe {args.ratio}"]).save(
        os.path.join(args.output, "side_by_side.png"))
    logger.info("saved vanilla.png, tome.png and side_by_side.png in %s", os.path.abspath(args.output))


if __name__ == "__main__":
    main()

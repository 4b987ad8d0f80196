"""Text-to-image with ToMe: generate with and without token merging and save both images.

    python examples/sd_txt2img.py                                  # tiny built-in model, random weights
    python examples/sd_txt2img.py --model /path/to/stable-diffusion-v1-5 --resolution 512 --steps 30

Timings of the tiny default say nothing about speed (its attention is too small for merging to pay).
"""

import argparse
import logging
import os
import time

logger = logging.getLogger("sd_txt2img")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def parse_args(argv=None):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help="local pipeline folder; none: the built-in --preset")
    parser.add_argument("--preset", default="tiny", help="built-in preset (random weights) when --model is not given")
    parser.add_argument("--prompt", default="a watercolor fox in a snowy forest", help="the prompt")
    parser.add_argument("--resolution", type=int, default=64, help="image height and width in pixels")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe's ratio: the share of tokens merged")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "sd_txt2img"),
                        help="folder for the images")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    return parser, parser.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # imported before Paddle: it keeps Paddle's import-time warnings quiet
    import paddle

    from ppdiffusers_tome.presets import TINY_TIMINGS, check_dtype, load_local_pipeline, preset_pipeline
    from ppdiffusers_tome.quiet import configure_logging

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))

    pipe = load_local_pipeline(args.model, dtype=args.dtype) if args.model else preset_pipeline(args.preset, dtype=args.dtype)
    os.makedirs(args.output, exist_ok=True)
    saved = []
    for label, ratio in (("vanilla", None), ("tome", args.ratio)):
        if ratio is None:
            pipe.remove_tome()
        else:
            pipe.apply_tome(ratio=ratio)
        # warm-up: a first call builds kernels, tables and caches that the timed one should not pay for
        pipe(args.prompt, height=args.resolution, width=args.resolution, num_inference_steps=1)
        start = time.perf_counter()
        image = pipe(
            args.prompt,
            height=args.resolution,
            width=args.resolution,
            num_inference_steps=args.steps,
            generator=paddle.Generator().manual_seed(args.seed),
        ).images[0]
        path = os.path.join(args.output, f"{label}.png")
        image.save(path)
        saved.append(path)
        logger.info("%s: %.2f s -> %s", label if ratio is None else f"ToMe ratio={ratio}", time.perf_counter() - start, path)
    logger.info("ToMe stats: %s", ppdiffusers_tome.tome_stats(pipe))
    if not args.model and args.preset.startswith("tiny"):
        logger.info("%s", TINY_TIMINGS)
    pipe.remove_tome()
    return saved


if __name__ == "__main__":
    main()

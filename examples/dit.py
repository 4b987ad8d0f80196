"""ToMe (or ToDo) on a transformer-only pipeline: DiT. The token grid is the patch grid (latent size / patch size),
and every block runs at that resolution, so every block merges. Saves vanilla_<label>.png and
<method>_<label>.png for every class label (same seed).

    python examples/dit.py                                       # tiny DiT-style model, random weights
    python examples/dit.py --model /path/to/DiT-XL-2-256 --steps 25 --labels 207 360
    python examples/dit.py --method todo
"""

import argparse
import logging
import os

logger = logging.getLogger("dit")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def parse_args(argv=None):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help="local DiT pipeline folder; none: a tiny DiT-style pipeline")
    parser.add_argument("--labels", type=int, nargs="+", default=[207, 360], help="ImageNet class ids")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe's ratio: the share of tokens merged")
    parser.add_argument("--method", choices=["tome", "todo"], default="tome",
                        help="tome: merge tokens; todo: downsample keys and values")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "dit"),
                        help="folder for the images")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    return parser, parser.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # imported before Paddle: it keeps Paddle's import-time warnings quiet
    import paddle

    from ppdiffusers_tome.presets import check_dtype, load_local_pipeline
    from ppdiffusers_tome.quiet import configure_logging
    from ppdiffusers_tome.testing import tiny_dit_pipeline

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))

    pipe = load_local_pipeline(args.model, dtype=args.dtype) if args.model else tiny_dit_pipeline()
    if not args.model and args.dtype != "float32":
        pipe.to(dtype=args.dtype)
    os.makedirs(args.output, exist_ok=True)
    for run in ("vanilla", args.method):
        if run != "vanilla":
            pipe.apply_tome(ratio=args.ratio, method=args.method)
        images = pipe(class_labels=args.labels, num_inference_steps=args.steps,
                      generator=paddle.Generator().manual_seed(0)).images
        for label, image in zip(args.labels, images):
            image.save(os.path.join(args.output, f"{run}_{label}.png"))
    logger.info("%s stats: %s", args.method, ppdiffusers_tome.tome_stats(pipe))
    pipe.remove_tome()
    logger.info("saved vanilla_*.png and %s_*.png in %s", args.method, os.path.abspath(args.output))


if __name__ == "__main__":
    main()

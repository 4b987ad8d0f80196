"""Benchmark a pipeline with and without ToMe from Python (the same engine as ``ppdiffusers-tome bench``).

    python examples/benchmark.py                                    # tiny preset, a few seconds
    python examples/benchmark.py --preset sd15-narrow --resolution 512 --ratios 0.3 0.5
    python examples/benchmark.py --model /path/to/stable-diffusion-v1-5 --resolution 768

Timings of the tiny default say nothing about speed (its attention is too small for merging to pay).
"""

import argparse
import logging
import os

logger = logging.getLogger("benchmark")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def parse_args(argv=None):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help="local pipeline folder; none: --preset")
    parser.add_argument("--preset", "--arch", dest="preset", default="tiny",
                        help="built-in model layout with random weights, e.g. tiny, sd15-narrow, sd15, sdxl-narrow "
                             "(the list: python -m ppdiffusers_tome bench --help; --arch: the same option)")
    parser.add_argument("--resolution", type=int, default=32, help="image height and width in pixels")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5], help="ToMe's ratios to time")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per configuration")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "benchmark"),
                        help="folder for the plots")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    return parser, parser.parse_args(argv)


def main(argv=None):
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # noqa: F401  (imported before Paddle: it keeps Paddle's import-time warnings quiet)

    from ppdiffusers_tome.presets import (TINY_TIMINGS, available_presets, check_dtype, load_local_pipeline,
                                          preset_pipeline)
    from ppdiffusers_tome.quiet import configure_logging
    from ppdiffusers_tome.tools import bench

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    if not args.model and args.preset not in available_presets():
        parser.error(f"--preset must be one of {', '.join(available_presets())}; got {args.preset!r}")
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))

    pipe = load_local_pipeline(args.model, dtype=args.dtype) if args.model else preset_pipeline(args.preset, dtype=args.dtype)
    settings = bench.BenchSettings(resolutions=[args.resolution], ratios=args.ratios, steps=args.steps,
                                   repeats=args.repeats, methods=("vanilla", "tome", "bound"))
    cells = bench.run_grid(pipe, settings)
    methods = bench.method_list(settings)
    logger.info("%s\n\n%s", bench.format_grid_table(cells, methods), bench.format_details(cells))
    if not args.model and args.preset.startswith("tiny"):
        logger.info("%s", TINY_TIMINGS)
    os.makedirs(args.output, exist_ok=True)
    for path in bench.write_plots(cells, {}, args.output):
        logger.info("plot: %s", path)


if __name__ == "__main__":
    main()

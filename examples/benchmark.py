"""Benchmark a pipeline with and without ToMe from Python (the same engine as ``ppdiffusers-tome bench``).

    python examples/benchmark.py                                    # tiny preset, a few seconds
    python examples/benchmark.py --preset sd15-narrow --resolution 512 --ratios 0.3 0.5
    python examples/benchmark.py --model /path/to/stable-diffusion-v1-5 --resolution 768
"""

import argparse
import logging
import os

from ppdiffusers_tome.tools import bench
from ppdiffusers_tome.presets import DTYPES, available_presets, check_dtype, load_local_pipeline, preset_pipeline
from ppdiffusers_tome.quiet import configure_logging

logger = logging.getLogger("benchmark")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local pipeline folder; default: --preset")
    parser.add_argument("--preset", "--arch", dest="preset", default="tiny", choices=available_presets(),
                        help="built-in model layout with random weights (--arch is an alias)")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "benchmark"))
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    args = parser.parse_args(argv)
    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
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
    os.makedirs(args.output, exist_ok=True)
    for path in bench.write_plots(cells, {}, args.output):
        logger.info("plot: %s", path)


if __name__ == "__main__":
    main()

"""Generate many prompts across several devices: every rank holds a pipeline with ToMe, takes its share of the
prompts (rank r takes prompts r, r + world, ...), and rank 0 gathers and saves all images.

    # 4 GPUs
    python examples/distributed_generate.py --nproc 4 --model /path/to/stable-diffusion-v1-5
    # 2 CPU processes (Paddle's gloo backend, chosen when Paddle has no CUDA)
    python examples/distributed_generate.py --nproc 2
    # one process
    python examples/distributed_generate.py

--nproc N starts Paddle's launcher (python -m paddle.distributed.launch --nproc_per_node N) on this script, quietly:
its own INFO lines off, its log folder a temporary one (removed afterwards; the workers' logs are printed if a rank
fails), so nothing is left in the working directory. Rank 0's lines appear as it runs. Calling the launcher yourself
works too; it then writes its logs to ./log unless given --log_dir.
"""

import argparse
import logging
import os
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image

logger = logging.getLogger("distributed_generate")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle

PROMPTS = [
    "a lighthouse in a storm",
    "a bowl of ramen, top view",
    "a fox in the snow",
    "a futuristic tram at night",
    "a watercolor of plum blossoms",
    "an astronaut tending a garden",
]


def under_launcher() -> bool:
    """Whether Paddle's launcher started this process (it sets the trainer variables for every rank)."""
    return "PADDLE_TRAINER_ID" in os.environ or "PADDLE_TRAINERS_NUM" in os.environ


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def launch(nproc, argv):
    """Run this script on ``nproc`` processes with Paddle's launcher; returns its exit status."""
    import paddle

    env = dict(os.environ)
    if not paddle.is_compiled_with_cuda():
        env.setdefault("PADDLE_DISTRI_BACKEND", "gloo")  # CPU processes talk over gloo
    env.setdefault("GLOG_minloglevel", "2")  # Paddle's C++ INFO lines (the rendezvous store) off
    with tempfile.TemporaryDirectory(prefix="distributed_generate-") as logs:
        quiet = ["-W", "ignore:No ccache found:UserWarning",
                 "-W", "ignore:Setuptools is replacing distutils:UserWarning"]
        command = [sys.executable, *quiet, "-m", "paddle.distributed.launch", "--log_level", "WARNING", "--log_dir",
                   logs, "--nproc_per_node", str(nproc), os.path.abspath(__file__), *argv]
        status = subprocess.run(command, env=env).returncode
        if status:
            for name in sorted(os.listdir(logs)):
                if name.startswith("workerlog"):
                    with open(os.path.join(logs, name), encoding="utf-8", errors="replace") as log:
                        logger.error("%s:\n%s", name, "".join(log.readlines()[-40:]))
    return status


def parse_args(argv):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    # no abbreviations: "--np 2" must not pass for --nproc, or it would survive the stripping below and relaunch
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    parser.add_argument("--nproc", type=int, default=None,
                        help="start this many processes with Paddle's launcher (GPUs, or CPU processes over gloo); "
                             "none: this process alone, or the ranks of a launcher that started it")
    parser.add_argument("--model", help="local pipeline folder; none: the tiny built-in preset")
    parser.add_argument("--prompts", nargs="+", default=PROMPTS, help="the prompts, one image each")
    parser.add_argument("--resolution", type=int, default=32, help="image height and width in pixels")
    parser.add_argument("--steps", type=int, default=3, help="denoising steps")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe's ratio: the share of tokens merged")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "distributed_generate"),
                        help="folder for the images")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="float16/bfloat16 need a GPU build of Paddle")
    return parser, parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # noqa: F401  (imported before Paddle: it keeps Paddle's import-time warnings quiet)
    import paddle
    import paddle.distributed as dist

    from ppdiffusers_tome.presets import check_dtype, load_local_pipeline, preset_pipeline
    from ppdiffusers_tome.quiet import configure_logging

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))
    if args.nproc is not None and under_launcher():
        logger.warning("--nproc %d ignored: this process was started by Paddle's launcher", args.nproc)
    elif args.nproc is not None:
        if args.nproc < 1:
            parser.error(f"--nproc must be >= 1, got {args.nproc}")
        rest = [a for i, a in enumerate(argv) if a != "--nproc" and not a.startswith("--nproc=")
                and not (i > 0 and argv[i - 1] == "--nproc")]
        sys.exit(launch(args.nproc, rest))

    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    pipe = load_local_pipeline(args.model, dtype=args.dtype) if args.model else preset_pipeline("tiny", dtype=args.dtype)
    pipe.apply_tome(ratio=args.ratio)

    mine = []
    for index in range(rank, len(args.prompts), world):
        image = pipe(args.prompts[index], height=args.resolution, width=args.resolution,
                     num_inference_steps=args.steps, generator=paddle.Generator().manual_seed(index)).images[0]
        mine.append((index, np.asarray(image)))
    logger.info("rank %d/%d generated %d image(s)", rank, world, len(mine))

    if world > 1:
        gathered = []
        dist.all_gather_object(gathered, mine)
        results = [item for part in gathered for item in part]
        counts = [len(part) for part in gathered]
    else:
        results, counts = mine, [len(mine)]
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        for index, pixels in sorted(results, key=lambda item: item[0]):
            Image.fromarray(pixels).save(os.path.join(args.output, f"{index:03d}.png"))
        logger.info("rank 0 saved %d images to %s (images per rank: %s)", len(results), args.output,
                    ", ".join(map(str, counts)))
    return results


if __name__ == "__main__":
    main()

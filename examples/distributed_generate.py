"""Generate many prompts across several devices: every rank holds a pipeline with ToMe, takes its share of the
prompts (rank r takes prompts r, r + world, ...), and rank 0 gathers and saves all images.

    # 4 GPUs
    python -m paddle.distributed.launch --gpus 0,1,2,3 examples/distributed_generate.py --model /path/to/sd-v1-5
    # 2 CPU processes (Paddle's gloo backend)
    PADDLE_DISTRI_BACKEND=gloo python -m paddle.distributed.launch --nproc_per_node 2 examples/distributed_generate.py
    # one process
    python examples/distributed_generate.py
"""

import argparse
import logging
import os

import numpy as np
import paddle
import paddle.distributed as dist
from PIL import Image

from ppdiffusers_tome.presets import load_local_pipeline, preset_pipeline

logger = logging.getLogger("distributed_generate")

PROMPTS = [
    "a lighthouse in a storm",
    "a bowl of ramen, top view",
    "a fox in the snow",
    "a futuristic tram at night",
    "a watercolor of plum blossoms",
    "an astronaut tending a garden",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local pipeline folder; default: the tiny built-in preset")
    parser.add_argument("--prompts", nargs="+", default=PROMPTS)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "distributed_generate"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    pipe = load_local_pipeline(args.model) if args.model else preset_pipeline("tiny")
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
    else:
        results = mine
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        for index, pixels in sorted(results, key=lambda item: item[0]):
            Image.fromarray(pixels).save(os.path.join(args.output, f"{index:03d}.png"))
        logger.info("rank 0 saved %d images to %s", len(results), args.output)
    return results


if __name__ == "__main__":
    main()

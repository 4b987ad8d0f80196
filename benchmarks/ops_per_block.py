"""Eager operators added per merging block, for every configuration that README's "On GPU" section lists.

On a GPU in eager mode every operator is a kernel launch of roughly 5-17 us of host time, about what merging saves
per block at 512 px, so this count (not CPU seconds) is what decides whether merging can pay there. Counted with
``paddle.profiler`` (see :func:`ppdiffusers_tome.tools.measure.count_forward_ops`) on the tiny SD-layout UNet, batch 2,
32 x 32 latent (1024 tokens at the merging level, three merging blocks), for our GPU branch (forced on the CPU with
``force_kernels``) and CPU branch, and for ppdiffusers' built-in port. Counts do not depend on the latent
size. Prints a table and writes JSON; takes about a minute.

    bash run.sh python benchmarks/ops_per_block.py --output outputs/ops_per_block.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import paddle

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppdiffusers_tome  # noqa: E402
from ppdiffusers_tome.ops.runtime import force_kernels  # noqa: E402
from ppdiffusers_tome.tools.measure import count_forward_ops, ops_added_per_block  # noqa: E402
from ppdiffusers_tome.testing import tiny_unet  # noqa: E402

CONFIGS = [
    ("defaults", {}),
    ("use_rand=False", dict(use_rand=False)),
    ("share_plan='level'", dict(share_plan="level")),
    ("deterministic=True", dict(deterministic=True)),
    ("deterministic=True, share_plan='level'", dict(deterministic=True, share_plan="level")),
    ("match_window=16", dict(match_window=16)),
    ("match_window=16, share_plan='level'", dict(match_window=16, share_plan="level")),
    ("match_window=16, match_order='feature'", dict(match_window=16, match_order="feature")),
    ("match_window=16, match_order='feature', share_plan='level'",
     dict(match_window=16, match_order="feature", share_plan="level")),
    ("method='todo'", dict(method="todo")),
]


def forward(unet, batch=2, latent=32):
    rng = np.random.default_rng(0)
    sample = paddle.to_tensor(rng.standard_normal((batch, 4, latent, latent)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((batch, 7, unet.config.cross_attention_dim)).astype("float32"))
    timestep = paddle.full([batch], 500, dtype="int64")

    def run():
        with paddle.no_grad():
            return unet(sample, timestep, context).sample

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=os.path.join("outputs", "ops_per_block.json"))
    args = parser.parse_args(argv)
    unet = tiny_unet()
    run = forward(unet)
    vanilla = count_forward_ops(run, unet).total
    rows = []
    for kind in ("gpu", "cpu"):
        with force_kernels(kind):
            for name, options in CONFIGS:
                ppdiffusers_tome.apply_tome(unet, ratio=0.5, **options)
                counted = count_forward_ops(run, unet)
                ppdiffusers_tome.remove_tome(unet)
                per_block = ops_added_per_block(vanilla, counted.total, counted.merging_blocks)
                rows.append({"kernels": kind, "config": name, "ops_per_block": round(per_block, 1),
                             "merging_blocks": counted.merging_blocks})
    # ppdiffusers' port is the ``apply_tome`` it attaches to every ``paddle.nn.Layer`` (this package's own methods
    # sit on the model classes)
    paddle.nn.Layer.apply_tome(unet, ratio=0.5, max_downsample=1)
    counted = count_forward_ops(run, unet)
    ppdiffusers_tome.api.remove_builtin_tome(unet)
    rows.append({"kernels": "-", "config": "ppdiffusers' built-in port", "merging_blocks": 3,
                 "ops_per_block": round(ops_added_per_block(vanilla, counted.total, 3), 1)})
    width = max(len(row["config"]) for row in rows)
    print(f"eager ops added per merging block (tiny UNet, batch 2, 1024 tokens, ratio 0.5; vanilla {vanilla} ops)")
    print(f"{'kernels':>7} | {'configuration':<{width}} | ops/block")
    for row in rows:
        print(f"{row['kernels']:>7} | {row['config']:<{width}} | {row['ops_per_block']:9.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"version": ppdiffusers_tome.__version__, "vanilla_ops": vanilla, "rows": rows}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

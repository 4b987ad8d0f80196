"""Eager operators that ToMe adds, per merging block and per SD-1.5 UNet call, for every configuration docs/gpu.md lists.

On a GPU in eager mode every operator is a kernel launch of roughly 25 us of host time, about what merging saves
per block at 512 px, so this count (not CPU seconds) is what decides whether merging can pay there. Counted with
``paddle.profiler`` (see :func:`ppdiffusers_tome.tools.measure.count_forward_ops`), with the GPU kernels forced on the
CPU (``ppdiffusers_tome.testing.gpu_kernels``) and with the CPU's own kernels:

* per block: the tiny SD-layout UNet, batch 2, 32 x 32 latent (1024 tokens at the merging level, three merging
  blocks), and ppdiffusers' built-in port for comparison;
* per call: the full SD-1.5 block layout with narrow channels (preset ``sd15-narrow``), batch 2 (one image with
  guidance), 512 px (4096 tokens at the finest level, five merging blocks), GPU kernels only; the policy's default
  (skipped at this size) and every configuration made to merge with ``min_work=0``.

Counts do not depend on the latent size or the channels. Prints two tables and writes JSON; takes a few minutes.

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
from ppdiffusers_tome.tools.presets import preset_pipeline  # noqa: E402

# every configuration but the first merges wherever it is eligible (min_work=0 or policy="tomesd"), so that its cost
# per merging block is counted; "defaults" is what apply_tome(ratio=0.5) does at these sizes
CONFIGS = [
    ("defaults", {}),
    ("defaults, min_work=0 (K/V pooling on GPU kernels)", dict(min_work=0)),
    ("policy='tomesd'", dict(policy="tomesd")),
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
PER_CALL = ["defaults", "defaults, min_work=0 (K/V pooling on GPU kernels)", "policy='tomesd'", "share_plan='level'",
            "match_window=16, share_plan='level'", "match_window=16, match_order='feature'",
            "match_window=16, match_order='feature', share_plan='level'", "method='todo'"]


def options_of(name):
    options = dict(dict(CONFIGS)[name])
    if name != "defaults" and "policy" not in options:
        options.setdefault("min_work", 0)
    return options


def forward(unet, batch=2, latent=32):
    rng = np.random.default_rng(0)
    sample = paddle.to_tensor(rng.standard_normal((batch, 4, latent, latent)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((batch, 7, unet.config.cross_attention_dim)).astype("float32"))
    timestep = paddle.full([batch], 500, dtype="int64")

    def run():
        with paddle.no_grad():
            return unet(sample, timestep, context).sample

    return run


def count_rows(unet, run, names, kinds):
    """Added operators of each configuration in ``names`` on each kernel family of ``kinds``."""
    vanilla = count_forward_ops(run, unet).total
    rows = []
    for kind in kinds:
        with force_kernels(kind):
            for name in names:
                ppdiffusers_tome.apply_tome(unet, ratio=0.5, **options_of(name))
                counted = count_forward_ops(run, unet)
                stats = ppdiffusers_tome.tome_stats(unet)[type(unet).__name__]
                ppdiffusers_tome.remove_tome(unet)
                blocks = counted.merging_blocks
                added = counted.total - vanilla
                rows.append({"kernels": kind, "config": name, "ops_per_call": added, "merging_blocks": blocks,
                             "ops_per_block": round(ops_added_per_block(vanilla, counted.total, blocks), 1)
                             if blocks else None,
                             "blocks_skipped": stats["blocks_skipped"], "blocks_pooled": stats["blocks_pooled"]})
    return vanilla, rows


def print_rows(title, rows, column):
    width = max(len(row["config"]) for row in rows)
    print(title)
    print(f"{'kernels':>7} | {'configuration':<{width}} | {column:>12} | merging blocks")
    for row in rows:
        value = row[column]
        shown = "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)
        print(f"{row['kernels']:>7} | {row['config']:<{width}} | {shown:>12} | {row['merging_blocks']}")
    print()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=os.path.join("outputs", "ops_per_block.json"))
    args = parser.parse_args(argv)
    unet = tiny_unet()
    run = forward(unet)
    vanilla, rows = count_rows(unet, run, [name for name, _ in CONFIGS], ("gpu", "cpu"))
    # ppdiffusers' port is the ``apply_tome`` it attaches to every ``paddle.nn.Layer`` (this package's own methods
    # sit on the model classes)
    paddle.nn.Layer.apply_tome(unet, ratio=0.5, max_downsample=1)
    counted = count_forward_ops(run, unet)
    ppdiffusers_tome.api.remove_builtin_tome(unet)
    rows.append({"kernels": "-", "config": "ppdiffusers' built-in port", "merging_blocks": 3,
                 "ops_per_call": counted.total - vanilla,
                 "ops_per_block": round(ops_added_per_block(vanilla, counted.total, 3), 1)})
    print_rows(f"eager ops added per merging block (tiny UNet, batch 2, 1024 tokens, ratio 0.5; vanilla {vanilla} ops)",
               rows, "ops_per_block")

    sd15 = preset_pipeline("sd15-narrow").unet
    sd15_vanilla, per_call = count_rows(sd15, forward(sd15, batch=2, latent=64), PER_CALL, ("gpu",))
    print_rows(f"eager ops added per SD-1.5 UNet call (sd15-narrow, batch 2, 512 px, 4096 tokens at the finest level, "
               f"ratio 0.5, GPU kernels; vanilla {sd15_vanilla} ops)", per_call, "ops_per_call")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"version": ppdiffusers_tome.__version__, "command": "bash run.sh python benchmarks/ops_per_block.py",
                   "vanilla_ops": vanilla, "rows": rows, "sd15_vanilla_ops": sd15_vanilla, "sd15_per_call": per_call},
                  f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

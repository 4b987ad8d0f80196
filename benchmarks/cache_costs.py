"""What the step cache asks of a GPU, on paper: FLOPs and eager operators of a full and a cached UNet call.

No GPU runs here, so this counts instead of timing. One SD-1.5 UNet call (preset ``sd15``: the real layout and
widths, random weights; UNet batch 2, one image with guidance) at ``--resolution``, float32 on the CPU:

* FLOPs, from forward pre-hooks on every ``Conv2D`` and ``Linear`` (2 x multiply-adds of the actual input shapes)
  and every ``Attention`` (the two attention matmuls, ``2 x 2 x B x N x M x inner_dim``, on the tokens the layer
  really receives, so ToMe's merged tokens count as fewer);
* eager operators, counted with ``paddle.profiler`` (each is a kernel launch on a GPU, about 25 us of host time in
  eager mode).

For each configuration, a full call and a cached call are counted, and the cost of ``interval`` steps
(one full + ``interval - 1`` cached) is compared with vanilla's. These are estimates of a GPU's work, not timings.

    bash run.sh python benchmarks/cache_costs.py --resolution 256 --output outputs/cache_costs.json
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
from ppdiffusers_tome.tools.measure import count_forward_ops  # noqa: E402
from ppdiffusers_tome.tools.presets import preset_pipeline  # noqa: E402

CONFIGS = {
    "vanilla": (None, None),
    "ToMe 0.5": ({"ratio": 0.5}, None),
    "cache 3": (None, 3),
    "ToMe 0.5 + cache 3": ({"ratio": 0.5}, 3),
}


class FlopCounter:
    """Forward pre-hooks that add up the FLOPs of convolutions, linear layers and attention matmuls. An attention's
    two matmuls are counted when its ``to_k`` runs, from the query tokens ``to_q`` saw and the keys ``to_k`` sees
    (a pre-hook sees only positional arguments, and the blocks pass the text states by keyword)."""

    def __init__(self, model: paddle.nn.Layer):
        from ppdiffusers.models.attention_processor import Attention

        self.flops = 0
        self.handles = []
        self.queries = {}
        for _, layer in model.named_sublayers():
            if isinstance(layer, paddle.nn.Conv2D):
                self.handles.append(layer.register_forward_pre_hook(self._conv))
            elif isinstance(layer, paddle.nn.Linear):
                self.handles.append(layer.register_forward_pre_hook(self._linear))
            if isinstance(layer, Attention):
                self.handles.append(layer.to_q.register_forward_pre_hook(
                    lambda lin, inputs, key=id(layer): self.queries.__setitem__(key, inputs[0].shape)))
                self.handles.append(layer.to_k.register_forward_pre_hook(
                    lambda lin, inputs, key=id(layer), inner=layer.to_q.weight.shape[1]: self._attention(key, inner, inputs)))

    def _conv(self, layer, inputs):
        batch, _, height, width = inputs[0].shape
        stride = layer._stride if isinstance(layer._stride, (list, tuple)) else [layer._stride] * 2
        out_h, out_w = -(-height // stride[0]), -(-width // stride[1])
        self.flops += 2 * batch * out_h * out_w * int(np.prod(layer.weight.shape))  # weight [out, in / groups, kh, kw]

    def _linear(self, layer, inputs):
        self.flops += 2 * int(np.prod(inputs[0].shape[:-1])) * int(np.prod(layer.weight.shape))

    def _attention(self, key, inner, inputs):
        batch, tokens = self.queries[key][0], self.queries[key][1]
        self.flops += 2 * 2 * batch * tokens * inputs[0].shape[1] * inner

    def remove(self):
        for handle in self.handles:
            handle.remove()


def measure(unet, inputs, tome, interval):
    """(full call, cached call) as dicts of flops and ops for one configuration."""
    ppdiffusers_tome.remove_tome(unet)
    ppdiffusers_tome.remove_cache(unet)
    if tome is not None:
        ppdiffusers_tome.apply_tome(unet, **tome)
    if interval is not None:
        ppdiffusers_tome.apply_cache(unet, interval=interval)

    def run():
        with paddle.no_grad():
            return unet(*inputs)

    run()  # warm: tables and constants are built once, outside the counts
    if interval:
        run()
        ppdiffusers_tome.reset_cache(unet)
    calls = []
    for _ in range(2 if interval else 1):  # step 0 (full), step 1 (cached)
        calls.append({"ops": count_forward_ops(run, unet, warmup=0).total})
    if interval:  # FLOPs from a second pass over the same steps (no profiler hooks in the way)
        ppdiffusers_tome.reset_cache(unet)
    for call in calls:
        counter = FlopCounter(unet)
        run()
        counter.remove()
        call["flops"] = counter.flops
    ppdiffusers_tome.remove_tome(unet)
    ppdiffusers_tome.remove_cache(unet)
    return calls[0], calls[-1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sd15", help="model layout (random weights)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--interval", type=int, default=3, help="steps per full call in the comparison")
    parser.add_argument("--output", default=os.path.join("outputs", "cache_costs.json"))
    args = parser.parse_args(argv)
    unet = preset_pipeline(args.preset).unet
    side = args.resolution // 8
    rng = np.random.default_rng(0)
    inputs = (paddle.to_tensor(rng.standard_normal((2, 4, side, side)).astype("float32")),
              paddle.to_tensor([500, 500], dtype="int64"),
              paddle.to_tensor(rng.standard_normal((2, 77, unet.config.cross_attention_dim)).astype("float32")))
    rows = []
    for name, (tome, interval) in CONFIGS.items():
        full, cached = measure(unet, inputs, tome, interval)
        print(f"{name}: full {full}, cached {cached}", flush=True)
        steps = args.interval
        if interval is None:
            flops, ops = steps * full["flops"], steps * full["ops"]
        else:
            flops = full["flops"] + (steps - 1) * cached["flops"]
            ops = full["ops"] + (steps - 1) * cached["ops"]
        rows.append({"config": name, "full": full, "cached": cached, "flops_per_steps": flops, "ops_per_steps": ops})
    base = rows[0]
    print(f"SD-1.5 UNet, batch 2, {args.resolution}px: FLOPs and eager ops per {args.interval} steps (estimate)")
    print(f"{'configuration':<20} | {'GFLOP full':>10} | {'GFLOP cached':>12} | {'FLOP ratio':>10} | "
          f"{'ops full':>8} | {'ops cached':>10} | {'launch ratio':>12}")
    for row in rows:
        row["flop_speedup"] = base["flops_per_steps"] / row["flops_per_steps"]
        row["launch_speedup"] = base["ops_per_steps"] / row["ops_per_steps"]
        cached = row["cached"] if row["cached"] is not row["full"] else None
        print(f"{row['config']:<20} | {row['full']['flops'] / 1e9:>10.2f} | "
              f"{(cached['flops'] / 1e9 if cached else float('nan')):>12.2f} | {row['flop_speedup']:>9.2f}x | "
              f"{row['full']['ops']:>8} | {(cached['ops'] if cached else 0):>10} | {row['launch_speedup']:>11.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"version": ppdiffusers_tome.__version__, "command": "bash run.sh python benchmarks/cache_costs.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]), "resolution": args.resolution,
                   "interval": args.interval, "rows": rows}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""What the step cache asks of a GPU, on paper: FLOPs and eager operators of a full and a cached UNet call.

No GPU runs here, so this counts instead of timing. One UNet call of ``--preset`` (``sd15``: SD-1.5's real layout
and widths; ``sdxl``: SDXL's, with its added text and size conditioning; random weights, the UNet alone; batch 2,
one image with guidance) at ``--resolutions``, float32 on the CPU:

* FLOPs, from forward pre-hooks on every ``Conv2D`` and ``Linear`` (2 x multiply-adds of the actual input shapes)
  and every ``Attention`` (the two attention matmuls, ``2 x 2 x B x N x M x inner_dim``, on the tokens the layer
  really receives, so ToMe's merged tokens count as fewer);
* eager operators, counted with ``paddle.profiler`` (each is a kernel launch on a GPU, about 25 us of host time in
  eager mode).

For each configuration, a full call and a cached call are counted, and the cost of ``interval`` steps
(one full + ``interval - 1`` cached) is compared with vanilla's. FLOPs are counted at ``--resolutions`` and computed
for ``--extrapolate`` sizes from the first three (a constant part, a part that grows as the latent side squared and
self-attention, which grows as its fourth power). These are estimates of a GPU's work, not timings.

    bash run.sh python benchmarks/cache_costs.py --preset sd15 --resolutions 64 128 256 --extrapolate 512 1024 \
        --output outputs/cache_costs_sd15.json
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
from ppdiffusers_tome.tools.presets import load_preset  # noqa: E402

CONFIGS = {  # name -> (apply_tome options, apply_cache options)
    "vanilla": (None, None),
    "ToMe 0.5": ({"ratio": 0.5}, None),
    "cache 3, whole level": (None, {"interval": 3, "layers": None}),  # DeepCache's branch 2 (0.13.0's default)
    "cache 3, layers 2": (None, {"interval": 3, "layers": 2}),
    "cache 3, layers 1": (None, {"interval": 3, "layers": 1}),  # the default since 0.14.0 (layers="auto")
    "ToMe 0.5 + cache 3, whole level": ({"ratio": 0.5}, {"interval": 3, "layers": None}),
    "ToMe 0.5 + cache 3, layers 1": ({"ratio": 0.5}, {"interval": 3, "layers": 1}),
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


def measure(unet, inputs, tome, cache, count_ops=True):
    """(full call, cached call) as dicts of flops and ops for one configuration."""
    ppdiffusers_tome.remove_tome(unet)
    ppdiffusers_tome.remove_cache(unet)
    if tome is not None:
        ppdiffusers_tome.apply_tome(unet, **tome)
    interval = None if cache is None else cache["interval"]
    if cache is not None:
        ppdiffusers_tome.apply_cache(unet, **cache)

    args, kwargs = inputs

    def run():
        with paddle.no_grad():
            return unet(*args, **kwargs)

    run()  # warm: tables and constants are built once, outside the counts
    if interval:
        run()
        ppdiffusers_tome.reset_cache(unet)
    calls = []
    for _ in range(2 if interval else 1):  # step 0 (full), step 1 (cached)
        calls.append({"ops": count_forward_ops(run, unet, warmup=0).total} if count_ops else {})
        if not count_ops:
            run()
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


def preset_unet(name):
    """The UNet of preset ``name`` alone (random weights, seeded): SDXL's text encoders are not needed to count."""
    from ppdiffusers import UNet2DConditionModel

    paddle.seed(0)
    return UNet2DConditionModel.from_config(load_preset(name)["unet"])


def inputs_at(unet, resolution):
    """Positional inputs of one UNet call at ``resolution`` px (batch 2), and SDXL's added conditioning as a
    keyword when the UNet's config asks for it."""
    side = resolution // 8
    rng = np.random.default_rng(0)
    config = unet.config

    def normal(*shape):
        return paddle.to_tensor(rng.standard_normal(shape).astype("float32"))

    args = (normal(2, config.in_channels, side, side), paddle.to_tensor([500, 500], dtype="int64"),
            normal(2, 77, config.cross_attention_dim))
    if config.addition_embed_type != "text_time":
        return args, {}
    # SDXL: pooled text embeddings and six size numbers, each embedded with addition_time_embed_dim channels
    text_dim = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    time_ids = paddle.to_tensor([[resolution, resolution, 0, 0, resolution, resolution]] * 2, dtype="float32")
    return args, {"added_cond_kwargs": {"text_embeds": normal(2, text_dim), "time_ids": time_ids}}


def extrapolate(flops_by_side, side):
    """FLOPs at latent ``side`` from counts at three smaller sides. A UNet call's FLOPs are ``a + b * side**2 +
    c * side**4``: the text and time embeddings and the cross-attention keys and values of the text do not grow with
    the image, convolutions, linear layers on image tokens and cross-attention grow as ``side**2``, self-attention as
    its fourth power; three counts give the three terms exactly (up to the rounding of merged-token counts)."""
    sides = sorted(flops_by_side)[:3]
    if len(sides) < 3:
        raise ValueError(f"extrapolating needs counts at three sizes; got {sides}")
    squares = np.array([float(s) ** 2 for s in sides])
    coefficients = np.linalg.solve(np.vander(squares, 3, increasing=True), [float(flops_by_side[s]) for s in sides])
    return float(coefficients @ np.array([1.0, side**2, side**4]))


def per_steps(full, cached, interval, steps):
    """Cost of ``steps`` steps: all full without a cache, else one full and ``steps - 1`` cached."""
    return steps * full if interval is None else full + (steps - 1) * cached


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sd15", help="model layout (random weights)")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[64, 128, 256],
                        help="sizes counted (FLOPs at every size, eager ops at the first)")
    parser.add_argument("--extrapolate", type=int, nargs="*", default=[512, 1024],
                        help="sizes whose FLOPs are computed from the first three counted sizes")
    parser.add_argument("--interval", type=int, default=3, help="steps per full call in the comparison")
    parser.add_argument("--output", default=os.path.join("outputs", "cache_costs.json"))
    args = parser.parse_args(argv)
    unet = preset_unet(args.preset)
    rows, skipped = [], {}
    for name, (tome, cache) in CONFIGS.items():
        interval = None if cache is None else cache["interval"]
        row = {"config": name, "tome": tome, "cache": cache, "sizes": {}}
        if cache is not None:
            try:
                ppdiffusers_tome.apply_cache(unet, **cache)  # a layout may have fewer layers than a branch asks
            except ValueError as error:
                print(f"{name}: skipped, {error}", flush=True)
                skipped[name] = str(error)
                continue
            ppdiffusers_tome.remove_cache(unet)
        for i, resolution in enumerate(args.resolutions):
            full, cached = measure(unet, inputs_at(unet, resolution), tome, cache, count_ops=i == 0)
            if i == 0:
                row["ops_full"], row["ops_cached"] = full["ops"], cached["ops"]
            row["sizes"][resolution] = {"flops_full": full["flops"], "flops_cached": cached["flops"], "counted": True}
            print(f"{name} at {resolution}px: full {full}, cached {cached}", flush=True)
        for resolution in args.extrapolate:
            sides = {r // 8: row["sizes"][r] for r in args.resolutions}
            row["sizes"][resolution] = {
                kind: extrapolate({side: v[kind] for side, v in sides.items()}, resolution // 8)
                for kind in ("flops_full", "flops_cached")}
            row["sizes"][resolution]["counted"] = False
        row["ops_per_steps"] = per_steps(row["ops_full"], row["ops_cached"], interval, args.interval)
        for size in row["sizes"].values():
            size["flops_per_steps"] = per_steps(size["flops_full"], size["flops_cached"], interval, args.interval)
        rows.append(row)
    base = rows[0]
    sizes = list(args.resolutions) + list(args.extrapolate)
    print(f"{args.preset} UNet, batch 2: FLOP and launch ratios to vanilla over {args.interval} steps (on paper)")
    print("| configuration | eager ops full / cached | launch ratio | " + " | ".join(
        f"FLOP ratio {s}²{'' if s in args.resolutions else ' (extrapolated)'}" for s in sizes) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in sizes) + " |")
    for row in rows:
        row["launch_speedup"] = base["ops_per_steps"] / row["ops_per_steps"]
        for s in sizes:
            row["sizes"][s]["flop_speedup"] = base["sizes"][s]["flops_per_steps"] / row["sizes"][s]["flops_per_steps"]
        print(f"| {row['config']} | {row['ops_full']} / {row['ops_cached']} | {row['launch_speedup']:.2f}× | "
              + " | ".join(f"{row['sizes'][s]['flop_speedup']:.2f}×" for s in sizes) + " |")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"version": ppdiffusers_tome.__version__, "command": "bash run.sh python benchmarks/cache_costs.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]), "preset": args.preset,
                   "interval": args.interval, "rows": rows, "skipped": skipped}, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

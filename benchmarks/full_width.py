"""Merging at full width on the CPU, where the narrow presets' tables cannot speak for it: attention is a much larger
share of a narrow layout's work than of the real model's, so a narrow speed-up overstates what a full-width model
gains. Two parts time it, configuration by configuration, and a third counts on paper:

* ``--part sd3-block``: one joint block of SD3-medium's layout at full width (``--width 1536``: 24 heads of 64, MLP
  4x) on ``(--resolution / 16)**2`` image tokens (4,096 at 1024 px) and 333 text tokens, batch 2 (one image with
  guidance), random seeded weights, the math attention processor: vanilla, ToMe 0.5 on the attention, ToMe 0.5 on
  attention and MLP, ToDo (factor 2). The block is an inner one (its text stream goes on), called inside a call of
  its transformer (``ModelPatch.in_call``), as in ``sd3_forward.block_op_rows``. FLOP ceiling:
  :func:`sd3_forward.flop_ceiling` (per layer: image and text q/k/v/o and MLP, joint attention).
* ``--part sdxl-unet``: SDXL's whole UNet (``--preset sdxl``: SDXL-base's layout and widths, random seeded weights,
  with its added text and size conditioning) at ``--resolution`` (1024 px), batch 2: vanilla, ToMe 0.5 (the
  defaults: SDXL's 2x level, its finest with attention), ToDo (factor 2). FLOP ceiling: vanilla's FLOPs over the
  configuration's, counted in the first call of each (:class:`cache_costs.FlopCounter`: convolutions, linear layers
  and attention matmuls on the tokens each layer receives).
* ``--part ceilings`` times nothing: it prints the FLOP ceilings at full width of the settings whose CPU figures come
  from narrow layouts (sd15-narrow, sdxl-narrow, SD3-medium's layout at width 384): ToMe 0.5 per forward and, with
  the step cache (interval 3, its default ``layers=1`` on a UNet, ``depth=1`` on SD3), per 20-step loop, from the
  full-width FLOP counts committed in docs/measurements (``SD15_COUNTS``, ``SDXL_COUNTS``: benchmarks/cache_costs.py)
  and, for SD3-medium, :func:`sd3_forward.flop_ceiling` (the loop: a cached step runs the first and last of its 24
  blocks; the blocks' FLOPs only).

float32. Every round runs each configuration once, in an order rotated by one per round; the first ``--warmup``
rounds are not timed. The first call of each configuration (timed only with ``--warmup 0``) gives its output, whose
relative L2 distance to vanilla's is reported (the image stream's output for the block, the noise prediction for the
UNet), the memory it adds at its peak (:class:`PeakMemory`: the resident set on a CPU, sampled every 10 ms) and, for
the UNet, its FLOPs. Per configuration: the median seconds per call, the median and range of the per-round
speed-ups, the FLOP ceiling, the distance and the peak. Prints a table and writes JSON:

    bash run.sh python benchmarks/full_width.py --part sd3-block --threads 2 --output outputs/full_width_sd3_block.json
    bash run.sh python benchmarks/full_width.py --part sdxl-unet --warmup 0 --rounds 2 --threads 2 \\
        --output outputs/full_width_sdxl_unet.json
    bash run.sh python benchmarks/full_width.py --part ceilings

A block call of SD3 at full width is about 0.7 TFLOP and its math attention holds 2 x 24 x 4,429^2 floats (3.5 GiB)
twice around the softmax; SDXL's UNet is about 13.5 TFLOP per call at 1024 px with 2.6 B parameters (10 GiB in
float32). Run them on a machine with nothing else running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import ppdiffusers_tome  # noqa: E402  (imported before Paddle: it keeps Paddle's import-time warnings quiet)
import numpy as np  # noqa: E402
import paddle  # noqa: E402

import cache_costs  # noqa: E402  (benchmarks/cache_costs.py: SDXL's UNet, its inputs, the FLOP counter)
import sd3_forward  # noqa: E402  (benchmarks/sd3_forward.py: SD3's layout, the FLOP ceiling of a joint layer)
from ppdiffusers_tome.tome.patch import get_patch  # noqa: E402
from ppdiffusers_tome.tools.measure import PeakMemory, relative_l2, set_threads  # noqa: E402

PARTS = ("sd3-block", "sdxl-unet", "ceilings")
SCRIPT = "benchmarks/full_width.py"
MEASUREMENTS = os.path.join(os.path.dirname(HERE), "docs", "measurements")
# full-width FLOP counts of benchmarks/cache_costs.py (batch 2; counted at 64-256 px, 512 and 1024 px extrapolated)
SD15_COUNTS = "v0120_cache_costs_sd15.json"  # preset sd15: SD-1.5's layout and widths
SDXL_COUNTS = "v0130_cache_costs_sdxl.json"  # preset sdxl: SDXL-base's
SD3_MEDIUM = dict(width=1536, layers=24)
SD3_CONFIGS: Dict[str, Optional[Dict[str, Any]]] = {
    "vanilla": None,
    "ToMe 0.5, attention": dict(ratio=0.5),
    "ToMe 0.5, attention + MLP": dict(ratio=0.5, merge_mlp=True),
    "ToDo, factor 2": dict(method="todo"),
}
SDXL_CONFIGS: Dict[str, Optional[Dict[str, Any]]] = {
    "vanilla": None,
    "ToMe 0.5": dict(ratio=0.5),
    "ToDo, factor 2": dict(method="todo"),
}


class Subject:
    """What one part times: :meth:`apply` puts a configuration on (``None``: vanilla), :meth:`run` makes one call
    and returns the output compared with vanilla's; :meth:`counting` wraps the first call of a configuration and
    gives its FLOPs (``None`` where they are not counted); :meth:`ceiling` is a configuration's FLOP ceiling, from
    the FLOPs counted (``flops``, by name) or on paper."""

    def apply(self, options: Optional[Dict[str, Any]]) -> None:
        raise NotImplementedError

    def run(self) -> np.ndarray:
        raise NotImplementedError

    @contextlib.contextmanager
    def counting(self):
        yield lambda: None

    def ceiling(self, name: str, options: Optional[Dict[str, Any]], flops: Dict[str, Optional[int]]) -> float:
        raise NotImplementedError


class JointBlock(Subject):
    """An inner joint block of SD3-medium's layout at ``width``, its inputs at ``resolution`` px (batch 2, random,
    seeded): a transformer of two layers is built, and its first block is the one called."""

    def __init__(self, width: int, resolution: int, seed: int = 0):
        self.model = sd3_forward.narrow_sd3(2, width, seed)  # (narrow_sd3 builds SD3-medium's layout at any width)
        self.layer = self.model.transformer_blocks[0]
        self.width = width
        self.side = resolution // 16  # the patch grid: the VAE's 8x, then 2 x 2 patches
        rng = np.random.default_rng(seed)
        self.hidden, self.text, self.temb = (
            paddle.to_tensor(rng.standard_normal(shape).astype("float32"))
            for shape in ((2, self.side**2, width), (2, sd3_forward.TEXT_TOKENS, width), (2, width)))
        self.sample = paddle.zeros([2, self.model.config.in_channels, 2 * self.side, 2 * self.side])
        self.timestep = paddle.to_tensor([500.0, 500.0])

    def apply(self, options):
        ppdiffusers_tome.remove_tome(self.model)
        if options is not None:
            ppdiffusers_tome.apply_tome(self.model, **options)

    def run(self):
        patch = get_patch(self.model)
        with paddle.no_grad(), patch.in_call(self.sample, self.timestep) if patch else contextlib.nullcontext():
            _, image = self.layer(self.hidden, self.text, self.temb)
        return image.numpy()

    def ceiling(self, name, options, flops):
        if options is None:
            return 1.0
        factor = options.get("downsample_factor", 2) if options.get("method") == "todo" else 1
        return sd3_forward.flop_ceiling(self.side**2, self.width, options.get("ratio", 0.0),
                                        options.get("merge_mlp", False), factor=factor)


class WholeUNet(Subject):
    """The UNet of preset ``preset`` (random weights, seeded) and its inputs at ``resolution`` px, batch 2."""

    def __init__(self, preset: str, resolution: int):
        self.unet = cache_costs.preset_unet(preset)
        self.unet.eval()
        self.args, self.kwargs = cache_costs.inputs_at(self.unet, resolution)

    def apply(self, options):
        ppdiffusers_tome.remove_tome(self.unet)
        if options is not None:
            ppdiffusers_tome.apply_tome(self.unet, **options)

    def run(self):
        with paddle.no_grad():
            return self.unet(*self.args, **self.kwargs).sample.numpy()

    @contextlib.contextmanager
    def counting(self):
        counter = cache_costs.FlopCounter(self.unet)
        try:
            yield lambda: counter.flops
        finally:
            counter.remove()

    def ceiling(self, name, options, flops):
        return flops["vanilla"] / flops[name]


def measure(subject: Subject, configs: Dict[str, Optional[Dict[str, Any]]], rounds: int,
            warmup: int = 1) -> List[Dict[str, Any]]:
    """Every configuration of ``configs`` (the first is vanilla, which the others are compared with) for ``warmup``
    untimed and ``rounds`` timed rounds, each round in an order rotated by one; returns a row per configuration."""
    names = list(configs)
    seconds: Dict[str, List[float]] = {name: [] for name in names}
    outputs: Dict[str, np.ndarray] = {}
    peaks: Dict[str, PeakMemory] = {}
    flops: Dict[str, Optional[int]] = {}
    for round_ in range(warmup + rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            subject.apply(configs[name])
            first = name not in outputs
            with contextlib.ExitStack() as stack:
                if first:  # the output, the peak and the FLOPs of the configuration's first call
                    peaks[name] = stack.enter_context(PeakMemory())
                    counted = stack.enter_context(subject.counting())
                began = time.perf_counter()
                output = subject.run()
                took = time.perf_counter() - began
            if first:
                outputs[name], flops[name] = output, counted()
            if round_ >= warmup:
                seconds[name].append(took)
            timed = "timed" if round_ >= warmup else "untimed"
            print(f"round {round_} ({timed}) {name:>28}: {took:.2f} s", flush=True)
    subject.apply(None)
    rows = []
    for name in names:
        speedups = [v / s for v, s in zip(seconds[names[0]], seconds[name])]
        rows.append({
            "configuration": name, "options": configs[name], "seconds": statistics.median(seconds[name]),
            "seconds_per_round": seconds[name], "speedup": statistics.median(speedups),
            "speedup_range": [min(speedups), max(speedups)],
            "flop_ceiling": subject.ceiling(name, configs[name], flops), "flops": flops[name],
            "rel_l2": relative_l2(outputs[names[0]], outputs[name]),
            "peak_added_mib": peaks[name].added_bytes / 2**20, "peak_kind": peaks[name].kind,
        })
    return rows


def loop_flops(full: float, cached: float, steps: int, interval: Optional[int]) -> float:
    """The FLOPs of ``steps`` denoising steps: every call ``full`` without a step cache (``interval`` None); with one,
    a full call at steps 0, ``interval``, 2 ``interval``, ... and a ``cached`` one at the others.

    >>> loop_flops(10, 1, 20, 3), loop_flops(10, 1, 20, None)
    (83, 200)
    """
    if interval is None:
        return steps * full
    fulls = -(-steps // interval)
    return fulls * full + (steps - fulls) * cached


def ceilings(steps: int = 20, interval: int = 3) -> List[Dict[str, Any]]:
    """The FLOP ceilings at full width of ToMe 0.5 (per forward) and of the step cache alone and with ToMe 0.5 (per
    ``steps``-step loop, a full call every ``interval``), by model and size: vanilla's FLOPs over the setting's."""
    rows = []

    def add(model, size, setting, ceiling, source):
        rows.append({"model": model, "size": size, "setting": setting, "flop_ceiling": ceiling, "source": source})

    # (the narrow figures: SD-1.5's per forward and per loop at 256 and 512 px, SDXL's per forward at 1024 px)
    for model, name, sizes, loops in (("SD-1.5 (preset sd15)", SD15_COUNTS, ("256", "512"), True),
                                      ("SDXL (preset sdxl)", SDXL_COUNTS, ("1024",), False)):
        with open(os.path.join(MEASUREMENTS, name), encoding="utf-8") as f:
            counts = {row["config"]: row["sizes"] for row in json.load(f)["rows"]}
        for size in sizes:
            vanilla = counts["vanilla"][size]["flops_full"]
            add(model, int(size), "ToMe 0.5, one UNet forward", vanilla / counts["ToMe 0.5"][size]["flops_full"], name)
            for setting, config in (("cache 3", "cache 3, layers 1"),
                                    ("ToMe 0.5 + cache 3", "ToMe 0.5 + cache 3, layers 1")) if loops else ():
                cost = loop_flops(counts[config][size]["flops_full"], counts[config][size]["flops_cached"], steps,
                                  interval)
                add(model, int(size), f"{setting}, {steps}-step loop", loop_flops(vanilla, vanilla, steps, None) / cost,
                    name)
    width, layers = SD3_MEDIUM["width"], SD3_MEDIUM["layers"]
    cache = loop_flops(layers, 2, steps, None) / loop_flops(layers, 2, steps, interval)  # cached: 2 of the blocks
    for size in (512, 1024):
        tokens = (size // 16) ** 2
        attention, mlp = (sd3_forward.flop_ceiling(tokens, width, 0.5, merge) for merge in (False, True))
        todo = sd3_forward.flop_ceiling(tokens, width, 0.0, False, factor=2)
        source = "sd3_forward.flop_ceiling"
        for setting, ceiling in (("ToMe 0.5, attention, one forward", attention),
                                 ("ToMe 0.5, attention + MLP, one forward", mlp), ("ToDo, one forward", todo)):
            add("SD3-medium (width 1536)", size, setting, ceiling, source)
        if size == 512:
            for setting, ceiling in (("cache 3", cache), ("ToMe 0.5, attention, + cache 3", cache * attention),
                                     ("ToMe 0.5, attention + MLP, + cache 3", cache * mlp)):
                add("SD3-medium (width 1536)", size, f"{setting}, {steps}-step loop", ceiling, source)
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| configuration | s / call (median) | speed-up (median, range) | FLOP ceiling | rel. L2 to vanilla | "
             "peak added, MiB |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        low, high = row["speedup_range"]
        lines.append(f"| {row['configuration']} | {row['seconds']:.2f} | {row['speedup']:.2f}× "
                     f"({low:.2f}–{high:.2f}) | {row['flop_ceiling']:.2f}× | {row['rel_l2']:.4f} | "
                     f"{row['peak_added_mib']:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, required=True, help="what to time (see above)")
    parser.add_argument("--resolution", type=int, default=1024, help="image size in pixels (a multiple of 16)")
    parser.add_argument("--width", type=int, default=1536,
                        help="sd3-block: the model width (a multiple of 64; SD3-medium: 1536)")
    parser.add_argument("--preset", default="sdxl", help="sdxl-unet: the UNet's preset (random weights)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds before them (0: the first round's calls also give the distances, the "
                             "peaks and the FLOPs)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--output", help="JSON file to write")
    args = parser.parse_args(argv)
    if args.resolution < 16 or args.resolution % 16:
        parser.error(f"--resolution must be a positive multiple of 16; got {args.resolution}")
    if args.width < 64 or args.width % 64:
        parser.error(f"--width must be a positive multiple of 64 (heads of 64); got {args.width}")
    if args.rounds < 1 or args.warmup < 0:
        parser.error(f"--rounds must be >= 1 and --warmup >= 0; got {args.rounds} and {args.warmup}")
    if args.part == "ceilings":
        rows = ceilings()
        print("| model | size | setting | FLOP ceiling at full width | counts |\n| --- | --- | --- | --- | --- |")
        for row in rows:
            print(f"| {row['model']} | {row['size']}² | {row['setting']} | {row['flop_ceiling']:.2f}× | "
                  f"{row['source']} |")
        return sd3_forward.write({"version": ppdiffusers_tome.__version__, "part": args.part, "rows": rows}, argv,
                                 args.output, SCRIPT)
    threads = set_threads(args.threads)
    if args.part == "sd3-block":
        subject, configs = JointBlock(args.width, args.resolution), SD3_CONFIGS
        layout = {"width": args.width, "heads": args.width // 64, "image_tokens": (args.resolution // 16) ** 2,
                  "text_tokens": sd3_forward.TEXT_TOKENS}
    else:
        subject, configs = WholeUNet(args.preset, args.resolution), SDXL_CONFIGS
        layout = {"preset": args.preset}
    rows = measure(subject, configs, args.rounds, args.warmup)
    print(f"{args.part} at {args.resolution}x{args.resolution} px, batch 2, float32, {threads} threads, "
          f"{args.rounds} timed rounds after {args.warmup} untimed ({ppdiffusers_tome.__version__})")
    print(table(rows))
    return sd3_forward.write({"version": ppdiffusers_tome.__version__, "paddle": paddle.__version__,
                              "date": time.strftime("%Y-%m-%d"), "part": args.part, "resolution": args.resolution,
                              "batch": 2, "threads": threads, "rounds": args.rounds, "warmup": args.warmup, **layout,
                              "rows": rows}, argv, args.output, SCRIPT)


if __name__ == "__main__":
    main()

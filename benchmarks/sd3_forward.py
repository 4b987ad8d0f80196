"""Token merging on SD3's MMDiT, on the CPU: one transformer forward per configuration, side by side, and the FLOP
ceiling of each.

The model is SD3-medium's layout with a narrow width (``--width 384``: 6 heads of 64, MLP 4x, patch 2, 16 latent
channels, 333 text tokens: SD3's 77 + 256) and random seeded weights; a forward's speed-up does not depend on the
number of layers, so ``--layers`` may be fewer than SD3-medium's 24. Batch 2 (one image with guidance). Every round
runs each configuration once (after one untimed forward each), in a rotated order; per configuration: the median
seconds and the range of the per-round speed-ups, the relative L2 distance of the output to vanilla's for each input
seed (mean and spread), the FLOP ceiling (image q/k/v/o and MLP, text q/k/v/o and MLP, joint attention; AdaLN
and embeddings left out) and the memory a forward adds at its peak (``PeakMemory`` around the last untimed forward:
the resident set on a CPU, sampled every 10 ms; Paddle's allocated bytes on a GPU). With ``--loop-steps N`` it also
times a whole N-step denoising loop per configuration (:data:`LOOP_CONFIGS`) over ``--seeds`` seeds, with the memory
each loop adds at its peak (``--loop-only``: no forward table). With ``--ops-per-block`` it times nothing: it counts
the eager operators of one ``JointTransformerBlock`` call (:func:`block_op_rows`) per configuration of
:data:`OPS_CONFIGS`, with the GPU kernels forced and with the CPU's. Prints tables and writes JSON:

    bash run.sh python benchmarks/sd3_forward.py --sizes 512 1024 --layers 4 --output outputs/sd3_forward.json
    bash run.sh python benchmarks/sd3_forward.py --sizes 512 --layers 24 --seeds 2 --loop-steps 20 --loop-only \
        --output outputs/sd3_loop.json
    bash run.sh python benchmarks/sd3_forward.py --ops-per-block --sizes 512 1024 \
        --output outputs/sd3_ops_per_block.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import numpy as np
import paddle
from ppdiffusers import DiffusionPipeline

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppdiffusers_tome  # noqa: E402
from ppdiffusers_tome.sd3_attention import use_math_attention  # noqa: E402
from ppdiffusers_tome.ops.runtime import force_kernels  # noqa: E402
from ppdiffusers_tome.tome.patch import get_patch  # noqa: E402
from ppdiffusers_tome.tools.measure import PeakMemory, count_ops, relative_l2, set_threads  # noqa: E402

TEXT_TOKENS = 333
CONFIGS: Dict[str, Dict[str, Any] | None] = {
    "vanilla": None,
    "ToMe 0.3, attention": dict(ratio=0.3),
    "ToMe 0.5, attention": dict(ratio=0.5),
    "ToMe 0.3, attention + MLP": dict(ratio=0.3, merge_mlp=True),
    "ToMe 0.5, attention + MLP": dict(ratio=0.5, merge_mlp=True),
    "ToDo, factor 2": dict(method="todo"),
}
# the configurations whose operators --ops-per-block counts; all but the first merge wherever they can (min_work=0:
# on GPU kernels the default policy skips SD3 blocks below JOINT_MIN_WORK, which costs no operator at all). The ToMe
# rows name share_plan: with its default ("auto") the GPU kernels share one plan per call between SD3's blocks, and
# the plain settings would get the policy's downsampling of the image keys and values instead of ToMe's plan.
OPS_CONFIGS: Dict[str, Dict[str, Any] | None] = {
    "vanilla": None,
    "ToMe 0.5, attention": dict(ratio=0.5, share_plan="block", min_work=0),
    "ToMe 0.5, attention + MLP": dict(ratio=0.5, merge_mlp=True, share_plan="block", min_work=0),
    "ToMe 0.5, attention, one plan per call": dict(ratio=0.5, share_plan="level", min_work=0),
    "ToMe 0.5, attention + MLP, one plan per call": dict(ratio=0.5, merge_mlp=True, share_plan="level", min_work=0),
    "ToDo, factor 2": dict(method="todo", min_work=0),
}


def flop_ceiling(image_tokens: int, width: int, ratio: float, mlp: bool, text: int = TEXT_TOKENS,
                 factor: int = 1) -> float:
    """Vanilla's FLOPs over the merged forward's, per layer (so for any number of layers): q/k/v/o are 4 width**2
    multiply-adds per token, the MLP 8 width**2, the joint attention 2 (tokens**2) width; merging ``ratio`` of the
    image tokens shrinks the image stream's q/k/v/o and the attention (and the image MLP with ``mlp``). ToDo
    (``factor`` > 1, ``ratio`` 0) keeps every query and projects the image keys and values from the
    ``ceil(side / factor)**2`` tokens of a square patch grid: it shrinks the image k/v projections and the keys.

    >>> round(flop_ceiling(4096, 1536, 0.5, False), 2), round(flop_ceiling(4096, 1536, 0.5, True), 2)
    (1.5, 2.19)
    >>> round(flop_ceiling(4096, 384, 0.0, False, factor=2), 2)
    1.98
    """
    def cost(image: int, image_kv: int, image_mlp: int) -> float:
        return (2 * (image + text) + 2 * (image_kv + text)) * width**2 + 8 * (image_mlp + text) * width**2 \
            + 2 * (image + text) * (image_kv + text) * width

    merged = image_tokens - int(image_tokens * ratio)
    side = math.isqrt(image_tokens)
    kv = (-(-side // factor)) ** 2 if factor > 1 else merged
    return cost(image_tokens, image_tokens, image_tokens) / cost(merged, kv, merged if mlp else image_tokens)


def narrow_sd3(layers: int, width: int, seed: int = 0):
    from ppdiffusers import SD3Transformer2DModel

    paddle.seed(seed)
    model = SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=layers,
        attention_head_dim=64, num_attention_heads=width // 64, joint_attention_dim=4096,
        caption_projection_dim=width, pooled_projection_dim=2048, pos_embed_max_size=192,
    )
    model.eval()
    for param in model.parameters():  # adaptive norms start at zero in ppdiffusers: draw every gate non-zero
        if float(param.abs().max()) == 0.0:
            param.set_value(paddle.randn(param.shape, dtype=param.dtype) * 0.02)
    return use_math_attention(model)


def inputs(size: int, seed: int) -> Dict[str, paddle.Tensor]:
    rng = np.random.default_rng(seed)
    side = size // 8
    return dict(
        hidden_states=paddle.to_tensor(rng.standard_normal((2, 16, side, side)).astype("float32")),
        encoder_hidden_states=paddle.to_tensor(rng.standard_normal((2, TEXT_TOKENS, 4096)).astype("float32")),
        pooled_projections=paddle.to_tensor(rng.standard_normal((2, 2048)).astype("float32")),
        timestep=paddle.to_tensor([500.0, 500.0]),
    )


def forward(model: Any, kwargs: Dict[str, paddle.Tensor]) -> np.ndarray:
    with paddle.no_grad():
        return model(**kwargs, return_dict=False)[0].numpy()


def measure(size: int, model: Any, rounds: int, seeds: int) -> List[Dict[str, Any]]:
    names = list(CONFIGS)
    outputs: Dict[str, List[np.ndarray]] = {name: [] for name in names}
    seconds: Dict[str, List[float]] = {name: [] for name in names}
    peaks: Dict[str, PeakMemory] = {}
    for name in names:  # the outputs of every input seed (untimed); the last one's peak memory
        ppdiffusers_tome.remove_tome(model)
        if CONFIGS[name] is not None:
            ppdiffusers_tome.apply_tome(model, **CONFIGS[name])
        for seed in range(seeds):
            kwargs = inputs(size, seed)
            with PeakMemory() as memory:
                outputs[name].append(forward(model, kwargs))
            peaks[name] = memory
    timed = inputs(size, 0)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            ppdiffusers_tome.remove_tome(model)
            if CONFIGS[name] is not None:
                ppdiffusers_tome.apply_tome(model, **CONFIGS[name])
            began = time.perf_counter()
            forward(model, timed)
            seconds[name].append(time.perf_counter() - began)
            print(f"{size} px round {round_} {name:>28}: {seconds[name][-1]:.2f} s", flush=True)
    ppdiffusers_tome.remove_tome(model)
    image_tokens = (size // 16) ** 2
    rows = []
    for name in names:
        speedups = [v / s for v, s in zip(seconds["vanilla"], seconds[name])]
        distances = [relative_l2(v, o) for v, o in zip(outputs["vanilla"], outputs[name])]
        options = CONFIGS[name] or {}
        rows.append({
            "configuration": name, "size": size, "image_tokens": image_tokens,
            "seconds": statistics.median(seconds[name]), "speedup": statistics.median(speedups),
            "speedup_range": [min(speedups), max(speedups)],
            "rel_l2": float(np.mean(distances)), "rel_l2_sd": float(np.std(distances)),
            "peak_added_mib": peaks[name].added_bytes / 2**20, "peak_kind": peaks[name].kind,
            "flop_ceiling": flop_ceiling(image_tokens, WIDTH, options.get("ratio", 0.0), options.get("merge_mlp", False),
                                         factor=options.get("downsample_factor", 2) if options.get("method") == "todo"
                                         else 1) if options else 1.0,
        })
    return rows


def block_op_rows(model: Any, size: int, kinds=("gpu", "cpu"), configs=None, block: int = 0,
                  text_tokens: int = TEXT_TOKENS, batch: int = 2) -> List[Dict[str, Any]]:
    """Eager operators of one call of ``model.transformer_blocks[block]`` per configuration of ``configs`` (default
    :data:`OPS_CONFIGS`) on each kernel family of ``kinds``, at ``size`` px (``(size // 16)**2`` image tokens), batch
    ``batch``, ``text_tokens`` text tokens of the model's width. Each block call runs inside a model call
    (``patch.in_call``); ``ops`` counts a block call after another block of the same call has run (what every block
    pays; the call's random partition table already exists), ``first_block_ops`` the first block call of a call (with
    that table drawn). Counted with ``paddle.profiler`` (:func:`~ppdiffusers_tome.tools.measure.count_ops`) after one
    uncounted call; ``added`` is ``ops`` minus vanilla's."""
    configs = OPS_CONFIGS if configs is None else configs
    layer = model.transformer_blocks[block]
    width = model.config.caption_projection_dim
    rng = np.random.default_rng(0)
    side = size // 16
    hidden, text, temb = (paddle.to_tensor(rng.standard_normal(shape).astype("float32"))
                          for shape in ((batch, side * side, width), (batch, text_tokens, width), (batch, width)))
    sample = paddle.zeros([batch, model.config.in_channels, side * 2, side * 2])
    timestep = paddle.to_tensor([500.0] * batch)

    def block_call():
        with paddle.no_grad():
            return layer(hidden, text, temb)

    rows: List[Dict[str, Any]] = []
    for kind in kinds:
        vanilla = None
        with force_kernels(kind):
            for name, options in configs.items():
                ppdiffusers_tome.remove_tome(model)
                if options is None:
                    block_call()
                    first = steady = count_ops(block_call)
                else:
                    patch = get_patch(ppdiffusers_tome.apply_tome(model, **options))
                    with patch.in_call(sample, timestep):
                        block_call()
                    with patch.in_call(sample, timestep):
                        first = count_ops(block_call)
                        steady = count_ops(block_call)
                    stats = ppdiffusers_tome.tome_stats(model)[type(model).__name__]
                vanilla = steady.total if options is None else vanilla
                rows.append({"kernels": kind, "configuration": name, "size": size, "image_tokens": side * side,
                             "text_tokens": text_tokens, "width": width, "batch": batch, "ops": steady.total,
                             "added": steady.total - vanilla, "first_block_ops": first.total,
                             "merges_per_call": None if options is None else stats["merges"] // 3,  # 3 block calls
                             "by_name": dict(sorted(steady.by_name.items()))})
    ppdiffusers_tome.remove_tome(model)
    return rows


def print_op_rows(rows: List[Dict[str, Any]]) -> None:
    print("| kernels | size | configuration | ops per block call | added to vanilla | first block of a call |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['kernels'].upper()} | {row['size']}² ({row['image_tokens']} image tokens) | "
              f"{row['configuration']} | {row['ops']} | {row['added']:+d} | {row['first_block_ops']} |")


WIDTH = 384
LOOP_CONFIGS: Dict[str, Dict[str, Any]] = {
    "vanilla": {},
    "ToMe 0.3, attention": dict(tome=dict(ratio=0.3)),
    "ToMe 0.5, attention": dict(tome=dict(ratio=0.5)),
    "ToMe 0.3, attention + MLP": dict(tome=dict(ratio=0.3, merge_mlp=True)),
    "ToMe 0.5, attention + MLP": dict(tome=dict(ratio=0.5, merge_mlp=True)),
    "ToDo, factor 2": dict(tome=dict(method="todo")),
    "cache 3": dict(cache=dict(interval=3)),
    "ToMe 0.5, attention, + cache 3": dict(tome=dict(ratio=0.5), cache=dict(interval=3)),
    "ToMe 0.5, attention + MLP, + cache 3": dict(tome=dict(ratio=0.5, merge_mlp=True), cache=dict(interval=3)),
}


class _Loop(DiffusionPipeline):
    """The loop's pipeline object, for its progress bar: as in a pipeline, it tells a step cache the loop's last step
    and its scheduler's step sizes."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__()
        self.register_modules(scheduler=scheduler)
        self.set_progress_bar_config(disable=True)


def denoise(model: Any, size: int, steps: int, seed: int) -> np.ndarray:
    """A flow-matching Euler loop of ``steps`` steps (SD3's sampler, shift 3) on the transformer alone, batch 2 (one
    image with guidance, scale 7): the final latents. No text encoder, no VAE: the transformer is what is timed."""
    from ppdiffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(steps)
    kwargs = inputs(size, seed)
    latents = kwargs.pop("hidden_states")[:1]
    ppdiffusers_tome.reset_cache(model)
    with paddle.no_grad():
        for t in _Loop(scheduler).progress_bar(scheduler.timesteps):
            velocity = model(hidden_states=paddle.concat([latents, latents]), timestep=t.expand([2]),
                             return_dict=False, **{k: v for k, v in kwargs.items() if k != "timestep"})[0]
            uncond, cond = velocity.chunk(2)
            latents = scheduler.step(uncond + 7.0 * (cond - uncond), t, latents, return_dict=False)[0]
    return latents.numpy()


def measure_loop(size: int, model: Any, steps: int, seeds: int) -> List[Dict[str, Any]]:
    """Every configuration of :data:`LOOP_CONFIGS` for ``seeds`` seeds, side by side (rotated order per seed); the
    memory a loop adds at its peak (the largest over the seeds; the step cache's stored outputs included), sampled
    every 50 ms around every timed loop alike."""
    names = list(LOOP_CONFIGS)
    seconds: Dict[str, List[float]] = {name: [] for name in names}
    finals: Dict[str, List[np.ndarray]] = {name: [] for name in names}
    peaks: Dict[str, List[PeakMemory]] = {name: [] for name in names}
    for seed in range(seeds):
        shift = seed % len(names)
        for name in names[shift:] + names[:shift]:
            ppdiffusers_tome.remove_tome(model)
            ppdiffusers_tome.remove_cache(model)
            config = LOOP_CONFIGS[name]
            if "tome" in config:
                ppdiffusers_tome.apply_tome(model, **config["tome"])
            if "cache" in config:
                ppdiffusers_tome.apply_cache(model, **config["cache"])
            with PeakMemory(interval=0.05) as memory:
                began = time.perf_counter()
                finals[name].append(denoise(model, size, steps, seed))
                seconds[name].append(time.perf_counter() - began)
            peaks[name].append(memory)
            print(f"{size} px {steps} steps seed {seed} {name:>28}: {seconds[name][-1]:.2f} s", flush=True)
    ppdiffusers_tome.remove_tome(model)
    ppdiffusers_tome.remove_cache(model)
    rows = []
    for name in names:
        speedups = [v / s for v, s in zip(seconds["vanilla"], seconds[name])]
        distances = [relative_l2(v, f) for v, f in zip(finals["vanilla"], finals[name])]
        rows.append({"configuration": name, "size": size, "steps": steps, "seconds": statistics.median(seconds[name]),
                     "speedup": statistics.median(speedups), "speedup_range": [min(speedups), max(speedups)],
                     "rel_l2": float(np.mean(distances)), "rel_l2_sd": float(np.std(distances)),
                     "rel_l2_per_seed": [float(d) for d in distances],
                     "peak_added_mib": max(peak.added_bytes for peak in peaks[name]) / 2**20,
                     "peak_kind": peaks[name][0].kind})
    return rows


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    global WIDTH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3, help="input seeds for the distance to vanilla")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--loop-steps", type=int, default=0,
                        help="also time a denoising loop of this many steps per configuration at the first size")
    parser.add_argument("--loop-only", action="store_true", help="time only the loop of --loop-steps, no forward table")
    parser.add_argument("--ops-per-block", action="store_true",
                        help="count the eager operators of one block call per configuration instead of timing")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if args.loop_only and not args.loop_steps:  # before any model is built
        parser.error("--loop-only needs --loop-steps N (N >= 1)")
    WIDTH = args.width
    threads = set_threads(args.threads)
    if args.ops_per_block:
        model = narrow_sd3(2, args.width)  # an inner block (counted) and the last one
        rows = [row for size in args.sizes for row in block_op_rows(model, size)]
        print_op_rows(rows)
        return write({"version": ppdiffusers_tome.__version__, "paddle": paddle.__version__, "width": args.width,
                      "heads": args.width // 64, "text_tokens": TEXT_TOKENS, "batch": 2, "rows": rows}, argv,
                     args.output)
    model = narrow_sd3(args.layers, args.width)
    sizes = [] if args.loop_only else args.sizes
    rows = [row for size in sizes for row in measure(size, model, args.rounds, args.seeds)]
    if rows:
        print("| size | configuration | s / forward | speed-up (range) | FLOP ceiling | rel. L2 to vanilla (sd) | "
              "peak added, MiB |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        low, high = row["speedup_range"]
        print(f"| {row['size']}² | {row['configuration']} | {row['seconds']:.2f} | {row['speedup']:.2f}× "
              f"({low:.2f}–{high:.2f}) | {row['flop_ceiling']:.2f}× | {row['rel_l2']:.4f} ({row['rel_l2_sd']:.4f}) | "
              f"{row['peak_added_mib']:.0f} |")
    loop = measure_loop(args.sizes[0], model, args.loop_steps, args.seeds) if args.loop_steps else []
    if loop:
        print(f"| size | configuration ({args.loop_steps}-step loop) | s / image | speed-up (range) | "
              "rel. L2 of the final latents (sd) | peak added, MiB |")
        print("| --- | --- | --- | --- | --- | --- |")
        for row in loop:
            low, high = row["speedup_range"]
            print(f"| {row['size']}² | {row['configuration']} | {row['seconds']:.2f} | {row['speedup']:.2f}× "
                  f"({low:.2f}–{high:.2f}) | {row['rel_l2']:.4f} ({row['rel_l2_sd']:.4f}) | "
                  f"{row['peak_added_mib']:.0f} |")
    return write({"version": ppdiffusers_tome.__version__, "loop": loop, "paddle": paddle.__version__,
                  "threads": threads, "layers": args.layers, "width": args.width, "text_tokens": TEXT_TOKENS,
                  "batch": 2, "rows": rows}, argv, args.output)


def write(result: Dict[str, Any], argv: List[str] | None, output: str | None,
          script: str = "benchmarks/sd3_forward.py") -> Dict[str, Any]:
    """``result`` with the command that made it (``script`` and its arguments), written as JSON to ``output`` (when
    given)."""
    result["command"] = script + " " + " ".join(argv if argv is not None else sys.argv[1:])
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()

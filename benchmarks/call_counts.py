"""Python function calls per UNet call: what each technique adds to the host's work, counted, not timed.

In eager mode on a GPU the host runs every Python function of a forward; at small sizes that host time is what a
UNet call costs. This counts, with ``sys.setprofile`` (a counter of ``call`` events, deterministic), the Python
function calls of one UNet call in SD-1.5's block layout (16 transformer blocks, 5 at the finest level) with tiny
channels, batch 2:

* ``package``: calls of functions of ``ppdiffusers_tome`` itself;
* ``added``: every Python call (any module) above vanilla's count for the same input.

Configurations: ToMe with every block skipped (the GPU policy at 512 px with one image, GPU kernels forced), ToMe's
defaults on CPU kernels (5 blocks merge), the step cache at interval 1 and at interval 3 (a full and a cached call),
its adaptive rule (a call the rule caches, and one it runs in full: each pays the rule's signal and its one read),
the rule with the forecast (a cached call, and a full one that measures the forecast's error and reads it), and
ToMe + cache. Prints a table and writes JSON:

    bash run.sh python benchmarks/call_counts.py --output outputs/call_counts.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Callable, Dict, Iterator, List

import numpy as np
import paddle

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppdiffusers_tome  # noqa: E402
from ppdiffusers_tome.testing import gpu_kernels, tiny_unet  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(ppdiffusers_tome.__file__))
# the bounds the package keeps (tests/tools/test_call_counts.py checks them): package calls per UNet call
BOUNDS = {"tome, every block skipped": 60, "tome, defaults (5 blocks merge)": 250, "cache, interval 1": 70}
# what the adaptive rule may add over the fixed interval, in package calls per UNet call: (adaptive row, interval row)
ADAPTIVE_BOUND = 15
ADAPTIVE_PAIRS = {"cache, adaptive, cached call": "cache, interval 3, cached call",
                  "cache, adaptive, full call": "cache, interval 3, full call",
                  "cache, forecast rule, cached call": "cache, interval 3, cached call",
                  "cache, forecast rule, full call": "cache, interval 3, full call at step 3"}


def sd15_layout_unet():
    """SD-1.5's block layout (4 levels, 2 layers per block, 16 transformer blocks, 5 at 1x) with 32 channels."""
    return tiny_unet(
        block_out_channels=(32, 32, 32, 32),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        layers_per_block=2,
    )


def unet_inputs(unet: Any, side: int = 16, batch: int = 2):
    rng = np.random.default_rng(0)
    sample = paddle.to_tensor(rng.standard_normal((batch, 4, side, side)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((batch, 7, unet.config.cross_attention_dim)).astype("float32"))
    return sample, paddle.to_tensor([500] * batch), context


def count_calls(run: Callable[[], Any]) -> Dict[str, int]:
    """``{"all": ..., "package": ...}`` Python function calls while ``run()`` runs."""
    counts = {"all": 0, "package": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts["all"] += 1
            if frame.f_code.co_filename.startswith(PACKAGE):
                counts["package"] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return counts


@contextlib.contextmanager
def applied(unet: Any, tome: Dict[str, Any] | None, cache: Dict[str, Any] | None) -> Iterator[None]:
    if tome is not None:
        ppdiffusers_tome.apply_tome(unet, **tome)
    if cache is not None:
        ppdiffusers_tome.apply_cache(unet, **cache)
    try:
        yield
    finally:
        ppdiffusers_tome.remove_cache(unet)
        ppdiffusers_tome.remove_tome(unet)


# (name, apply_tome options or None, apply_cache options or None, GPU kernels forced, calls before the counted one)
CONFIGS = [
    ("vanilla", None, None, False, 1),
    ("tome, every block skipped", {}, None, True, 1),
    ("tome, defaults (5 blocks merge)", {}, None, False, 1),
    ("cache, interval 1", None, dict(interval=1), False, 1),
    ("cache, interval 3, full call", None, dict(interval=3), False, 0),
    ("cache, interval 3, cached call", None, dict(interval=3), False, 1),
    ("cache, interval 3, full call at step 3", None, dict(interval=3), False, 3),
    ("tome + cache 3, cached call", {}, dict(interval=3), False, 1),
    # step 1 of a generation: the rule reads the signal's change and caches (a huge threshold) or runs in full (a tiny
    # one; not threshold=0, which runs every step in full without reading anything)
    ("cache, adaptive, cached call", None, dict(threshold=1e9), False, 1),
    ("cache, adaptive, full call", None, dict(threshold=1e-9), False, 1),
    # the rule with the forecast: step 2, the third full step, the first that measures the forecast's error and reads
    # it; step 3, cached after it (a huge threshold)
    ("cache, forecast rule, cached call", None, dict(threshold=1e9, forecast="linear"), False, 3),
    ("cache, forecast rule, full call", None, dict(threshold=1e9, forecast="linear"), False, 2),
]
MOVED = {"cache, adaptive, full call"}  # configurations whose counted call gets other latents than the call before


def measure(side: int = 16) -> List[Dict[str, Any]]:
    unet = sd15_layout_unet()
    inputs = unet_inputs(unet, side)
    rows, vanilla = [], None
    for name, tome, cache, gpu, before in CONFIGS:
        with applied(unet, tome, cache), (gpu_kernels() if gpu else contextlib.nullcontext()), paddle.no_grad():
            ppdiffusers_tome.reset_cache(unet)
            for _ in range(before):
                unet(*inputs)
            counted = (inputs[0] * 1.01, *inputs[1:]) if name in MOVED else inputs
            counts = count_calls(lambda: unet(*counted))
            status = ppdiffusers_tome.tome_stats(unet)  # (of the last call; taken before the patch comes off)
            cache_counts = ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]
        if vanilla is None:
            vanilla = counts["all"]
        rows.append({"configuration": name, "package": counts["package"], "all": counts["all"],
                     "added": counts["all"] - vanilla, "bound": BOUNDS.get(name), **({"stats": status} if status else {}),
                     **({"cache": cache_counts} if cache_counts else {})})
    return rows


def main(argv: List[str] | None = None) -> List[Dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=16, help="latent side (16: 256 tokens at the finest level)")
    parser.add_argument("--output", help="JSON file to write")
    args = parser.parse_args(argv)
    rows = measure(args.side)
    print(f"| configuration | calls inside the package | all Python calls added (vs vanilla {rows[0]['all']}) | "
          "bound (package) |")
    print("| --- | --- | --- | --- |")
    for row in rows[1:]:
        print(f"| {row['configuration']} | {row['package']} | {row['added']:+d} | {row['bound'] or ''} |")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump({"version": ppdiffusers_tome.__version__, "paddle": paddle.__version__, "side": args.side,
                       "rows": rows}, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()

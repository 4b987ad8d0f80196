"""Stable Diffusion 3 with ToMe and the step cache: vanilla, ToMe, the cache, and both, timed after a warm-up, one
image each (same seed) saved as vanilla.png, tome.png, cache.png and tome_cache.png.

ToMe merges SD3's image tokens before the joint attention (and, with --merge-mlp, before the image MLP) and unmerges
them after it; the text tokens are left as they are. The cache runs the whole transformer every INTERVAL steps and,
on the steps between, only its first and last blocks, adding what the blocks between added on the last full step.

    python examples/sd3.py                                   # tiny offline SD3 model, random weights, on any device
    python examples/sd3.py --model /path/to/stable-diffusion-3-medium --size 1024 --steps 28 --merge-mlp
    python examples/sd3.py --ratio 0.3 --cache 0             # ToMe only, no cache runs
    python examples/sd3.py --todo                            # ToDo (the image keys and values downsampled) for ToMe

A --model folder without a text_encoder_3 folder is loaded without T5 (SD3 then runs on its two CLIP encoders).
On a CPU the joint attention runs through ppdiffusers_tome.sd3_attention's math processor, as ppdiffusers' own
needs its GPU attention function; the tiny default always does.
"""

import argparse
import logging
import os
import time

import ppdiffusers_tome  # noqa: F401  (imported first: it keeps the import-time warnings of Paddle quiet)
import paddle

from ppdiffusers_tome.sd3_attention import use_math_attention
from ppdiffusers_tome.presets import DTYPES, check_dtype
from ppdiffusers_tome.quiet import configure_logging
from ppdiffusers_tome.testing import tiny_sd3_pipeline

logger = logging.getLogger("sd3")


def load_sd3(folder, dtype):
    """``StableDiffusion3Pipeline`` from a local folder in ``dtype``; without T5 (``text_encoder_3=None``,
    ``tokenizer_3=None``) when the folder has no ``text_encoder_3``. On a device without ppdiffusers' GPU attention
    function (a CPU), the joint attention is switched to the math processor."""
    from ppdiffusers import StableDiffusion3Pipeline

    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise ValueError(f"--model must be a local SD3 pipeline folder with a model_index.json; got {folder!r}")
    kwargs = {"paddle_dtype": getattr(paddle, dtype)}
    if not os.path.isdir(os.path.join(folder, "text_encoder_3")):
        kwargs.update(text_encoder_3=None, tokenizer_3=None)
        logger.info("no text_encoder_3 in %s: loading SD3 without T5", folder)
    from ppdiffusers.utils import logging as ppdiffusers_logging

    shown = ppdiffusers_logging.is_progress_bar_enabled()
    ppdiffusers_logging.disable_progress_bar()  # ("Loading pipeline components..." on stderr: noise here)
    try:
        pipe = StableDiffusion3Pipeline.from_pretrained(folder, **kwargs)
    finally:
        if shown:
            ppdiffusers_logging.enable_progress_bar()
    if not hasattr(paddle.nn.functional, "scaled_dot_product_attention_") or paddle.get_device() == "cpu":
        use_math_attention(pipe)
        logger.info("joint attention on the math processor (no GPU attention function here)")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def configure(pipe, ratio, merge_mlp, interval, todo=False):
    """Put exactly the techniques of one run on ``pipe``: ToMe at ``ratio`` (None: off; with ``todo``, ToDo in its
    place, which has no ratio), the cache every ``interval`` steps (None: off)."""
    pipe.remove_tome()
    pipe.remove_cache()
    if ratio is not None and todo:
        pipe.apply_tome(method="todo")
    elif ratio is not None:
        pipe.apply_tome(ratio=ratio, merge_mlp=merge_mlp)
    if interval is not None:
        pipe.apply_cache(interval=interval)


def main(argv=None):
    """Run the example; returns the paths of the saved images."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local SD3 pipeline folder; default: a tiny offline SD3 pipeline")
    parser.add_argument("--prompt", default="a red cube on a wooden table")
    parser.add_argument("--size", type=int, default=64, help="image height and width in pixels (a multiple of 16)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe's share of image tokens merged")
    parser.add_argument("--merge-mlp", action="store_true", help="merge before the image MLP too")
    parser.add_argument("--todo", action="store_true",
                        help="ToDo instead of ToMe: every query stays, the image keys and values are downsampled 2x2 "
                             "(--ratio and --merge-mlp do not apply)")
    parser.add_argument("--cache", type=int, default=3, metavar="INTERVAL",
                        help="step cache: a full pass every INTERVAL steps (0: no cache runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "sd3"))
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="float16/bfloat16 need a GPU build of Paddle")
    args = parser.parse_args(argv)
    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))
    if args.cache < 0:
        parser.error(f"--cache must be 0 (off) or an interval >= 1; got {args.cache}")
    if args.todo and args.merge_mlp:
        parser.error("--merge-mlp merges before ToMe's image MLP; ToDo (--todo) keeps every token: choose one")

    if args.model:
        try:
            pipe = load_sd3(args.model, args.dtype)
        except ValueError as error:
            parser.error(str(error))
    else:
        pipe = tiny_sd3_pipeline()
        if args.dtype != "float32":
            pipe.to(dtype=args.dtype)
    runs = [("vanilla", None, None), ("tome", args.ratio, None)]
    if args.cache:
        runs += [("cache", None, args.cache), ("tome_cache", args.ratio, args.cache)]
    os.makedirs(args.output, exist_ok=True)
    call = dict(height=args.size, width=args.size)
    saved, baseline = [], None
    for label, ratio, interval in runs:
        configure(pipe, ratio, args.merge_mlp, interval, args.todo)
        # warm-up: a first call builds kernels, tables and caches that the timed one should not pay for
        pipe(args.prompt, num_inference_steps=1, **call)
        ppdiffusers_tome.reset_tome(pipe)  # (ToMe's counters from here: the timed call's)
        before = ppdiffusers_tome.cache_status(pipe)["transformer"]
        start = time.perf_counter()
        image = pipe(args.prompt, num_inference_steps=args.steps, generator=paddle.Generator().manual_seed(args.seed),
                     **call).images[0]
        seconds = time.perf_counter() - start
        baseline = seconds if baseline is None else baseline
        path = os.path.join(args.output, f"{label}.png")
        image.save(path)
        saved.append(path)
        logger.info("%-10s %6.2f s  %.2fx  -> %s", label, seconds, baseline / seconds, path)
        if ratio is not None:
            logger.info("  %s: %s", "ToDo" if args.todo else "ToMe", ppdiffusers_tome.tome_stats(pipe)["transformer"])
        if interval is not None:
            after = ppdiffusers_tome.cache_status(pipe)["transformer"]
            logger.info("  cache: %d full and %d cached transformer calls", after["full_calls"] - before["full_calls"],
                        after["cached_calls"] - before["cached_calls"])
    configure(pipe, None, False, None)
    logger.info("saved %s in %s", ", ".join(os.path.basename(p) for p in saved), os.path.abspath(args.output))
    return saved


if __name__ == "__main__":
    main()

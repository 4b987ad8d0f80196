"""Stable Diffusion 3 with ToMe and the step cache: vanilla, ToMe, the cache, and both, timed after a warm-up, one
image each (same seed) saved as vanilla.png, tome.png, cache.png and tome_cache.png (with --todo: todo.png and
todo_cache.png). Images of an earlier run this one does not make again (--cache 0, or the other method) are removed
from the output folder, so what is there is this run's.

ToMe merges SD3's image tokens before the joint attention (and, with --merge-mlp, before the image MLP) and unmerges
them after it; the text tokens are left as they are. The cache runs the whole transformer every INTERVAL steps and,
on the steps between, only its first and last blocks, adding what the blocks between added on the last full step.

    python examples/sd3.py                                   # tiny offline SD3 model, random weights, on any device
    python examples/sd3.py --model /path/to/stable-diffusion-3-medium --resolution 1024 --steps 28 --merge-mlp
    python examples/sd3.py --ratio 0.3 --cache 0             # ToMe only, no cache runs
    python examples/sd3.py --todo                            # ToDo (the image keys and values downsampled) for ToMe

A --model folder without a text_encoder_3 folder is loaded without T5 (SD3 then runs on its two CLIP encoders).
ppdiffusers 0.29 cannot then make several images of one prompt (num_images_per_prompt > 1 fails on mismatched
prompt embeddings, with or without ToMe): pass the prompt once per image as a list instead. On a CPU the joint
attention runs through ppdiffusers_tome.sd3_attention's math processor, as ppdiffusers' own needs its GPU
attention function; the tiny default always does. Timings of the tiny default say nothing about speed.
"""

import argparse
import logging
import os
import time

logger = logging.getLogger("sd3")
DTYPES = ("float32", "float16", "bfloat16")  # ppdiffusers_tome.presets.DTYPES, here before anything imports Paddle
# every image this example can write: (method, cache) -> file name
IMAGES = {("vanilla", False): "vanilla.png", ("tome", False): "tome.png", ("cache", True): "cache.png",
          ("tome", True): "tome_cache.png", ("todo", False): "todo.png", ("todo", True): "todo_cache.png"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def parse_args(argv=None):
    """``(parser, args)``: the command line, read before Paddle is imported, so --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", help="local SD3 pipeline folder; none: a tiny offline SD3 pipeline")
    parser.add_argument("--prompt", default="a red cube on a wooden table", help="the prompt")
    parser.add_argument("--resolution", "--size", dest="resolution", type=int, default=64,
                        help="image height and width in pixels, a multiple of 16 (--size: the same option)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--ratio", type=float, default=0.5, help="ToMe's share of image tokens merged")
    parser.add_argument("--merge-mlp", action="store_true", help="merge before the image MLP too")
    parser.add_argument("--todo", action="store_true",
                        help="ToDo instead of ToMe: every query stays, the image keys and values are downsampled 2x2 "
                             "(--ratio and --merge-mlp do not apply)")
    parser.add_argument("--cache", type=int, default=3, metavar="INTERVAL",
                        help="step cache: a full pass every INTERVAL steps (0: no cache runs)")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed")
    parser.add_argument("--output", default=os.path.join("outputs", "examples", "sd3"),
                        help="folder for the images")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="float16/bfloat16 need a GPU build of Paddle")
    args = parser.parse_args(argv)
    if args.resolution < 16 or args.resolution % 16:
        parser.error("--resolution must be a positive multiple of 16 (SD3's VAE downsamples 8x and the transformer "
                     f"takes 2x2 patches of the latents); got {args.resolution}")
    if args.cache < 0:
        parser.error(f"--cache must be 0 (off) or an interval >= 1; got {args.cache}")
    if args.todo and args.merge_mlp:
        parser.error("--merge-mlp merges before ToMe's image MLP; ToDo (--todo) keeps every token: choose one")
    return parser, args


def load_sd3(folder, dtype):
    """``StableDiffusion3Pipeline`` from a local folder in ``dtype``; without T5 (``text_encoder_3=None``,
    ``tokenizer_3=None``) when the folder has no ``text_encoder_3``. On a device without ppdiffusers' GPU attention
    function (a CPU), the joint attention is switched to the math processor."""
    import paddle
    from ppdiffusers import StableDiffusion3Pipeline
    from ppdiffusers.utils import logging as ppdiffusers_logging

    from ppdiffusers_tome.sd3_attention import use_math_attention

    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise ValueError(f"--model must be a local SD3 pipeline folder with a model_index.json; got {folder!r}")
    kwargs = {"paddle_dtype": getattr(paddle, dtype)}
    if not os.path.isdir(os.path.join(folder, "text_encoder_3")):
        kwargs.update(text_encoder_3=None, tokenizer_3=None)
        logger.info("no text_encoder_3 in %s: loading SD3 without T5 (one image per prompt: for several, pass the "
                    "prompt once per image as a list; num_images_per_prompt > 1 fails without T5 in ppdiffusers 0.29)",
                    folder)

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
    parser, args = parse_args(argv)
    import ppdiffusers_tome  # imported before Paddle: it keeps Paddle's import-time warnings quiet
    import paddle

    from ppdiffusers_tome.presets import TINY_TIMINGS, check_dtype
    from ppdiffusers_tome.quiet import configure_logging
    from ppdiffusers_tome.testing import tiny_sd3_pipeline

    configure_logging()  # plain INFO lines (Paddle puts a timestamped handler on the root logger)
    try:
        check_dtype(args.dtype)
    except ValueError as error:
        parser.error(str(error))

    if args.model:
        try:
            pipe = load_sd3(args.model, args.dtype)
        except ValueError as error:
            parser.error(str(error))
    else:
        pipe = tiny_sd3_pipeline()
        if args.dtype != "float32":
            pipe.to(dtype=args.dtype)
    method = "todo" if args.todo else "tome"
    runs = [("vanilla", None, None), (method, args.ratio, None)]
    if args.cache:
        runs += [("cache", None, args.cache), (method, args.ratio, args.cache)]
    os.makedirs(args.output, exist_ok=True)
    names = [IMAGES[label, interval is not None] for label, _, interval in runs]
    for stale in sorted(set(IMAGES.values()) - set(names)):  # an earlier run's image this run does not replace
        if os.path.isfile(os.path.join(args.output, stale)):
            os.remove(os.path.join(args.output, stale))
            logger.info("removed %s of an earlier run from %s", stale, args.output)
    call = dict(height=args.resolution, width=args.resolution)
    saved, baseline = [], None
    for (label, ratio, interval), name in zip(runs, names):
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
        path = os.path.join(args.output, name)
        image.save(path)
        saved.append(path)
        logger.info("%-10s %6.2f s  %.2fx  -> %s", name[: -len(".png")], seconds, baseline / seconds, path)
        if ratio is not None:
            logger.info("  %s: %s", "ToDo" if args.todo else "ToMe", ppdiffusers_tome.tome_stats(pipe)["transformer"])
        if interval is not None:
            after = ppdiffusers_tome.cache_status(pipe)["transformer"]
            logger.info("  cache: %d full and %d cached transformer calls", after["full_calls"] - before["full_calls"],
                        after["cached_calls"] - before["cached_calls"])
    configure(pipe, None, False, None)
    if not args.model:
        logger.info("%s", TINY_TIMINGS)
    logger.info("saved %s in %s", ", ".join(os.path.basename(p) for p in saved), os.path.abspath(args.output))
    return saved


if __name__ == "__main__":
    main()

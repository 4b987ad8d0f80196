"""The bodies of the ``demo`` and ``bench`` commands. :mod:`ppdiffusers_tome.tools.cli` parses the command
line and imports this module only when it runs a command, since it imports Paddle and ppdiffusers.

``demo`` and ``bench`` share their set-up (:func:`prepare`: validate the ratios and dtype, refuse a resolution
whose attention cannot fit, set the threads, load the model) and their engine: the demo is one resolution and one
image per call of the :class:`~ppdiffusers_tome.tools.bench.Runner`, plus the decoded images for its PNG grid.

Both write what they measure while they measure it (the demo after every round of timed runs, ``bench`` after
every resolution x batch), marked ``"complete": false`` until the end, so Ctrl-C keeps the finished part: it
raises :class:`Interrupted`, which says what was saved."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import paddle

from ...tome.config import ToMeConfig
from ...tome.patch import find_blocks
from ...tome.planner import finest_block_level
from .. import presets
from ..measure import environment, set_threads
from ..messages import CALIBRATE_NEEDS_GPU
from ..progress import ProgressBar
from .calibrate import as_dict as calibration_dict, calibrate, format_calibration, gpu_timer
from .demo import (
    DEMO_LEGEND,
    SHAPES_CAPTION,
    SHAPES_SD3_CAPTION,
    demo_grid,
    demo_label,
    demo_rows,
    first_image,
    format_demo_table,
    noise_warning,
    single_run_note,
    unstable_runs,
)
from .devices import Device, default_device, is_out_of_memory, select_device
from .inputs import DenoiserInputs, pipeline_kwargs
from .methods import BenchSettings, Method, method_list
from .plots import write_plots
from .report import (
    TWIN_LEGEND,
    format_details,
    format_grid_table,
    format_pareto,
    format_time_split,
    merges_nothing,
    record,
    save_json,
)
from .runner import Runner, denoiser, grid_steps, run_grid
from .timesplit import time_split

logger = logging.getLogger(__name__)


# shared set-up ---------------------------------------------------------------------------------------------------
SHAPES_MODEL = "shapes"  # --model shapes: the trained UNet model shipped in the package
SHAPES_SD3_MODEL = "shapes-sd3"  # --model shapes-sd3: the same task on SD3's MMDiT, shipped too
NOTHING_SAVED = "nothing had been measured yet, so nothing was saved"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a command: :attr:`saved` says, in one sentence, what had been written by then."""

    def __init__(self, saved: str):
        super().__init__(saved)
        self.saved = saved


@contextlib.contextmanager
def interrupted_saying(saved: Callable[[], str]) -> Iterator[None]:
    """Turn Ctrl-C inside the ``with`` block into :class:`Interrupted` carrying ``saved()``, the sentence of what
    had been written when it came."""
    try:
        yield
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise Interrupted(saved()) from None


def resolve_model(args: argparse.Namespace) -> str:
    """Put a shipped model's folder in ``args.model`` when it is asked for (``--model shapes`` or ``--model
    shapes-sd3``, unless a folder of that name exists) or, for ``demo``, the shapes UNet model when neither
    ``--model`` nor ``--preset`` is given; then fill the demo's unset ``--prompt``, ``--steps`` and
    ``--guidance-scale`` for the model that runs. Returns the shipped model's name (``""``: not a shipped model)."""
    from .. import shapes as shipped

    demo = getattr(args, "command", None) == "demo"
    wanted = args.model if args.model in (SHAPES_MODEL, SHAPES_SD3_MODEL) and not os.path.isdir(args.model) else ""
    if not wanted and demo and not args.model and not args.preset:
        wanted = SHAPES_MODEL
    sd3 = wanted == SHAPES_SD3_MODEL
    if wanted:
        if not (shipped.has_sd3_weights() if sd3 else shipped.has_weights()):
            raise ValueError(f"--model {wanted}: the trained weights are missing from "
                             f"{shipped.SD3_MODEL_DIR if sd3 else shipped.MODEL_DIR} (a partial install?); name a "
                             "--preset or a --model folder")
        args.model = shipped.sd3_pipeline_folder() if sd3 else shipped.pipeline_folder()
    if demo:
        args.prompt = args.prompt or (shipped.DEMO_PROMPT if wanted else BenchSettings.prompt)
        args.steps = args.steps or ((shipped.SD3_DEMO_STEPS if sd3 else shipped.DEMO_STEPS) if wanted else 8)
        if args.guidance_scale is None and wanted:
            args.guidance_scale = shipped.SD3_DEMO_GUIDANCE if sd3 else shipped.DEMO_GUIDANCE
    return wanted


def refuse_other_sizes(native: int, sizes: Sequence[int], option: str) -> None:
    """Refuse a size the shipped shapes model was not trained for (it would run, slowly, and draw nothing useful)."""
    other = [size for size in sizes if size != native]
    if other:
        raise ValueError(f"{option} {' '.join(map(str, other))}: the shapes model draws {native}x{native} images only; "
                         f"for another size use a preset, e.g. --preset sd15-narrow {option} {other[0]}")


def model_layout(args: argparse.Namespace) -> tuple[Any, int, str]:
    """``(layout, default resolution, label)`` of the model a demo or bench run will build, read from the preset's
    config or the folder's ``unet/config.json`` without building anything (layout ``None``: not a UNet)."""
    if args.model:
        return presets.folder_layout(args.model), presets.folder_resolution(args.model) or 512, f"model {args.model}"
    return presets.preset_layout(args.preset), presets.default_resolution(args.preset), f"preset {args.preset!r}"


@dataclass
class Prepared:
    """A loaded model, ready to measure: the pipeline, where it came from, and the CPU threads set."""

    pipe: Any
    source: str
    threads: int


def prepare(args: argparse.Namespace, dtype: str, resolutions: Sequence[int], images: int, option: str,
            device: Device) -> Prepared:
    """The set-up that ``demo`` and ``bench`` share, every check before anything is built: ``--ratios`` (with
    ``--max-downsample``), ``dtype``, and, on CPU, whether the run's largest self-attention fits in the memory
    available (``images`` per call, ``option`` names the resolution option in the refusal; on a GPU a too large
    attention raises Paddle's out-of-memory error instead). Then the threads, and the model is loaded."""
    ToMeConfig(max_downsample=args.max_downsample)  # (its refusal names max_downsample)
    for ratio in args.ratios:  # validate every ratio before spending minutes on vanilla runs (the parser did too)
        try:
            ToMeConfig(ratio=ratio, max_downsample=args.max_downsample)
        except ValueError as error:
            raise ValueError(f"--ratios {ratio!r}: {error}") from None
    presets.check_dtype(dtype)
    if device.name != "gpu":
        layout, _, label = model_layout(args)
        presets.check_attention_memory(layout, resolutions, images, dtype, label, option)
    threads = set_threads(args.threads)
    if args.model:
        logger.info("loading the pipeline in %s ...", args.model)
        pipe, source = presets.load_local_pipeline(args.model, dtype=dtype), os.path.abspath(args.model)
        source = _shipped_name(source)
    else:
        logger.info("building preset %s with random weights (its images are noise) ...", args.preset)
        pipe = presets.preset_pipeline(args.preset, seed=args.seed, dtype=dtype)
        source = f"preset:{args.preset} (random weights)"
    return Prepared(pipe, source, threads)


def _shipped_name(source: str) -> str:
    """How a run names the folder it loaded: a shipped model by what it is, any other folder by its path."""
    from ..shapes import pipeline_folder, sd3_pipeline_folder

    names = {os.path.abspath(pipeline_folder()): "shapes model (trained, shipped in the package)",
             os.path.abspath(sd3_pipeline_folder()): "SD3 shapes model (trained, shipped in the package)"}
    return names.get(source, source)


@contextlib.contextmanager
def step_bar(pipe, steps: int, desc: str) -> Iterator[ProgressBar]:
    """A progress bar on stderr that advances with every denoiser forward of ``pipe`` (one per step with
    classifier-free guidance batched), while the ``with`` block runs."""
    bar = ProgressBar(total=steps, desc=desc, unit="steps")
    model = denoiser(pipe)
    handle = model.register_forward_post_hook(lambda *_: bar.update()) if model is not None else None
    try:
        yield bar
    finally:
        if handle is not None:
            handle.remove()
        bar.close()


# demo --------------------------------------------------------------------------------------------------------------
def measure_demo(prepared: Prepared, args: argparse.Namespace, size: int,
                 on_round: Callable[[list[dict[str, Any]], list[Any], int], None] | None = None,
                 ) -> tuple[list[dict[str, Any]], list[Any]]:
    """Vanilla, ToMe at every ``--ratios`` value and (unless ``--cache 0``) ToMe at the largest ratio with a step
    cache of interval ``--cache``, interleaved, at ``size`` px and one image per call, after one 1-step warm-up
    call: the demo's result rows, and the first image of each method's last run. ``on_round(rows, images,
    timed_runs)`` gets the same after every round of timed runs (each method once more)."""
    pipe = prepared.pipe
    logger.info("warming up (%s, %dx%d)", prepared.source, size, size)
    with step_bar(pipe, 1, "warm-up"):
        pipe(**pipeline_kwargs(pipe, size, 1, 1, args.seed, args.prompt, args.guidance_scale))
    settings = BenchSettings(resolutions=[size], ratios=args.ratios, methods=("vanilla", "tome"), steps=args.steps,
                             repeats=args.repeats, warmup=0, max_downsample=args.max_downsample, seed=args.seed,
                             prompt=args.prompt, guidance_scale=args.guidance_scale, count_ops=False)
    methods = [Method("vanilla")] + [Method("tome", float(r)) for r in args.ratios]
    transformer = getattr(pipe, "transformer", None) is not None
    if transformer:  # an MMDiT / DiT: ToDo (SD3's choice on a GPU at mid sizes) and the step cache alone too
        methods.append(Method("todo"))
    if getattr(args, "cache", 0):  # the step cache with the largest ratio: merging takes the finest level, the cache the rest
        if transformer:
            methods.append(Method("cache", cache={"interval": args.cache}))
        methods.append(Method("tome", float(max(args.ratios)), cache={"interval": args.cache}))

    def bar(method: Method, repeat: int):
        interval = method.cache["interval"] if method.cache else None
        label = demo_label(method.name, method.ratio, interval)
        return step_bar(pipe, args.steps, f"{label} run {repeat + 1}/{args.repeats}")

    def rows_and_images(cells):
        failed = [f"{c.label}: {c.status} ({c.reason})" for c in cells if c.status != "ok"]
        if failed:
            raise RuntimeError(f"the demo could not measure {'; '.join(failed)}")
        return demo_rows(cells, runner.outputs), [first_image(runner.outputs[c.label]) for c in cells]

    def round_done(cells, timed_runs):
        if on_round is not None:
            on_round(*rows_and_images(cells), timed_runs)

    runner = Runner(pipe, settings, around_run=bar, on_round=round_done)
    return rows_and_images(runner.run_cell(size, 1, methods))


def _runs(repeats: int) -> str:
    return "ONE timed run per configuration" if repeats == 1 else f"median of {repeats} timed runs"


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """``ppdiffusers-tome demo``: table on stdout, ``demo.png`` and ``results.json`` in ``--output`` (both written
    after every round of timed runs too, so Ctrl-C keeps the rounds already finished; see :class:`Interrupted`)."""
    device = default_device()
    shapes = resolve_model(args)
    native = model_layout(args)[1]
    if shapes:
        refuse_other_sizes(native, [args.resolution or native], "--resolution")
    size = args.resolution or native
    prepared = prepare(args, args.dtype, [size], 1, "--resolution", device)
    os.makedirs(args.output, exist_ok=True)
    png, path = os.path.join(args.output, "demo.png"), os.path.join(args.output, "results.json")
    saved = NOTHING_SAVED

    def write(rows, images, timed_runs):
        nonlocal saved
        data = demo_record(args, prepared, size, rows, png, timed_runs)
        save_png(demo_grid(rows, images, SHAPES_CAPTION if shapes == SHAPES_MODEL else
                           SHAPES_SD3_CAPTION if shapes else ""), png)
        save_json(data, path)  # (PSNR of vanilla is inf: written as the string "inf", keeping the file valid JSON)
        saved = (f"saved {timed_runs} of {args.repeats} timed runs per method (the rounds finished) in {png} and "
                 f"{path}")
        return data

    with interrupted_saying(lambda: saved):
        rows, images = measure_demo(prepared, args, size, on_round=write)
        data = write(rows, images, args.repeats)
    notes = data["warnings"]
    env = data["environment"]
    warning = "".join(text + "\n" for text in notes)
    if shapes:
        tokens = (size // 4) ** 2 if shapes == SHAPES_SD3_MODEL else (size // 2) ** 2
        about = (f"The shapes model is small: at {size}x{size} px its finest attention holds {tokens} tokens, "
                 "where merging saves little time. It is here for the images (their colours and flat regions; see "
                 "the caption of the PNG); for speed, run the demo with --preset sd15-narrow, or bench.\n")
    else:
        about = "" if args.model else "The images are noise: a preset has random weights (use --model for real images).\n"
    sys.stdout.write(
        f"ToMe demo: {prepared.source}, {size}x{size}, {args.steps} steps, {env['dtype']} on {env['device']} "
        f"({prepared.threads} threads), "
        f"{_runs(args.repeats) + (' (a check that it runs, not a measurement)' if args.repeats == 1 else '')}\n"
        f"prompt: {args.prompt!r}\n"
        f"{format_demo_table(rows)}\n{DEMO_LEGEND}\n{warning}{about}wrote {png} and {path}\n"
    )
    return data


def save_png(image: Any, path: str) -> None:
    """Save the PIL ``image`` as a PNG at ``path`` through a file beside it, so that a run stopped while saving
    (Ctrl-C) leaves the previous complete image, never half of one."""
    partial = f"{path}.partial"
    try:
        image.save(partial, format="PNG")
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise


def demo_record(args: argparse.Namespace, prepared: Prepared, size: int, rows: list[dict[str, Any]], png: str,
                timed_runs: int) -> dict[str, Any]:
    """The demo's ``results.json`` record after ``timed_runs`` of its ``--repeats`` rounds (``"complete"`` once
    they are all done)."""
    settings = {"resolution": size, "steps": args.steps, "repeats": args.repeats, "seed": args.seed,
                "prompt": args.prompt, "guidance_scale": args.guidance_scale, "max_downsample": args.max_downsample,
                "batch_size": 1}
    notes = [text for text in (single_run_note(rows, args.repeats), noise_warning(rows)) if text]
    if any(row.get("merges_nothing") for row in rows):
        notes.insert(0, TWIN_LEGEND)
    return {
        "command": "demo",
        "complete": timed_runs >= args.repeats,  # false while it runs, and after Ctrl-C
        "timed_runs_done": timed_runs,
        "source": prepared.source,
        "environment": environment(prepared.threads, args.dtype),
        "settings": settings,
        "results": rows,
        "unstable_runs": unstable_runs(rows),  # (each row's "speedup_range" says how far the noise reaches)
        "warnings": notes,  # what the output printed under the table: one run, noisy runs, twins of vanilla
        "png": png,
    }


# bench -------------------------------------------------------------------------------------------------------------
def bench_settings(args: argparse.Namespace) -> BenchSettings:
    """The settings of a ``bench`` command line (``--compare-builtin`` adds the ``builtin`` method)."""
    methods = list(args.methods) + (["builtin"] if args.compare_builtin and "builtin" not in args.methods else [])
    return BenchSettings(
        resolutions=args.resolutions or [model_layout(args)[1]], batch_sizes=args.batch_sizes or [1],
        ratios=args.ratios,
        methods=methods, variants=list(args.variants), steps=args.steps, repeats=args.repeats,
        warmup=max(args.warmup, 0), max_downsample=args.max_downsample, unet_only=args.unet_only, seed=args.seed,
        count_ops=not args.no_op_count,
    )


def measure_time_splits(pipe, settings: BenchSettings, device: Device) -> dict[str, dict[str, float]]:
    """The time split of vanilla, ToMe at every ratio and (when measured) the built-in port, at the first
    resolution and batch size; a configuration that runs out of memory is left out."""
    size, batch = settings.resolutions[0], settings.batch_sizes[0]
    methods = [Method("vanilla")] + [Method("tome", r) for r in settings.ratios]
    if "builtin" in settings.methods:
        methods += [Method("builtin", r) for r in settings.ratios]
    split: dict[str, dict[str, float]] = {}
    for method in methods:
        try:
            split[method.label] = time_split(pipe, settings, size, batch, method, device=device)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            logger.warning("time split of %s skipped: out of memory", method.label)
    return split


def bench_summary(data: dict[str, Any], cells, settings: BenchSettings, path: str) -> str:
    """The text ``bench`` prints: a heading, the grid, the details, the Pareto table and the time split."""
    env, split = data["environment"], data["time_split"]
    kind = "one denoiser forward" if settings.unet_only else f"{settings.steps}-step pipeline call"
    lines = [
        f"ToMe bench: {data['source']}, {kind}, {env['dtype']} on {env['device']} ({env['threads']} threads), "
        f"{_runs(settings.repeats)}",
        "seconds per image (speed-up vs vanilla):",
        format_grid_table(cells, method_list(settings)),
        *unavailable_lines(cells),
        "",
        format_details(cells),
        "",
        "speed-up vs fidelity to vanilla (Pareto: no other configuration is both faster and closer):",
        format_pareto(cells),
    ]
    if any(merges_nothing(c) for c in cells):
        lines.append(TWIN_LEGEND)
    lines += data.get("warnings", [])
    if split:
        lines += ["", format_time_split(split)]
    lines.append(f"wrote {path}" + (f" and {len(data['plots'])} plots" if data["plots"] else ""))
    return "\n".join(lines) + "\n"


def unavailable_lines(cells) -> list[str]:
    """One line per reason a configuration could not run (``n/a``) or ran out of memory (``OOM``), naming the
    configurations and where, for under the grid table: the reason is not only in ``results.json``.

    >>> from ppdiffusers_tome.tools.bench.runner import Cell
    >>> na = dict(method="tome-efficient", status="n/a", reason="no kernel")
    >>> unavailable_lines([Cell(64, 1, ratio=r, label=f"tome-efficient@{r}", **na) for r in (0.3, 0.5)])
    ['n/a tome-efficient@0.3, tome-efficient@0.5 (every resolution and batch): no kernel']
    >>> unavailable_lines([Cell(64, 1, "vanilla", 0.0, "vanilla"), Cell(64, 2, "vanilla", 0.0, "vanilla", status="OOM",
    ...                                                               reason="out of memory")])
    ['OOM vanilla (64 px batch 2): out of memory']
    """
    groups = {(c.resolution, c.batch) for c in cells}
    places: dict[tuple[str, str, str], set[tuple[int, int]]] = {}
    for cell in cells:
        if cell.status != "ok":
            places.setdefault((cell.status, cell.label, cell.reason or "no reason recorded"), set()).add(
                (cell.resolution, cell.batch))
    lines: dict[tuple[str, str, str], list[str]] = {}  # (status, where, reason) -> labels
    for (status, label, reason), found in places.items():
        shown = ("every resolution and batch" if found == groups else
                 ", ".join(f"{size} px batch {batch}" for size, batch in sorted(found)))
        lines.setdefault((status, shown, reason), []).append(label)
    return [f"{status} {', '.join(labels)} ({shown}): {reason}" for (status, shown, reason), labels in lines.items()]


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """``ppdiffusers-tome bench``: tables on stdout, ``results.json`` and plots in ``--output``."""
    if getattr(args, "calibrate", False):
        return run_calibrate(args)
    device = select_device(args.device)  # a CPU-only build refuses --device gpu here, before anything is built
    dtype = args.dtype or ("float16" if device.name == "gpu" else "float32")
    shapes = resolve_model(args)  # --model shapes
    settings = bench_settings(args)
    if shapes:
        refuse_other_sizes(model_layout(args)[1], settings.resolutions, "--resolutions")
    method_list(settings)  # (parses and validates --variants)
    prepared = prepare(args, dtype, settings.resolutions, max(settings.batch_sizes), "--resolutions", device)
    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "results.json")
    groups = len(settings.resolutions) * len(settings.batch_sizes)
    saved = NOTHING_SAVED

    def keep(cells):  # after every resolution x batch: the finished cells, so that Ctrl-C loses none of them
        nonlocal saved
        data = record(cells, settings, prepared.source, prepared.threads, dtype, {})
        done = len({(c.resolution, c.batch) for c in cells})
        data.update(complete=False, plots=[], groups_done=f"{done} of {groups} resolution x batch")
        save_json(data, path)
        saved = f"saved the {len(cells)} cells of {done} of {groups} resolution x batch in {path}"

    with interrupted_saying(lambda: saved):
        with ProgressBar(total=grid_steps(settings), desc="bench", unit="runs") as bar:
            cells = run_grid(prepared.pipe, settings, progress=lambda: bar.update(1), device=device, on_cells=keep)
        saved += " (the time split and the plots were not made)"
        split = {} if args.no_time_split else measure_time_splits(prepared.pipe, settings, device)
        data = record(cells, settings, prepared.source, prepared.threads, dtype, split)
        data["complete"] = True
        data["plots"] = [] if args.no_plots else write_plots(cells, split, args.output)
        save_json(data, path)
    sys.stdout.write(bench_summary(data, cells, settings, path))
    return data


# bench --calibrate ---------------------------------------------------------------------------------------------------
CALIBRATE_RESOLUTIONS, CALIBRATE_IMAGES = (512, 768, 1024), (1, 8)


def run_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """``ppdiffusers-tome bench --calibrate --device gpu``: the break-even table on stdout, ``calibration.json`` in
    ``--output``. Refused before anything is built unless a GPU runs it."""
    if args.device != "gpu":  # (the command line refuses it before it imports this module)
        raise ValueError(CALIBRATE_NEEDS_GPU)
    device = select_device("gpu")  # a CPU-only build refuses here
    dtype = args.dtype or "float16"
    resolutions = args.resolutions or list(CALIBRATE_RESOLUTIONS)
    images = args.batch_sizes or list(CALIBRATE_IMAGES)
    resolve_model(args)
    prepared = prepare(args, dtype, resolutions, max(images), "--resolutions", device)
    pipe = prepared.pipe
    points = calibrate(pipe, resolutions, images, lambda size, count: denoiser_forward(pipe, size, count, args.seed),
                       gpu_timer(device.synchronize, time.perf_counter, args.repeats, max(args.warmup, 1)),
                       lambda size: finest_tokens(pipe, size))
    os.makedirs(args.output, exist_ok=True)
    data = {"command": "bench --calibrate", "source": prepared.source,
            "environment": environment(prepared.threads, dtype), **calibration_dict(points)}
    path = os.path.join(args.output, "calibration.json")
    save_json(data, path)
    sys.stdout.write(f"ToMe calibration: {prepared.source}, one denoiser forward, {dtype} on "
                     f"{data['environment']['device']}, {_runs(args.repeats)}\n{format_calibration(points)}wrote {path}\n")
    return data


def denoiser_forward(pipe: Any, size: int, images: int, seed: int):
    """One no-grad denoiser forward of ``images`` images (UNet batch ``2 * images``) at ``size`` px."""
    inputs = DenoiserInputs(pipe, size, images, seed)

    def forward():
        with paddle.no_grad():
            return inputs.run()

    return forward


def finest_tokens(pipe: Any, size: int) -> int:
    """Tokens of the finest level with transformer blocks of ``pipe``'s UNet at ``size`` px."""
    latent = size // getattr(pipe, "vae_scale_factor", 8)
    level = finest_block_level(pipe.unet, find_blocks(pipe.unet)) or 1
    side = -(-latent // level)
    return side * side

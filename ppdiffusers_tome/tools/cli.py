"""Command line: ``ppdiffusers-tome demo|bench`` (also ``python -m ppdiffusers_tome ...``).

This module only parses: the commands run in :mod:`ppdiffusers_tome.tools.bench.commands`, which :func:`main` imports
when it dispatches, so ``--help`` and ``--version`` answer at once without Paddle or ppdiffusers (the package's
``__init__`` skips them too for those two flags).

``demo`` runs a pipeline with and without ToMe side by side at one resolution, prints a table (time, speed-up, peak
memory, difference to vanilla), and writes a PNG grid and a JSON record. With neither ``--model`` nor ``--preset`` it
runs the shapes model that ships trained inside the package (:mod:`ppdiffusers_tome.tools.shapes`: 64x64 images a
person can compare), so it needs no download; a ``--preset`` is a full-size layout with random weights, for speed.
``--model shapes`` names the shipped model in ``bench`` too.
``bench`` measures a grid of resolutions, batch sizes and methods (see :mod:`ppdiffusers_tome.tools.bench`); the demo is
one resolution of the same engine.

Every check that needs no model runs here, before the commands are imported: the options' ranges, ``--output``
(created up front, and removed again if the command stops before writing anything in it) and ``bench --calibrate``
without a GPU. Ctrl-C ends a command with one line saying what it had saved, and exit status 130.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import textwrap
from collections.abc import Sequence

from .. import __version__
from ..quiet import configure_logging, ignore_import_warnings
from .messages import CALIBRATE_NEEDS_GPU
from .presets import DEFAULT_PRESET, available_presets, default_resolution, preset_summary

# shapes.shipped.DEMO_PROMPT and bench.BenchSettings.prompt, repeated for the same reason (a test keeps them equal)
SHAPES_PROMPT = "a small orange circle at the top on a blue background"
DEFAULT_PROMPT = "a lighthouse on a cliff at sunset, detailed oil painting"
# bench.ALL_METHODS, repeated here so that ``--help`` does not import bench (and Paddle); a test keeps them equal
BENCH_METHODS = ("vanilla", "tome", "tome-efficient", "todo", "todo-efficient", "builtin", "bound", "cache")
INTERRUPTED_STATUS = 130  # what a shell reports for a program ended by Ctrl-C (128 + SIGINT)


def _int_at_least(low: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    """An integer >= 1 (repeats, steps, threads, batch sizes)."""
    return _int_at_least(1, text)


def _non_negative_int(text: str) -> int:
    """An integer >= 0 (``--warmup``: 0 runs no untimed run)."""
    return _int_at_least(0, text)


MAX_SEED = 2**63 - 1  # Paddle's generators take seeds below 2**64; the presets add small offsets to the seed


def _seed(text: str) -> int:
    """``--seed``: an integer in [0, 2**63 - 1]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63 - 1]; got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63 - 1]; got {text}")
    return value


def _output_folder(path: str) -> str | None:
    """Why ``path`` cannot become the output folder (empty, an existing file, or a file where a parent folder should
    be), or None."""
    if not path.strip():  # e.g. --output "$UNSET": os.path.abspath would make it the current folder
        return "--output is empty (an unset shell variable?); give a folder (it is created if missing)"
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = "is a file" if probe == os.path.abspath(path) else f"cannot be created: {probe} is a file"
        return f"--output {path} {what}; give a folder (it is created if missing)"
    if not os.access(probe, os.W_OK):
        return f"--output {path}: {probe} is not writable"
    return None


def _create_output(path: str) -> tuple[str | None, list[str]]:
    """Create the output folder ``path`` now and check that a file can be written in it, before any work: a folder
    that ``os.access`` calls writable can still fail to be created (a name too long, a read-only mount, quotas).
    Returns ``(why it cannot be used or None, the folders this call created, deepest last)``; on failure the
    created folders are already removed again."""
    missing, probe = [], os.path.abspath(path)
    while not os.path.isdir(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    created: list[str] = []
    try:
        for folder in reversed(missing):
            os.mkdir(folder)
            created.append(folder)
        handle, name = tempfile.mkstemp(prefix=".write-check-", dir=path)
        os.close(handle)
        os.remove(name)
    except OSError as error:
        _remove_empty(created)
        where = error.filename and os.path.abspath(error.filename)
        detail = f" ({where})" if where and where != os.path.abspath(path) else ""
        return f"--output {path} cannot be used: {error.strerror or error}{detail}", []
    return None, created


def _remove_empty(folders: Sequence[str]) -> None:
    """Remove ``folders`` (deepest last) that are still empty, deepest first: what :func:`_create_output` made
    for a command that ended before it wrote anything."""
    for folder in reversed(folders):
        try:
            os.rmdir(folder)
        except OSError:  # not empty (the command wrote its files) or gone
            return


# ToMe's ratio limit 1 - 1/(sx*sy) at its default strides sx = sy = 2 (config.check_ratio), repeated here so that
# ``--help`` does not import Paddle; a test keeps them equal. A ``--variants`` entry may set other strides and a ratio.
RATIO_LIMIT = 0.75


def _ratio(text: str) -> float:
    """One ``--ratios`` value: a number in [0, RATIO_LIMIT)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < RATIO_LIMIT:  # (False for NaN)
        raise argparse.ArgumentTypeError(f"must be a number in [0, {RATIO_LIMIT:g}) (ToMe's limit 1 - 1/(sx*sy) at "
                                         f"its default strides sx=sy=2); got {text!r}")
    return value


def _finite(text: str) -> float:
    """A finite number (``--guidance-scale``)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number; got {text!r}")
    return value


def _resolution(text: str) -> int:
    value = int(text)
    if value < 8 or value % 8:
        raise argparse.ArgumentTypeError(f"must be a multiple of 8 and >= 8, got {text}")
    return value


def _level(text: str):
    """``--max-downsample``: ``auto`` or an integer (validated by ToMeConfig with the allowed values)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or one of 1, 2, 4, 8; got {text!r}") from None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default after its help (unless the help already gives it, or there is none), and wraps
    lines at spaces only, so that names such as ``tome-efficient`` are never split."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default is None or default is False or default == argparse.SUPPRESS \
                or default == [] or "default" in text:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _presets_epilog(default: str | None = DEFAULT_PRESET) -> str:
    lines = []
    if default is None:  # the demo: the shipped trained model runs unless a preset or a folder is named
        lines += ["models (trained, shipped in the package; shapes is the default):",
                  f"  {'shapes':<18} {64:>5} px  coloured shapes from a caption (--model shapes)",
                  f"  {'shapes-sd3':<18} {64:>5} px  the same task on SD3's MMDiT (--model shapes-sd3)", ""]
    lines.append("presets (random weights, built offline; default resolution in pixels):")
    for name in available_presets():
        mark = " (default)" if name == default else ""
        lines.append(f"  {name:<18} {default_resolution(name):>5} px  {preset_summary(name)}{mark}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The parser of the command line: ``demo`` and ``bench`` with their options and defaults."""
    parser = argparse.ArgumentParser(prog="ppdiffusers-tome", description="Token Merging for ppdiffusers pipelines")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo_parser(sub)
    _add_bench_parser(sub)
    for command in sub.choices.values():  # ``ppdiffusers-tome demo --version`` answers too
        command.add_argument("--version", action="version", version=f"ppdiffusers-tome {__version__}",
                             help="print the version and exit")
    return parser


def _cache_interval(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0 or str(value) != text.strip():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0: no step cache row); got {text!r}")
    return value


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo", help="vanilla vs ToMe side by side: table, PNG grid, JSON", formatter_class=_HelpFormatter,
        description="Run one pipeline without and with ToMe at the same seed, interleaved, and compare time,\n"
                    "memory and the images. By default it runs the shapes model that ships trained in the package\n"
                    "(64x64 images of coloured shapes drawn from a caption; no download). --preset builds a\n"
                    "full-size layout with random weights instead (its images are noise; for speed), --model loads\n"
                    "a pipeline folder.",
        epilog=_presets_epilog(default=None),
    )
    source = demo.add_mutually_exclusive_group()
    source.add_argument("--model", help="a local pipeline folder (model_index.json), 'shapes' (the shipped "
                                        "trained model; the default when --preset is not given either) or "
                                        "'shapes-sd3' (the same task on SD3's MMDiT)")
    source.add_argument("--preset", "--arch", dest="preset", choices=available_presets(), metavar="PRESET",
                        default=None, help="a model layout with random weights, listed below (--arch is an alias; "
                                           "default: none, the shipped shapes model runs)")
    demo.add_argument("--resolution", type=_resolution, default=None,
                      help="image height and width in pixels (default: the preset's, listed below; for --model the "
                           "model's own sample size)")
    demo.add_argument("--ratios", type=_ratio, nargs="+", default=[0.3, 0.5],
                      help=f"ToMe ratios to compare, each in [0, {RATIO_LIMIT:g})")
    demo.add_argument("--max-downsample", type=_level, default="auto", help="ToMe max_downsample (auto, 1, 2, 4 or 8)")
    demo.add_argument("--cache", type=_cache_interval, default=3,
                      help="add ToMe at the largest ratio with a step cache of this interval (a full UNet pass every "
                           "CACHE steps); 0 leaves that row out")
    demo.add_argument("--steps", type=_positive_int, default=None,
                      help="denoising steps (default: 20 for the shapes model, 8 for a preset or --model)")
    demo.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per method (median reported)")
    demo.add_argument("--seed", type=_seed, default=0,
                      help="seed of a preset's random weights and of the initial latents")
    demo.add_argument("--prompt", default=None,
                      help=f"prompt (default: {SHAPES_PROMPT!r} for the shapes model, whose vocabulary is its "
                           f"captions' words; {DEFAULT_PROMPT!r} otherwise)")
    demo.add_argument("--guidance-scale", type=_finite, default=None,
                      help="classifier-free guidance (default: 4.0 for the shapes model, the pipeline's own otherwise)")
    demo.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for Paddle (default: all)")
    demo.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                      help="float16 and bfloat16 need a GPU")
    demo.add_argument("--output", default=os.path.join("outputs", "demo"), help="folder for demo.png/results.json")


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench", help="grid of resolutions x batch sizes x methods: table, JSON, plots", formatter_class=_HelpFormatter,
        description="Measure methods side by side (vanilla, ToMe at every --ratios value, the zero-overhead bound,\n"
                    "...) at every resolution x batch size, interleaved in one process: seconds per image, speed-up,\n"
                    "memory and fidelity to vanilla, as tables on stdout, results.json (rewritten after every\n"
                    "resolution x batch, so Ctrl-C keeps what was measured) and plots. By default a model layout\n"
                    "with random weights (--preset); --model loads a pipeline folder.",
        epilog=_presets_epilog())
    source = bench.add_mutually_exclusive_group()
    source.add_argument("--preset", "--arch", dest="preset", choices=available_presets(), metavar="PRESET",
                        default=DEFAULT_PRESET,
                        help="model layout with random weights, listed below (--arch is an alias)")
    source.add_argument("--model", help="a local pipeline folder instead of --preset, or 'shapes' / 'shapes-sd3' "
                                        "(the shipped trained 64x64 models)")
    bench.add_argument("--resolutions", type=_resolution, nargs="+", default=None,
                       help="image sizes in pixels (default: the preset's, listed below)")
    bench.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=None,
                       help="images per call (default 1; with --calibrate 1 and 8)")
    bench.add_argument("--ratios", type=_ratio, nargs="+", default=[0.5],
                       help=f"ToMe ratios, each in [0, {RATIO_LIMIT:g}) (the limit at strides sx=sy=2)")
    bench.add_argument("--methods", nargs="+", choices=BENCH_METHODS, metavar="METHOD",
                       default=["vanilla", "tome", "tome-efficient", "bound"],
                       help=f"methods to measure, of: {', '.join(BENCH_METHODS)}; tome-efficient needs Paddle's "
                            "memory-efficient attention (a GPU build): elsewhere its cells read n/a, with the reason "
                            "under the table")
    bench.add_argument("--variants", nargs="+", default=[], metavar="METHOD:OPTION=VALUE,...",
                       help="extra configurations, e.g. tome:recompute_every=5 'tome:ratio=(0.6,0.3)' "
                            "todo:downsample_factor=4,downsample_mode=average")
    bench.add_argument("--compare-builtin", action="store_true", help="add ppdiffusers' built-in ToMe port")
    bench.add_argument("--calibrate", action="store_true",
                       help="GPU only: time vanilla, the policy's plan and tomesd's plan at --resolutions (default "
                            "512 768 1024) and --batch-sizes, print where merging starts to pay and the min_work "
                            "line to paste")
    bench.add_argument("--steps", type=_positive_int, default=20, help="denoising steps per pipeline call")
    bench.add_argument("--unet-only", action="store_true", help="time one denoiser forward instead of a pipeline call")
    bench.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per method (median reported)")
    bench.add_argument("--warmup", type=_non_negative_int, default=1,
                       help="untimed runs per method before timing (an integer >= 0)")
    bench.add_argument("--max-downsample", type=_level, default="auto",
                       help="auto (default: the finest level with attention, 2 on SDXL), 1, 2, 4 or 8")
    bench.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                       help="gpu needs a CUDA build of PaddlePaddle (paddlepaddle-gpu); timing is synchronised and "
                            "memory is Paddle's max allocated bytes there")
    bench.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                       help="default: float16 with --device gpu, float32 on CPU")
    bench.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for Paddle (default: all)")
    bench.add_argument("--seed", type=_seed, default=0,
                       help="seed of a preset's random weights and of the initial latents")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    bench.add_argument("--no-time-split", action="store_true", help="skip the attention/matching/rest split")
    bench.add_argument("--no-op-count", action="store_true",
                       help="skip the ops/block column (one extra profiled denoiser forward per cell and method)")
    bench.add_argument("--output", default=os.path.join("outputs", "bench"), help="folder for results.json and plots")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (2 on bad input, 130 after
    Ctrl-C)."""
    ignore_import_warnings()  # (the package's __init__ did it already when this process is the command line)
    args = build_parser().parse_args(argv)
    name = f"ppdiffusers-tome {args.command}"
    calibrate_on_cpu = args.command == "bench" and args.calibrate and args.device != "gpu"
    # before anything runs: the results of minutes of work must have somewhere to go
    problem = CALIBRATE_NEEDS_GPU if calibrate_on_cpu else _output_folder(args.output)
    created: list[str] = []
    if not problem:
        problem, created = _create_output(args.output)
    if problem:
        sys.stderr.write(f"{name}: error: {problem}\n")
        return 2
    try:
        return _run(args)
    except ValueError as error:  # bad input: a clear message, not a traceback
        sys.stderr.write(f"{name}: error: {error}\n")
        return 2
    except KeyboardInterrupt as stop:  # one line, not a traceback: what the command had saved when Ctrl-C came
        saved = getattr(stop, "saved", None) or "nothing had been measured yet, so nothing was saved"
        start = "\n" if sys.stderr.isatty() else ""  # (a terminal shows ^C without ending its line)
        sys.stderr.write(f"{start}{name}: interrupted (Ctrl-C): {saved}\n")
        return INTERRUPTED_STATUS
    finally:
        _remove_empty(created)  # the folder made above, when the command stopped before writing in it


def _run(args: argparse.Namespace) -> int:
    # The one import inside a function, on purpose: the commands import Paddle and ppdiffusers (seconds), which
    # ``--help`` and ``--version`` (answered by the parser above) must not wait for; tests/tools/test_cli.py checks it.
    from .bench import commands

    configure_logging()  # after Paddle's import, which puts a timestamped handler on the root logger
    run = {"demo": commands.run_demo, "bench": commands.run_bench}[args.command]
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

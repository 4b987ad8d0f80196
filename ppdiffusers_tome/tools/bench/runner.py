"""Running and timing: the :class:`Runner` measures a list of methods at one resolution and batch size (warm-up and
timed runs interleaved across methods, peak memory, fidelity to vanilla, plan reuse, operator counts) into
:class:`Cell` records; :func:`run_grid` does it for every cell of a grid. The ``demo`` command is one such cell, and
reads the decoded images and forward times it needs from :attr:`Runner.outputs`."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ContextManager

import numpy as np
import paddle

from ... import api
from ...tome.patch import find_blocks
from ..measure import ForwardTimer, OpCount, count_forward_ops, median, psnr, relative_l2
from .devices import Device, default_device, is_out_of_memory
from .inputs import DenoiserInputs, pipeline_kwargs
from .methods import BenchSettings, Method, NotSupported, configure, method_list

logger = logging.getLogger(__name__)

# the start of the step cache's warning when a pipeline call cached nothing (step_cache.StepCache.run_finished):
# every run re-applies the cache, so the runner says it once per configuration, as a plain log line
ALL_FULL_WARNING = "The step cache on "


@dataclass
class Cell:
    """The numbers of one method at one resolution and batch size, as written to ``results.json``."""

    resolution: int
    batch: int
    method: str
    ratio: float
    label: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"  # ok | OOM | n/a
    reason: str = ""
    seconds_per_image: float | None = None
    unet_seconds: float | None = None
    speedup: float | None = None
    peak_memory_bytes: int | None = None
    added_memory_bytes: int | None = None
    memory_kind: str = ""
    psnr_db: float | None = None
    rel_l2: float | None = None
    fraction_of_bound: float | None = None
    plans_reused_share: float | None = None  # of the merge plans in one call, the share taken from the cache
    runs_seconds: list[float] = field(default_factory=list)
    ops: int | None = None  # eager operators of one denoiser forward (counted once, outside the timed runs)
    merging_blocks: int | None = None  # transformer blocks that ran on fewer tokens in that forward
    ops_per_block: float | None = None  # (ops - vanilla's ops) / merging_blocks
    attention: str = ""  # attention processor the cell ran with
    # sub-layer calls of the last timed run that ran on merged (or, with ToDo, downsampled) tokens; 0: the
    # configuration merged nothing, so it computed exactly what vanilla computes; None: not counted (vanilla, or a
    # method that is not this package's patch, such as ppdiffusers' built-in port)
    merges: int | None = None


@dataclass
class RunOutputs:
    """What the timed runs of one method leave beside its :class:`Cell`: the UNet forward times of each run (the
    first forward of a run left out: it pays one-off set-up), the memory window with the highest peak, and the
    first noise prediction and decoded images (``None`` with ``unet_only``) of the last run."""

    forward_seconds: list[list[float]] = field(default_factory=list)
    memory: Any = None
    noise: np.ndarray | None = None
    images: np.ndarray | None = None


def denoiser(pipe):
    """The model a pipeline calls once per step: its ``unet``, or its ``transformer`` (SD3, DiT, PixArt); None
    when it has neither."""
    unet = getattr(pipe, "unet", None)
    return unet if unet is not None else getattr(pipe, "transformer", None)


def attention_processor(pipe) -> str:
    """The attention processor of the UNet's first transformer block (with its ``attention_op`` when it has one),
    e.g. ``"XFormersAttnProcessor(op=None)"`` on a GPU build, ``"AttnProcessor"`` on CPU."""
    blocks = find_blocks(denoiser(pipe))
    processor = getattr(getattr(blocks[0][1], "attn1", None), "processor", None) if blocks else None
    if processor is None:
        return ""
    name = type(processor).__name__
    return f"{name}(op={processor.attention_op})" if hasattr(processor, "attention_op") else name


class Runner:
    """Measures one pipeline across the grid.

    ``progress`` is called after every run (a grid's progress bar); ``around_run(method, repeat)`` returns a
    context manager entered around every run (``repeat`` counts from 0, warm-up runs first), e.g. the demo's bar
    of denoising steps; ``on_round(cells, timed_runs)`` is called after every round of timed runs but the last
    (each method once more; after the last, :meth:`run_cell` returns the cells) with the cells as they stand after
    ``timed_runs`` runs each (copies, finished as at the end), so a command can save what it measures while it
    measures it. After :meth:`run_cell`, :attr:`outputs` holds each
    method's :class:`RunOutputs`."""

    def __init__(self, pipe, settings: BenchSettings, progress: Callable[[], None] | None = None,
                 device: Device | None = None,
                 around_run: Callable[[Method, int], ContextManager[Any]] | None = None,
                 on_round: Callable[[list[Cell], int], None] | None = None):
        self.pipe = pipe
        self.settings = settings
        self.progress = progress or (lambda: None)
        self.device = device if device is not None else default_device()
        self.around_run = around_run or (lambda method, repeat: contextlib.nullcontext())
        self.on_round = on_round
        self.outputs: dict[str, RunOutputs] = {}
        self._said_all_full: set[str] = set()  # configurations whose step cache cached nothing, already logged
        self._inputs_key: tuple[int, int] | None = None
        self._inputs_cache: DenoiserInputs | None = None

    def _measure_once(self, size: int, batch: int) -> dict[str, Any]:
        pipe, s, device = self.pipe, self.settings, self.device
        first_output: list[paddle.Tensor] = []

        def capture(layer, args, output):
            if not first_output:  # a device copy now, read back to the host after the timed window
                sample = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
                first_output.append(sample.clone())

        before = self._plan_counts()
        inputs = self._inputs(size, batch) if s.unet_only else None  # built outside the timed window
        call = None if s.unet_only else pipeline_kwargs(pipe, size, batch, s.steps, s.seed, s.prompt, s.guidance_scale)
        timer = ForwardTimer(denoiser(pipe), synchronize=device.synchronize)
        handle = denoiser(pipe).register_forward_post_hook(capture)
        try:
            with device.memory() as mem:
                device.synchronize()
                start = time.perf_counter()
                if inputs is not None:
                    with paddle.no_grad():
                        inputs.run()
                    image = None
                else:
                    image = pipe(**call).images
                device.synchronize()  # queued kernels belong to this run
                seconds = time.perf_counter() - start
        finally:
            handle.remove()
            timer.remove()
        after = self._plan_counts()
        computed, reused = after[0] - before[0], after[1] - before[1]
        merges = None if after[2] is None or before[2] is None else after[2] - before[2]
        noise = first_output[0].astype("float32").numpy().astype(np.float64) if first_output else None
        return dict(
            seconds=seconds,
            reused_share=reused / (computed + reused) if computed + reused else None,
            merges=merges,
            forward_seconds=timer.seconds[1:] or timer.seconds,
            memory=mem,
            noise=noise,
            image=None if image is None else np.asarray(image, dtype=np.float64),
        )

    def _count_ops(self, size: int, batch: int) -> OpCount:
        """Eager operators of one denoiser forward in the configuration in place, and the blocks that merged in
        it. Runs right after a measured run of the same configuration, so the model is warm."""
        inputs = self._inputs(size, batch)
        models = [model for _, model in api.tome_models(self.pipe)]

        def run():
            with paddle.no_grad():
                return inputs.run()

        return count_forward_ops(run, models, warmup=0)

    def _plan_counts(self) -> tuple[int, int, int | None]:
        """Plans computed and reused, and sub-layer merges (``None`` when no model carries this package's patch)."""
        stats = list(api.tome_stats(self.pipe).values())
        merges = sum(v["merges"] for v in stats) if stats else None
        return sum(v["plans_computed"] for v in stats), sum(v["plans_reused"] for v in stats), merges

    def _inputs(self, size: int, batch: int) -> DenoiserInputs:
        key = (size, batch)
        if self._inputs_key != key:
            self._inputs_cache, self._inputs_key = DenoiserInputs(self.pipe, size, batch, self.settings.seed), key
        return self._inputs_cache

    def run_cell(self, size: int, batch: int, methods: list[Method]) -> list[Cell]:
        """Measure ``methods`` at ``size`` px with ``batch`` images per call: ``warmup`` then ``repeats`` runs of
        each, interleaved (drift on a shared machine hits every method alike). Out of memory ends a method's runs
        with status ``OOM``, a missing kernel with ``n/a``; any other error propagates."""
        s = self.settings
        cells = {m.label: Cell(size, batch, m.name, m.ratio, m.label, _cell_options(m)) for m in methods}
        self.outputs = {}
        for repeat in range(s.warmup + s.repeats):
            for method in methods:
                cell = cells[method.label]
                if cell.status == "ok":
                    self._run_method(cell, method, repeat)
                self.progress()
            if self.on_round is not None and s.warmup <= repeat < s.warmup + s.repeats - 1:  # (the last: returned)
                self.on_round(self._finished_copy(cells, batch), repeat - s.warmup + 1)
        self._finish(cells, batch)
        return list(cells.values())

    def _finished_copy(self, cells: dict[str, Cell], batch: int) -> list[Cell]:
        """The cells as :meth:`_finish` would leave them now, as copies (the runs go on in ``cells``)."""
        copied = copy.deepcopy(cells)
        self._finish(copied, batch)
        return list(copied.values())

    def _run_method(self, cell: Cell, method: Method, repeat: int) -> None:
        """One run of ``method`` into ``cell`` (and :attr:`outputs` when it is a timed run)."""
        s, size, batch = self.settings, cell.resolution, cell.batch
        try:
            configure(self.pipe, method, s.max_downsample)
            with self.around_run(method, repeat), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = self._measure_once(size, batch)
            self._pass_on(caught, method.label)
        except NotSupported as error:
            cell.status, cell.reason = "n/a", str(error)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            cell.status, cell.reason = "OOM", str(error).splitlines()[0][:200] if str(error) else "MemoryError"
            logger.warning("%s at %dpx batch %d: out of memory", method.label, size, batch)
        else:
            logger.info("%dpx batch %d %-18s %s %d: %.2f s", size, batch, method.label,
                        "warm-up" if repeat < s.warmup else "run", repeat + 1, result["seconds"])
            cell.attention = attention_processor(self.pipe)
            if repeat >= s.warmup:
                self._keep(cell, result)
            if repeat == s.warmup + s.repeats - 1 and s.count_ops:  # once, after the last timed run
                self._count_cell_ops(cell, size, batch)
        finally:
            api.remove_tome(self.pipe)

    def _pass_on(self, caught: list[warnings.WarningMessage], label: str) -> None:
        """Warnings of one run, passed on as they came, except the step cache's "cached nothing": once per
        configuration, as a log line."""
        for warning in caught:
            text = str(warning.message)
            if issubclass(warning.category, UserWarning) and text.startswith(ALL_FULL_WARNING):
                if label not in self._said_all_full:
                    self._said_all_full.add(label)
                    logger.warning("%s: %s", label, text)
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)

    def _keep(self, cell: Cell, result: dict[str, Any]) -> None:
        cell.runs_seconds.append(result["seconds"])
        cell.plans_reused_share = result["reused_share"]
        cell.merges = result["merges"]
        kept = self.outputs.setdefault(cell.label, RunOutputs())
        kept.forward_seconds.append(result["forward_seconds"])
        if kept.memory is None or result["memory"].peak_bytes > kept.memory.peak_bytes:
            kept.memory = result["memory"]
        kept.noise, kept.images = result["noise"], result["image"]

    def _count_cell_ops(self, cell: Cell, size: int, batch: int) -> None:
        try:
            counted = self._count_ops(size, batch)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            logger.warning("%s at %dpx batch %d: out of memory while counting operators", cell.label, size, batch)
            return
        cell.ops, cell.merging_blocks = counted.total, counted.merging_blocks

    def _finish(self, cells: dict[str, Cell], batch: int) -> None:
        vanilla = cells.get("vanilla")
        ref = self.outputs.get("vanilla")
        for label, cell in cells.items():
            kept = self.outputs.get(label)
            if cell.status != "ok" or kept is None:
                continue
            cell.seconds_per_image = median(cell.runs_seconds) / batch
            cell.unet_seconds = median([median(run) for run in kept.forward_seconds])
            cell.peak_memory_bytes = int(kept.memory.peak_bytes)
            cell.added_memory_bytes = int(kept.memory.added_bytes)
            cell.memory_kind = kept.memory.kind
            if vanilla is not None and vanilla.status == "ok" and ref is not None:
                cell.speedup = median(vanilla.runs_seconds) / median(cell.runs_seconds)
                if ref.noise is not None and kept.noise is not None:
                    cell.rel_l2 = relative_l2(ref.noise, kept.noise)
                if ref.images is not None and kept.images is not None:
                    cell.psnr_db = psnr(ref.images, kept.images)
            if cell.ops is not None and vanilla is not None and vanilla.ops is not None and cell.merging_blocks:
                cell.ops_per_block = (cell.ops - vanilla.ops) / cell.merging_blocks
        for cell in cells.values():
            bound = cells.get(f"bound@{cell.ratio:g}")
            if cell.method in ("tome", "tome-efficient", "builtin") and bound is not None:
                if cell.status == "ok" and bound.status == "ok":
                    cell.fraction_of_bound = median(bound.runs_seconds) / median(cell.runs_seconds)


def run_grid(pipe, settings: BenchSettings, progress: Callable[[], None] | None = None,
             device: Device | None = None, on_cells: Callable[[list[Cell]], None] | None = None) -> list[Cell]:
    """Measure every resolution x batch x method cell of ``settings`` on ``pipe`` (``device``: see
    :func:`~ppdiffusers_tome.tools.bench.select_device`; default Paddle's current device). ``on_cells`` is
    called with every cell finished so far each time a resolution x batch is finished (to save them as they
    come: a long grid interrupted keeps what it measured)."""
    methods = method_list(settings)
    runner = Runner(pipe, settings, progress, device)
    cells: list[Cell] = []
    for size in settings.resolutions:
        for batch in settings.batch_sizes:
            cells.extend(runner.run_cell(size, batch, methods))
            if on_cells is not None:
                on_cells(list(cells))
    return cells


def grid_steps(settings: BenchSettings) -> int:
    """Measurements in a grid, for a progress bar."""
    per_cell = len(method_list(settings)) * (settings.warmup + settings.repeats)
    return per_cell * len(settings.resolutions) * len(settings.batch_sizes)


def _cell_options(method: Method) -> dict:
    """What a cell records besides its method and ratio: the ``apply_tome`` options, and ``cache`` (the
    ``apply_cache`` options) when a step cache is on."""
    options = dict(method.options)
    if method.cache is not None:
        options["cache"] = dict(method.cache)
    return options

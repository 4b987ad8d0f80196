"""The ``bench`` command's engine: a grid of resolutions x batch sizes x methods, measured side by side in one
process. The ``demo`` command runs the same engine at one resolution.

Methods (``--methods``):

* ``vanilla`` — the unpatched pipeline;
* ``tome`` — this package at every ``--ratios`` value;
* ``tome-efficient`` — ToMe plus Paddle's memory-efficient attention, where the device has it (else ``n/a``);
* ``todo`` / ``todo-efficient`` — ToDo (keys and values downsampled, ``method="todo"``), without/with it;
* ``builtin`` — ppdiffusers' own port (``--compare-builtin`` adds it);
* ``bound`` — the zero-overhead bound: each block that ToMe would merge runs its attention on its first
  ``N - r`` tokens (``r = int(N * ratio)``) and pads the output back with zeros, with no matching at all. It ruins
  images; it is the speed ceiling of any token-merging scheme at that ratio, and ToMe's speed is reported as a
  fraction of it.

Every cell records seconds per image (whole pipeline call) and per UNet forward, speed-up against vanilla, peak
memory, and fidelity against vanilla with the same seed (PSNR of the decoded image, relative L2 of the first noise
prediction). With ``--unet-only`` the cell is one denoiser forward on fixed random inputs instead of a pipeline
call. Out-of-memory is caught and reported as ``OOM`` in its cell; the grid goes on.

Each cell also counts, on one extra denoiser forward after its timed runs, the eager operators the method adds per
merging block over vanilla (``ops/block``, with ``paddle.profiler``; see :func:`ppdiffusers_tome.tools.measure.count_ops`).

``--device gpu`` runs on a CUDA build of PaddlePaddle (``paddlepaddle-gpu``) and refuses at once on any other build.
There every timed run is bracketed by ``paddle.device.synchronize()`` and the memory is
``paddle.device.cuda.max_memory_allocated()`` after ``reset_max_memory_allocated()``. Where ppdiffusers finds Paddle's
memory-efficient attention (GPU builds), its default attention processor already calls
``scaled_dot_product_attention_`` (flash attention in half precision, else cutlass), so every method runs with it;
each cell records its processor. The device functions sit in one object (:class:`CudaDevice`) that tests replace.

Speed-ups are reported honestly: one from a single timed run (``--repeats 1``) says ``(1 run)``; a resolution x
batch whose timed runs spread by more than 25% gets the demo's warning; and a configuration that merged nothing
(:func:`merges_nothing`, e.g. ``max_downsample=1`` on SDXL) is vanilla's twin: its speed-up reads ``= vanilla`` and
it takes no place of its own on the Pareto front, whatever its timing says.

``--variants`` adds configurations beyond the plain methods, each ``name:option=value,...`` with ``apply_tome``
options, for example ``tome:recompute_every=5``, ``tome:ratio=(0.6,0.3)`` or
``todo:downsample_factor=4,downsample_mode=average``. A ``tome`` variant without its own ``ratio`` runs at every
``--ratios`` value. :func:`format_pareto` ranks everything by speed-up against fidelity.

Modules, one job each:

* :mod:`~ppdiffusers_tome.tools.bench.methods` — what to measure: methods, variants, settings, putting a method in place;
* :mod:`~ppdiffusers_tome.tools.bench.devices` — ``--device``: synchronising and peak memory on CPU and GPU;
* :mod:`~ppdiffusers_tome.tools.bench.inputs` — pipeline-call arguments and fixed denoiser inputs;
* :mod:`~ppdiffusers_tome.tools.bench.runner` — running and timing the cells (:class:`Runner`, :func:`run_grid`);
* :mod:`~ppdiffusers_tome.tools.bench.timesplit` — attention / matching / rest of one denoiser forward;
* :mod:`~ppdiffusers_tome.tools.bench.report` — text tables, Pareto front, noise warnings, ``results.json``;
* :mod:`~ppdiffusers_tome.tools.bench.plots` — the PNG plots (matplotlib);
* :mod:`~ppdiffusers_tome.tools.bench.demo` — the demo's rows, table, legend, image grid and noise warning;
* :mod:`~ppdiffusers_tome.tools.bench.commands` — the ``demo``/``bench``/``figure`` commands (imported by the CLI when it
  runs one; not imported here).
"""

from .devices import (
    DEVICES,
    CpuDevice,
    CudaDevice,
    Device,
    DeviceMemory,
    DeviceUnavailable,
    default_device,
    is_out_of_memory,
    select_device,
)
from .inputs import DenoiserInputs, control_image, pipeline_kwargs
from .methods import (
    ALL_METHODS,
    BenchSettings,
    BoundPatch,
    Method,
    NotSupported,
    TruncationPlan,
    builtin_level,
    config_kwargs,
    configure,
    method_list,
    parse_variant,
    set_efficient_attention,
)
from .plots import write_pareto_plot, write_plots
from .report import (
    effective_speedup,
    format_details,
    format_grid_table,
    format_pareto,
    format_time_split,
    load_cells,
    merges_nothing,
    noise_warnings,
    pareto_front,
    record,
    save_json,
    single_run_note,
    speedup_text,
    spread_warning,
)
from .runner import Cell, Runner, RunOutputs, attention_processor, grid_steps, run_grid
from .timesplit import SplitClock, time_split

__all__ = [
    "ALL_METHODS",
    "DEVICES",
    "BenchSettings",
    "BoundPatch",
    "Cell",
    "CpuDevice",
    "CudaDevice",
    "DenoiserInputs",
    "Device",
    "DeviceMemory",
    "DeviceUnavailable",
    "Method",
    "NotSupported",
    "RunOutputs",
    "Runner",
    "SplitClock",
    "TruncationPlan",
    "attention_processor",
    "builtin_level",
    "config_kwargs",
    "configure",
    "control_image",
    "default_device",
    "effective_speedup",
    "format_details",
    "format_grid_table",
    "format_pareto",
    "format_time_split",
    "grid_steps",
    "is_out_of_memory",
    "load_cells",
    "merges_nothing",
    "method_list",
    "noise_warnings",
    "pareto_front",
    "parse_variant",
    "pipeline_kwargs",
    "record",
    "run_grid",
    "save_json",
    "select_device",
    "set_efficient_attention",
    "single_run_note",
    "speedup_text",
    "spread_warning",
    "time_split",
    "write_pareto_plot",
    "write_plots",
]

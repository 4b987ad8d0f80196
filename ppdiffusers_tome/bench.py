"""The ``bench`` command: a grid of resolutions x batch sizes x methods, measured side by side in one process.

Methods (``--methods``):

* ``vanilla`` — the unpatched pipeline;
* ``tome`` — this package at every ``--ratios`` value;
* ``tome-efficient`` — ToMe plus Paddle's memory-efficient attention, where the device has it (else ``n/a``);
* ``todo`` / ``todo-efficient`` — ToDo (keys and values downsampled, ``method="todo"``), without/with it;
* ``builtin`` — ppdiffusers' own port (``--compare-builtin`` adds it);
* ``bound`` — the zero-overhead bound: each block that ToMe would merge runs its attention on its first
  ``N - r`` tokens (``r = int(N * ratio)``) and pads the output back with zeros, with no matching at all. It ruins images; it is the speed
  ceiling of any token-merging scheme at that ratio, and ToMe's speed is reported as a fraction of it.

Every cell records seconds per image (whole pipeline call) and per UNet forward, speed-up against vanilla, peak
memory, and fidelity against vanilla with the same seed (PSNR of the decoded image, relative L2 of the first noise
prediction). With ``--unet-only`` the cell is one denoiser forward on fixed random inputs instead of a pipeline
call. Out-of-memory is caught and reported as ``OOM`` in its cell; the grid goes on.

Each cell also counts, on one extra denoiser forward after its timed runs, the eager operators the method adds per
merging block over vanilla (``ops/block``, with ``paddle.profiler``; see :func:`ppdiffusers_tome.measure.count_ops`).

``--device gpu`` runs on a CUDA build of PaddlePaddle (``paddlepaddle-gpu``) and refuses at once on any other build.
There every timed run is bracketed by ``paddle.device.synchronize()`` and the memory is
``paddle.device.cuda.max_memory_allocated()`` after ``reset_max_memory_allocated()``. Where ppdiffusers finds Paddle's
memory-efficient attention (GPU builds), its default attention processor already calls
``scaled_dot_product_attention_`` (flash attention in half precision, else cutlass), so every method runs with it;
each cell records its processor. The device functions sit in one object (:class:`CudaDevice`) that tests replace.

``--variants`` adds configurations beyond the plain methods, each ``name:option=value,...`` with ``apply_tome``
options, for example ``tome:recompute_every=5``, ``tome:ratio=(0.6,0.3)`` or
``todo:downsample_factor=4,downsample_mode=average``. A ``tome`` variant without its own ``ratio`` runs at every
``--ratios`` value. :func:`format_pareto` ranks everything by speed-up against fidelity.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import paddle

from . import api
from .config import ToMeConfig
from .measure import (
    ForwardTimer,
    OpCount,
    PeakMemory,
    count_forward_ops,
    environment,
    format_table as render,
    median,
    on_gpu,
    psnr,
    relative_l2,
)
from .patch import ModelPatch, find_blocks, get_patch

logger = logging.getLogger(__name__)

ALL_METHODS = ("vanilla", "tome", "tome-efficient", "todo", "todo-efficient", "builtin", "bound")
_RATIO_FREE = ("vanilla", "todo", "todo-efficient")  # methods that do not run once per --ratios value
_APPLIED = ("tome", "tome-efficient", "todo", "todo-efficient")  # methods that are this package's apply_tome
_SHORT_OPTION = {"downsample_factor": "f", "downsample_mode": "mode", "recompute_every": "k", "max_downsample": "level"}


# the zero-overhead bound ------------------------------------------------------------------------------------------
class TruncationPlan:
    """Keep the first ``N - r`` tokens, pad the output back with zeros: the cost of running attention on fewer
    tokens with no matching at all. Same interface as :class:`ppdiffusers_tome.merge.MergePlan`."""

    def __init__(self, num_tokens: int, batch_size: int, r: int):
        self.num_tokens, self.batch_size, self.r = num_tokens, batch_size, r

    @property
    def is_identity(self) -> bool:
        return self.r <= 0

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        return x[:, : self.num_tokens - self.r]

    def unmerge(self, y: paddle.Tensor) -> paddle.Tensor:
        pad = paddle.zeros([y.shape[0], self.r, y.shape[2]], dtype=y.dtype)
        return paddle.concat([y, pad], axis=1)


class BoundPatch(ModelPatch):
    """ToMe's hooks and level selection, with the matching replaced by :class:`TruncationPlan`."""

    def make_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, r: int) -> TruncationPlan:
        return TruncationPlan(hidden.shape[1], hidden.shape[0], r)


# devices ---------------------------------------------------------------------------------------------------------
class DeviceUnavailable(ValueError):
    """``--device`` names a device this PaddlePaddle build cannot use."""


class CpuDevice:
    """What the benchmark needs from the CPU: nothing to wait for, and the peak resident set size as memory."""

    name = "cpu"
    memory_kind = "cpu_peak_rss"

    def synchronize(self) -> None:
        """Nothing is queued on the CPU: kernels have finished when they return."""

    def memory(self) -> PeakMemory:
        """A window measuring the peak memory of what runs inside it."""
        return PeakMemory()


class _DeviceMemory:
    """Peak device memory of a ``with`` window, from the functions of a :class:`CudaDevice` (same fields as
    :class:`ppdiffusers_tome.measure.PeakMemory`)."""

    def __init__(self, device: "CudaDevice"):
        self.device = device
        self.kind = device.memory_kind
        self.baseline_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> "_DeviceMemory":
        self.device.synchronize()
        self.device.reset_peak()
        self.baseline_bytes = int(self.device.allocated())
        return self

    def __exit__(self, *exc) -> None:
        self.device.synchronize()
        self.peak_bytes = int(self.device.max_memory())

    @property
    def added_bytes(self) -> int:
        return max(self.peak_bytes - self.baseline_bytes, 0)


class CudaDevice:
    """What the benchmark needs from a CUDA GPU, as replaceable functions: ``synchronize`` (wait for queued
    kernels; called before and after every timed run and around every timed UNet forward), ``reset_peak``,
    ``max_memory`` and ``allocated`` (Paddle's allocator statistics, in bytes). The defaults are Paddle's; a test
    passes its own to check the GPU branch on a CPU build."""

    name = "gpu"
    memory_kind = "gpu_max_allocated"

    def __init__(
        self,
        synchronize: Optional[Callable[[], Any]] = None,
        reset_peak: Optional[Callable[[], Any]] = None,
        max_memory: Optional[Callable[[], int]] = None,
        allocated: Optional[Callable[[], int]] = None,
    ):
        cuda = paddle.device.cuda
        self._synchronize = synchronize or paddle.device.synchronize
        self.reset_peak = reset_peak or cuda.reset_max_memory_allocated
        self.max_memory = max_memory or cuda.max_memory_allocated
        self.allocated = allocated or cuda.memory_allocated

    def synchronize(self) -> None:
        self._synchronize()

    def memory(self) -> _DeviceMemory:
        return _DeviceMemory(self)


Device = Any  # CpuDevice, CudaDevice or an object with the same methods

DEVICES = ("cpu", "gpu")


def select_device(name: str) -> Device:
    """Make ``name`` (``"cpu"`` or ``"gpu"``) Paddle's current device and return the benchmark's view of it.

    ``"gpu"`` raises :class:`DeviceUnavailable` at once, before anything is built, unless this is a CUDA build of
    PaddlePaddle that sees a GPU."""
    if name not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}; got {name!r}")
    if name == "cpu":
        paddle.set_device("cpu")
        return CpuDevice()
    if not paddle.is_compiled_with_cuda():
        raise DeviceUnavailable(
            f"--device gpu needs a CUDA build of PaddlePaddle, but this one (paddle {paddle.__version__}) is CPU-only "
            "(paddle.is_compiled_with_cuda() is False). Install paddlepaddle-gpu for your CUDA version "
            "(https://www.paddlepaddle.org.cn/install/quick) in place of paddlepaddle, or run with --device cpu."
        )
    count = paddle.device.cuda.device_count()
    if count < 1:
        raise DeviceUnavailable(
            "--device gpu: this PaddlePaddle is a CUDA build but sees no GPU (paddle.device.cuda.device_count() is "
            "0); check the NVIDIA driver and CUDA_VISIBLE_DEVICES, or run with --device cpu."
        )
    paddle.set_device("gpu")
    return CudaDevice()


def default_device() -> Device:
    """The benchmark's view of Paddle's current device, without changing it."""
    return CudaDevice() if on_gpu() else CpuDevice()


def attention_processor(pipe) -> str:
    """The attention processor of the UNet's first transformer block (with its ``attention_op`` when it has one),
    e.g. ``"XFormersAttnProcessor(op=None)"`` on a GPU build, ``"AttnProcessor"`` on CPU."""
    blocks = find_blocks(pipe.unet)
    processor = getattr(getattr(blocks[0][1], "attn1", None), "processor", None) if blocks else None
    if processor is None:
        return ""
    name = type(processor).__name__
    return f"{name}(op={processor.attention_op})" if hasattr(processor, "attention_op") else name


# methods ---------------------------------------------------------------------------------------------------------
@dataclass
class Method:
    """One configuration to measure: a method name, its ratio and extra ``apply_tome`` options."""

    name: str
    ratio: float = 0.0
    options: Dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        label = self.name if self.name in _RATIO_FREE or "ratio" in self.options else f"{self.name}@{self.ratio:g}"
        if self.options:
            parts = []
            for key, value in self.options.items():
                text = "-".join(f"{v:g}" for v in value) if isinstance(value, tuple) else str(value)
                parts.append(f"{_SHORT_OPTION.get(key, key)}={text}".replace(" ", ""))
            label += "[" + ",".join(parts) + "]"
        return label


def _split_top_level(text: str) -> List[str]:
    """Split ``a=1,b=(2,3)`` at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_variant(text: str) -> Method:
    """``"todo:downsample_factor=4,downsample_mode=average"`` -> a :class:`Method` with those options (validated
    by :class:`ToMeConfig`). Values are Python literals; bare words are strings.

    >>> parse_variant("tome:recompute_every=5,ratio=(0.6,0.3)").label
    'tome[k=5,ratio=0.6-0.3]'
    """
    name, _, rest = text.partition(":")
    name = name.strip()
    if name not in _APPLIED:
        raise ValueError(f"--variants: the method before ':' must be tome, tome-efficient, todo or todo-efficient; got {text!r}")
    options: Dict[str, Any] = {}
    for item in _split_top_level(rest):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--variants: expected option=value in {text!r}; got {item!r}")
        if key == "method" or key not in ToMeConfig.__dataclass_fields__:
            allowed = sorted(set(ToMeConfig.__dataclass_fields__) - {"method"})
            raise ValueError(f"--variants: unknown option {key!r} in {text!r}; options are {', '.join(allowed)}")
        try:
            options[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key] = value.strip()
        if isinstance(options[key], list):
            options[key] = tuple(options[key])
    method = Method(name, float(options["ratio"]) if isinstance(options.get("ratio"), (int, float)) else 0.0, options)
    ToMeConfig(**_config_kwargs(method))  # validate now, not after minutes of vanilla runs
    return method


def _config_kwargs(method: Method, max_downsample: Any = "auto") -> Dict[str, Any]:
    kwargs: Dict[str, Any] = dict(max_downsample=max_downsample)
    if method.name.startswith("todo"):
        kwargs["method"] = "todo"
    else:
        kwargs["ratio"] = method.ratio
    kwargs.update(method.options)
    return kwargs


def builtin_level(pipe, max_downsample: Any) -> int:
    """The integer level ppdiffusers' built-in port needs for ``max_downsample`` (it has no ``"auto"``): 2 for
    SDXL-style UNets (no attention at the first level), else 1."""
    if max_downsample != "auto":
        return int(max_downsample)
    return 2 if getattr(pipe.unet.config, "addition_embed_type", None) == "text_time" else 1


class NotSupported(Exception):
    """The method cannot run on this device (reported as ``n/a`` in its cell)."""


def configure(pipe, method: Method, max_downsample: Any) -> None:
    """Put ``pipe`` in the state that ``method`` measures."""
    api.remove_tome(pipe)
    _set_efficient_attention(pipe, False)
    if method.name == "vanilla":
        return
    if method.name in _APPLIED:
        api.apply_tome(pipe, **_config_kwargs(method, max_downsample))
        if method.name.endswith("-efficient"):
            _set_efficient_attention(pipe, True)
    elif method.name == "builtin":
        for _, model in api._targets(pipe, for_apply=True):
            paddle.nn.Layer.apply_tome(model, ratio=method.ratio, max_downsample=builtin_level(pipe, max_downsample))
    elif method.name == "bound":
        config = ToMeConfig(ratio=method.ratio, max_downsample=max_downsample, use_rand=False)
        for _, model in api._targets(pipe, for_apply=True):
            BoundPatch.install(model, config)
    else:
        raise ValueError(f"method must be one of {ALL_METHODS}; got {method.name!r}")


def _set_efficient_attention(pipe, enabled: bool) -> None:
    if enabled:
        try:
            pipe.enable_xformers_memory_efficient_attention()
        except (NotImplementedError, ValueError, RuntimeError) as error:
            pipe.disable_xformers_memory_efficient_attention()
            raise NotSupported(f"efficient attention unavailable: {str(error).splitlines()[0][:120]}") from error
    else:
        try:
            pipe.disable_xformers_memory_efficient_attention()
        except Exception:  # pragma: no cover - pipelines without attention processors
            pass


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    text = f"{type(error).__name__} {error}".lower()
    return any(k in text for k in ("out of memory", "resourceexhausted", "cannot allocate", "bad_alloc"))


# inputs ------------------------------------------------------------------------------------------------------------
def _control_image(size: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.uniform(0, 1, (size // 8 + 1, size // 8 + 1, 3)) > 0.5).astype("uint8") * 255
    return Image.fromarray(pixels).resize((size, size), Image.NEAREST)


def _pipeline_kwargs(pipe, size: int, batch: int, steps: int, seed: int, prompt: str) -> Dict[str, Any]:
    kwargs = dict(
        prompt=[prompt] * batch,
        num_inference_steps=steps,
        height=size,
        width=size,
        generator=paddle.Generator().manual_seed(seed),
        output_type="np",
    )
    if "controlnet" in pipe.components and pipe.components["controlnet"] is not None:
        controlnet = pipe.components["controlnet"]
        count = len(controlnet.nets) if hasattr(controlnet, "nets") else 1
        image = _control_image(size, seed)
        kwargs["image"] = [image] * count if count > 1 else image
    return kwargs


class DenoiserInputs:
    """Fixed random inputs for one denoiser forward (UNet, plus ControlNet or SDXL conditioning when present),
    shaped as a pipeline with classifier-free guidance would pass them for ``batch`` images."""

    def __init__(self, pipe, size: int, batch: int, seed: int):
        rng = np.random.default_rng(seed)
        unet = self.unet = pipe.unet
        factor = getattr(pipe, "vae_scale_factor", 8)
        rows = 2 * batch
        dtype = unet.dtype if hasattr(unet, "dtype") else paddle.float32

        def tensor(*shape):
            return paddle.to_tensor(rng.standard_normal(shape).astype("float32")).astype(dtype)

        self.sample = tensor(rows, unet.config.in_channels, size // factor, size // factor)
        self.timestep = paddle.to_tensor([500] * rows, dtype="int64")
        self.context = tensor(rows, 77, unet.config.cross_attention_dim)
        self.unet_kwargs: Dict[str, Any] = {}
        if getattr(unet.config, "addition_embed_type", None) == "text_time":
            proj = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
            time_ids = paddle.to_tensor([[size, size, 0, 0, size, size]] * rows, dtype="float32").astype(dtype)
            self.unet_kwargs["added_cond_kwargs"] = {"text_embeds": tensor(rows, proj), "time_ids": time_ids}
        self.controlnet = pipe.components.get("controlnet")
        if self.controlnet is not None:
            self.cond = tensor(rows, 3, size, size)

    def run(self):
        kwargs = dict(self.unet_kwargs)
        if self.controlnet is not None:
            nets = list(self.controlnet.nets) if hasattr(self.controlnet, "nets") else [self.controlnet]
            down, mid = None, None
            for net in nets:
                d, m = net(self.sample, self.timestep, self.context, controlnet_cond=self.cond, return_dict=False)
                down = d if down is None else [a + b for a, b in zip(down, d)]
                mid = m if mid is None else mid + m
            kwargs.update(down_block_additional_residuals=down, mid_block_additional_residual=mid)
        return self.unet(self.sample, self.timestep, self.context, **kwargs)


# one cell ----------------------------------------------------------------------------------------------------------
@dataclass
class Cell:
    resolution: int
    batch: int
    method: str
    ratio: float
    label: str = ""
    options: Dict[str, Any] = field(default_factory=dict)
    status: str = "ok"  # ok | OOM | n/a
    reason: str = ""
    seconds_per_image: Optional[float] = None
    unet_seconds: Optional[float] = None
    speedup: Optional[float] = None
    peak_memory_bytes: Optional[int] = None
    added_memory_bytes: Optional[int] = None
    memory_kind: str = ""
    psnr_db: Optional[float] = None
    rel_l2: Optional[float] = None
    fraction_of_bound: Optional[float] = None
    plans_reused_share: Optional[float] = None  # of the merge plans in one call, the share taken from the cache
    runs_seconds: List[float] = field(default_factory=list)
    ops: Optional[int] = None  # eager operators of one denoiser forward (counted once, outside the timed runs)
    merging_blocks: Optional[int] = None  # transformer blocks that ran on fewer tokens in that forward
    ops_per_block: Optional[float] = None  # (ops - vanilla's ops) / merging_blocks
    attention: str = ""  # attention processor the cell ran with


@dataclass
class BenchSettings:
    resolutions: Sequence[int] = (512,)
    batch_sizes: Sequence[int] = (1,)
    ratios: Sequence[float] = (0.5,)
    methods: Sequence[str] = ("vanilla", "tome")
    variants: Sequence[str] = ()
    steps: int = 20
    repeats: int = 3
    warmup: int = 1
    max_downsample: Any = "auto"
    unet_only: bool = False
    seed: int = 0
    prompt: str = "a lighthouse on a cliff at sunset, detailed oil painting"
    count_ops: bool = True  # ops/block: one extra denoiser forward per cell and method, profiled


def method_list(settings: BenchSettings) -> List[Method]:
    methods = []
    for name in settings.methods:
        if name not in ALL_METHODS:
            raise ValueError(f"--methods must be among {ALL_METHODS}; got {name!r}")
        if name in _RATIO_FREE:
            methods.append(Method(name))
        else:
            methods.extend(Method(name, float(r)) for r in settings.ratios)
    for text in settings.variants:
        variant = parse_variant(text)
        across_steps = [k for k in ("recompute_every", "ratio") if k in variant.options and not
                        (k == "ratio" and isinstance(variant.options[k], (int, float)))]
        if settings.unet_only and across_steps:
            raise ValueError(
                f"--variants {text!r}: {' and '.join(across_steps)} act across denoising steps, which one denoiser "
                "forward (--unet-only) does not have; measure it with pipeline calls"
            )
        if variant.name.startswith("todo") or "ratio" in variant.options:
            methods.append(variant)
        else:
            methods.extend(Method(variant.name, float(r), dict(variant.options)) for r in settings.ratios)
    if not any(m.name == "vanilla" for m in methods):
        methods.insert(0, Method("vanilla"))  # every ratio is against vanilla
    unique: Dict[str, Method] = {}
    for method in methods:  # one cell per label: a variant equal to a plain method is measured once
        unique.setdefault(method.label, method)
    return list(unique.values())


class Runner:
    """Measures one pipeline across the grid."""

    def __init__(self, pipe, settings: BenchSettings, progress: Optional[Callable[[], None]] = None,
                 device: Optional[Device] = None):
        self.pipe = pipe
        self.settings = settings
        self.progress = progress or (lambda: None)
        self.device = device if device is not None else default_device()

    def _measure_once(self, size: int, batch: int) -> Dict[str, Any]:
        pipe, s, device = self.pipe, self.settings, self.device
        first_output: List[paddle.Tensor] = []

        def capture(layer, args, output):
            if not first_output:  # a device copy now, read back to the host after the timed window
                sample = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
                first_output.append(sample.clone())

        before = self._plan_counts()
        inputs = self._inputs(size, batch) if s.unet_only else None  # built outside the timed window
        call = None if s.unet_only else _pipeline_kwargs(pipe, size, batch, s.steps, s.seed, s.prompt)
        timer = ForwardTimer(pipe.unet, synchronize=device.synchronize)
        handle = pipe.unet.register_forward_post_hook(capture)
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
        computed, reused = (a - b for a, b in zip(self._plan_counts(), before))
        noise = first_output[0].astype("float32").numpy().astype(np.float64) if first_output else None
        return dict(
            seconds=seconds,
            reused_share=reused / (computed + reused) if computed + reused else None,
            unet_seconds=median(timer.seconds[1:] or timer.seconds),
            memory=mem,
            noise=noise,
            image=None if image is None else np.asarray(image, dtype=np.float64),
        )

    def _count_ops(self, size: int, batch: int) -> OpCount:
        """Eager operators of one denoiser forward in the configuration in place, and the blocks that merged in
        it. Runs right after a measured run of the same configuration, so the model is warm."""
        inputs = self._inputs(size, batch)
        models = [model for _, model in api._targets(self.pipe, for_apply=False)]

        def run():
            with paddle.no_grad():
                return inputs.run()

        return count_forward_ops(run, models, warmup=0)

    def _plan_counts(self) -> Tuple[int, int]:
        stats = api.tome_stats(self.pipe).values()
        return sum(v["plans_computed"] for v in stats), sum(v["plans_reused"] for v in stats)

    def _inputs(self, size: int, batch: int) -> DenoiserInputs:
        key = (size, batch)
        if getattr(self, "_inputs_key", None) != key:
            self._inputs_cache, self._inputs_key = DenoiserInputs(self.pipe, size, batch, self.settings.seed), key
        return self._inputs_cache

    def run_cell(self, size: int, batch: int, methods: List[Method]) -> List[Cell]:
        s = self.settings
        cells = {m.label: Cell(size, batch, m.name, m.ratio, m.label, dict(m.options)) for m in methods}
        best: Dict[str, Dict[str, Any]] = {}
        for repeat in range(s.warmup + s.repeats):
            for method in methods:  # interleaved: drift on a shared machine hits every method alike
                cell = cells[method.label]
                if cell.status != "ok":
                    self.progress()
                    continue
                try:
                    configure(self.pipe, method, s.max_downsample)
                    result = self._measure_once(size, batch)
                except NotSupported as error:
                    cell.status, cell.reason = "n/a", str(error)
                except Exception as error:  # noqa: BLE001 - only out-of-memory is absorbed
                    if not is_out_of_memory(error):
                        raise
                    cell.status, cell.reason = "OOM", str(error).splitlines()[0][:200] if str(error) else "MemoryError"
                    logger.warning("%s at %dpx batch %d: out of memory", method.label, size, batch)
                else:
                    logger.info("%dpx batch %d %-18s %s %d: %.2f s", size, batch, method.label,
                                "warm-up" if repeat < s.warmup else "run", repeat + 1, result["seconds"])
                    cell.attention = attention_processor(self.pipe)
                    if repeat >= s.warmup:
                        cell.runs_seconds.append(result["seconds"])
                        kept = best.setdefault(method.label, {"unet": []})
                        kept["unet"].append(result["unet_seconds"])
                        if "memory" not in kept or result["memory"].peak_bytes > kept["memory"].peak_bytes:
                            kept["memory"] = result["memory"]
                        kept["noise"], kept["image"] = result["noise"], result["image"]
                        cell.plans_reused_share = result["reused_share"]
                    if repeat == s.warmup + s.repeats - 1 and s.count_ops:  # once, after the last timed run
                        self._count_cell_ops(cell, size, batch)
                finally:
                    api.remove_tome(self.pipe)
                    self.progress()
        self._finish(cells, best, batch)
        return list(cells.values())

    def _count_cell_ops(self, cell: Cell, size: int, batch: int) -> None:
        try:
            counted = self._count_ops(size, batch)
        except Exception as error:  # noqa: BLE001 - out of memory leaves the column empty; the timing stands
            if not is_out_of_memory(error):
                raise
            logger.warning("%s at %dpx batch %d: out of memory while counting operators", cell.label, size, batch)
            return
        cell.ops, cell.merging_blocks = counted.total, counted.merging_blocks

    def _finish(self, cells: Dict[str, Cell], best: Dict[str, Dict[str, Any]], batch: int) -> None:
        vanilla = cells.get("vanilla")
        ref = best.get("vanilla")
        for label, cell in cells.items():
            kept = best.get(label)
            if cell.status != "ok" or kept is None:
                continue
            cell.seconds_per_image = median(cell.runs_seconds) / batch
            cell.unet_seconds = median(kept["unet"])
            cell.peak_memory_bytes = int(kept["memory"].peak_bytes)
            cell.added_memory_bytes = int(kept["memory"].added_bytes)
            cell.memory_kind = kept["memory"].kind
            if vanilla is not None and vanilla.status == "ok" and ref is not None:
                cell.speedup = median(vanilla.runs_seconds) / median(cell.runs_seconds)
                if ref["noise"] is not None and kept["noise"] is not None:
                    cell.rel_l2 = relative_l2(ref["noise"], kept["noise"])
                if ref["image"] is not None and kept["image"] is not None:
                    cell.psnr_db = psnr(ref["image"], kept["image"])
            if cell.ops is not None and vanilla is not None and vanilla.ops is not None and cell.merging_blocks:
                cell.ops_per_block = (cell.ops - vanilla.ops) / cell.merging_blocks
        for label, cell in cells.items():
            bound = cells.get(f"bound@{cell.ratio:g}")
            if cell.method in ("tome", "tome-efficient", "builtin") and bound is not None:
                if cell.status == "ok" and bound.status == "ok":
                    cell.fraction_of_bound = median(bound.runs_seconds) / median(cell.runs_seconds)


def run_grid(pipe, settings: BenchSettings, progress: Optional[Callable[[], None]] = None,
             device: Optional[Device] = None) -> List[Cell]:
    """Measure every resolution x batch x method cell of ``settings`` on ``pipe`` (``device``: see
    :func:`select_device`; default Paddle's current device)."""
    methods = method_list(settings)
    runner = Runner(pipe, settings, progress, device)
    cells: List[Cell] = []
    for size in settings.resolutions:
        for batch in settings.batch_sizes:
            cells.extend(runner.run_cell(size, batch, methods))
    return cells


def grid_steps(settings: BenchSettings) -> int:
    """Measurements in a grid, for a progress bar."""
    per_cell = len(method_list(settings)) * (settings.warmup + settings.repeats)
    return per_cell * len(settings.resolutions) * len(settings.batch_sizes)


# time split of one UNet forward ------------------------------------------------------------------------------------
def time_split(pipe, settings: BenchSettings, size: int, batch: int, method: Method,
               device: Optional[Device] = None) -> Dict[str, float]:
    """Seconds of one denoiser forward (after one warm-up forward) spent in self-attention, in ToMe's matching
    (plans, merges, unmerges) and in the rest, for ``method`` at ``size``/``batch``. ``rest`` is what remains of
    the whole forward; the three add up to ``total``."""
    totals = {"attention": 0.0, "matching": 0.0}
    outer_start: Dict[int, float] = {}
    inner_start: Dict[int, float] = {}
    inner_seconds: Dict[int, float] = {}
    sync = (device if device is not None else default_device()).synchronize

    # inner hooks sit right around the attention; outer ones also around ToMe's merge/unmerge hooks on attn1
    def outer_pre(layer, args):
        sync()
        outer_start[id(layer)] = time.perf_counter()

    def inner_pre(layer, args):
        sync()
        inner_start[id(layer)] = time.perf_counter()

    def inner_post(layer, args, output):
        sync()
        inner_seconds[id(layer)] = time.perf_counter() - inner_start[id(layer)]
        totals["attention"] += inner_seconds[id(layer)]

    def outer_post(layer, args, output):
        sync()
        totals["matching"] += time.perf_counter() - outer_start[id(layer)] - inner_seconds[id(layer)]

    def timed(fn):
        def wrapper(*args):
            sync()
            began = time.perf_counter()
            try:
                return fn(*args)
            finally:
                sync()
                totals["matching"] += time.perf_counter() - began

        return wrapper

    handles: List[Any] = []
    patches: List[ModelPatch] = []
    builtin_module, builtin_compute = None, None
    try:
        configure(pipe, method, settings.max_downsample)
        models = [model for _, model in api._targets(pipe, for_apply=False)]
        ours = method.name in _APPLIED + ("bound",)  # this package's hooks sit on attn1
        for layer in [block.attn1 for model in models for _, block in find_blocks(model)]:
            handles.append(layer.register_forward_pre_hook(inner_pre))
            handles.append(layer.register_forward_post_hook(inner_post, prepend=True))
            if ours:
                handles.append(layer.register_forward_pre_hook(outer_pre, prepend=True))
                handles.append(layer.register_forward_post_hook(outer_post))
        patches = [p for p in (get_patch(m) for m in models) if p is not None]
        for patch in patches:
            patch.plan_for = timed(patch.plan_for)  # an instance attribute over the class method
        if method.name == "builtin":  # the built-in port merges inside its copied block forward: time its functions
            from ppdiffusers.patches import tomesd_patch_utils as builtin_module

            builtin_compute = builtin_module.compute_merge

            def compute_merge(*args):
                return tuple(timed(fn) for fn in timed(builtin_compute)(*args))

            builtin_module.compute_merge = compute_merge
        inputs = DenoiserInputs(pipe, size, batch, settings.seed)
        with paddle.no_grad():
            inputs.run()  # warm-up
            totals["attention"] = totals["matching"] = 0.0
            sync()
            start = time.perf_counter()
            inputs.run()
            sync()
            total = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
        for patch in patches:
            patch.__dict__.pop("plan_for", None)
        if builtin_module is not None:
            builtin_module.compute_merge = builtin_compute
        api.remove_tome(pipe)
    return {"attention": totals["attention"], "matching": totals["matching"],
            "rest": total - totals["attention"] - totals["matching"], "total": total}


# output ----------------------------------------------------------------------------------------------------------
def format_table(cells: List[Cell], methods: List[Method]) -> str:
    """The layout of the published ToMe tables: one row per resolution x batch, one column per method, each cell
    the seconds per image and the gain over vanilla."""
    labels = [m.label for m in methods]
    header = ["resolution", "batch"] + labels
    rows = [header]
    by_key: Dict[Tuple[int, int], Dict[str, Cell]] = {}
    for cell in cells:
        by_key.setdefault((cell.resolution, cell.batch), {})[cell.label] = cell
    for (size, batch), row_cells in by_key.items():
        row = [f"{size}x{size}", str(batch)]
        for label in labels:
            cell = row_cells.get(label)
            if cell is None:
                row.append("-")
            elif cell.status != "ok":
                row.append(cell.status)
            elif cell.method == "vanilla":
                row.append(f"{cell.seconds_per_image:.2f} s")
            else:
                gain = (cell.speedup - 1.0) * 100.0 if cell.speedup is not None else float("nan")
                row.append(f"{cell.seconds_per_image:.2f} s ({gain:+.1f}%)")
        rows.append(row)
    return render(rows)


def format_details(cells: List[Cell]) -> str:
    header = ["resolution", "batch", "method", "status", "s/image", "UNet s", "speed-up", "added MiB", "PSNR", "rel L2",
              "of bound", "reused", "ops/block"]
    rows = [header]
    for c in cells:
        label = c.label

        def fmt(value, pattern):
            return "-" if value is None else pattern.format(value)

        rows.append([
            str(c.resolution), str(c.batch), label, c.status,
            fmt(c.seconds_per_image, "{:.3f}"), fmt(c.unet_seconds, "{:.3f}"), fmt(c.speedup, "{:.2f}x"),
            fmt(None if c.added_memory_bytes is None else c.added_memory_bytes / 2**20, "{:.0f}"),
            "inf" if c.psnr_db == float("inf") else fmt(c.psnr_db, "{:.1f}"), fmt(c.rel_l2, "{:.4f}"),
            fmt(c.fraction_of_bound, "{:.1%}"), fmt(c.plans_reused_share, "{:.0%}"), fmt(c.ops_per_block, "{:.1f}"),
        ])
    return render(rows)


def pareto_front(cells: List[Cell]) -> List[Cell]:
    """The cells (of one resolution and batch) that no other cell beats on both speed-up and fidelity: PSNR of
    the image when there is one, else the relative L2 of the first noise prediction. The ``bound`` (a speed
    reference that ruins images) takes no part."""
    ok = [c for c in cells if c.status == "ok" and c.speedup is not None and c.method != "bound"]

    def fidelity(c: Cell) -> float:
        if c.psnr_db is not None:
            return c.psnr_db
        return -c.rel_l2 if c.rel_l2 is not None else float("-inf")

    front = []
    for c in ok:
        beaten = any(
            o is not c and o.speedup >= c.speedup and fidelity(o) >= fidelity(c)
            and (o.speedup > c.speedup or fidelity(o) > fidelity(c))
            for o in ok
        )
        if not beaten:
            front.append(c)
    return front


def format_pareto(cells: List[Cell]) -> str:
    """One row per configuration, fastest first, with its fidelity to vanilla and whether it is on the Pareto
    front of speed-up vs fidelity (for its resolution and batch)."""
    header = ["resolution", "batch", "method", "speed-up", "PSNR dB", "rel L2", "reused", "Pareto"]
    rows = [header]
    groups: Dict[Tuple[int, int], List[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.resolution, cell.batch), []).append(cell)
    for (size, batch), group in groups.items():
        front = {id(c) for c in pareto_front(group)}
        ranked = sorted((c for c in group if c.status == "ok" and c.speedup is not None and c.method != "bound"),
                        key=lambda c: -c.speedup)
        for c in ranked:
            rows.append([
                f"{size}x{size}", str(batch), c.label, f"{c.speedup:.2f}x",
                "inf" if c.psnr_db == float("inf") else ("-" if c.psnr_db is None else f"{c.psnr_db:.1f}"),
                "-" if c.rel_l2 is None else f"{c.rel_l2:.4f}",
                "-" if c.plans_reused_share is None else f"{c.plans_reused_share:.0%}",
                "yes" if id(c) in front else "",
            ])
    return render(rows)


def write_plots(cells: List[Cell], split: Dict[str, Dict[str, float]], folder: str) -> List[str]:
    """Speed-up vs ratio per resolution, peak memory vs resolution (vs ratio when there is one resolution), and
    the time split; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: List[str] = []

    def save(fig, ax, name: str, xlabel: Optional[str], ylabel: str) -> None:
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(os.path.join(folder, name))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    ok = [c for c in cells if c.status == "ok"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for size, batch in sorted({(c.resolution, c.batch) for c in ok}):
        for name in ("tome", "builtin", "bound"):
            pts = sorted(
                (c.ratio, c.speedup) for c in ok
                if (c.resolution, c.batch, c.method) == (size, batch, name) and c.speedup and not c.options
            )
            if pts:
                ax.plot([0.0] + [p[0] for p in pts], [1.0] + [p[1] for p in pts], marker="o",
                        linestyle="-" if name == "tome" else "--", label=f"{name} {size}px b{batch}")
    save(fig, ax, "speedup_vs_ratio.png", "ratio", "speed-up vs vanilla")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    smallest_batch = min((c.batch for c in ok), default=1)
    rows = [c for c in ok if c.batch == smallest_batch and c.added_memory_bytes is not None]
    if len({c.resolution for c in rows}) > 1:  # memory against resolution, one line per method
        for label in sorted({c.label for c in rows}):
            pts = sorted((c.resolution, c.added_memory_bytes / 2**20) for c in rows if c.label == label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        save(fig, ax, "memory_vs_resolution.png", "resolution (px)", "peak memory added by the call (MiB)")
    else:  # one resolution: memory against ratio, one line per method (vanilla is ratio 0 of each)
        vanilla = [c for c in rows if c.method == "vanilla"]
        for name in ("tome", "builtin", "bound"):
            pts = sorted((c.ratio, c.added_memory_bytes / 2**20) for c in rows if c.method == name and not c.options)
            if pts:
                pts = [(0.0, vanilla[0].added_memory_bytes / 2**20)] + pts if vanilla else pts
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        size = rows[0].resolution if rows else 0
        save(fig, ax, "memory_vs_ratio.png", f"ratio ({size}px)", "peak memory added by the call (MiB)")

    if len({c.label for c in ok if c.method != "bound"}) > 2:
        paths.extend(write_pareto_plot(cells, folder))

    if split:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        names = list(split)
        bottom = np.zeros(len(names))
        for part in ("attention", "matching", "rest"):
            values = np.array([split[n][part] for n in names])
            ax.bar(names, values, bottom=bottom, label=part)
            bottom += values
        save(fig, ax, "time_split.png", None, "seconds per UNet forward")
    return paths


def write_pareto_plot(cells: List[Cell], folder: str) -> List[str]:
    """Speed-up against fidelity (PSNR when the cells have images, else relative L2), one point per
    configuration and one file per resolution x batch, the Pareto front joined by a line; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: List[str] = []
    groups: Dict[Tuple[int, int], List[Cell]] = {}
    for cell in cells:
        if cell.status == "ok" and cell.speedup is not None and cell.method != "bound":
            groups.setdefault((cell.resolution, cell.batch), []).append(cell)
    for (size, batch), group in groups.items():
        use_psnr = all(c.psnr_db is not None for c in group)
        finite = [c.psnr_db for c in group if use_psnr and c.psnr_db != float("inf")]
        top = (max(finite) + 3.0) if finite else 1.0

        def y(c: Cell) -> float:
            if use_psnr:
                return top if c.psnr_db == float("inf") else c.psnr_db
            return c.rel_l2 if c.rel_l2 is not None else float("nan")

        fig, ax = plt.subplots(figsize=(6, 4))
        front = sorted(pareto_front(group), key=lambda c: c.speedup)
        ax.plot([c.speedup for c in front], [y(c) for c in front], color="0.7", zorder=1, label="Pareto front")
        for c in group:
            colour = "tab:green" if c.method.startswith("todo") else "black" if c.method == "vanilla" else "tab:blue"
            ax.scatter([c.speedup], [y(c)], color=colour, zorder=2)
            ax.annotate(c.label, (c.speedup, y(c)), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel("speed-up vs vanilla")
        ax.set_ylabel("PSNR vs vanilla (dB; vanilla drawn at the top)" if use_psnr else "relative L2 to vanilla")
        if not use_psnr:
            ax.invert_yaxis()  # closer to vanilla is up in both kinds of plot
        ax.set_title(f"{size}x{size}, batch {batch}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
        fig.tight_layout()
        path = os.path.join(folder, f"pareto_{size}_b{batch}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def load_cells(data: Dict[str, Any]) -> List[Cell]:
    """The cells of a ``results.json`` written by :func:`save_json`, as :class:`Cell` objects again."""
    fields = set(Cell.__dataclass_fields__)
    cells = []
    for raw in data["cells"]:
        values = {k: v for k, v in raw.items() if k in fields}
        for key in ("psnr_db", "rel_l2", "speedup"):
            if isinstance(values.get(key), str):  # save_json writes inf and nan as strings
                values[key] = float(values[key])
        cells.append(Cell(**values))
    return cells


def record(cells: List[Cell], settings: BenchSettings, source: str, threads: int, dtype: str,
           split: Dict[str, Dict[str, float]]) -> Dict[str, Any]:
    return {
        "command": "bench",
        "source": source,
        "environment": environment(threads, dtype),
        "settings": asdict(settings),
        "cells": [asdict(c) for c in cells],
        "time_split": split,
    }


def save_json(data: Dict[str, Any], path: str) -> None:
    def clean(value):
        if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
            return str(value)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean(data), f, indent=2)

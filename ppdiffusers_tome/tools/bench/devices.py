"""Where the benchmark runs: ``--device cpu|gpu`` (:func:`select_device`), what it needs from the device (wait for
queued kernels, peak memory of a window) as replaceable objects (:class:`CpuDevice`, :class:`CudaDevice`), and how
an out-of-memory error is recognised (:func:`is_out_of_memory`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paddle

from ..measure import PeakMemory, on_gpu


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


class DeviceMemory:
    """Peak device memory of a ``with`` window, from the functions of a :class:`CudaDevice` (same fields as
    :class:`ppdiffusers_tome.tools.measure.PeakMemory`)."""

    def __init__(self, device: CudaDevice):
        self.device = device
        self.kind = device.memory_kind
        self.baseline_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> DeviceMemory:
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
        synchronize: Callable[[], Any] | None = None,
        reset_peak: Callable[[], Any] | None = None,
        max_memory: Callable[[], int] | None = None,
        allocated: Callable[[], int] | None = None,
    ):
        cuda = paddle.device.cuda
        self._synchronize = synchronize or paddle.device.synchronize
        self.reset_peak = reset_peak or cuda.reset_max_memory_allocated
        self.max_memory = max_memory or cuda.max_memory_allocated
        self.allocated = allocated or cuda.memory_allocated

    def synchronize(self) -> None:
        self._synchronize()

    def memory(self) -> DeviceMemory:
        return DeviceMemory(self)


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


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error (Python's, Paddle's on CPU or GPU)."""
    if isinstance(error, MemoryError):
        return True
    text = f"{type(error).__name__} {error}".lower()
    return any(k in text for k in ("out of memory", "resourceexhausted", "cannot allocate", "bad_alloc"))

"""Measurement helpers shared by the demo and the benchmarks: peak memory during a call, per-forward timing,
fidelity metrics, thread control and a record of the environment."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np
import paddle

__all__ = [
    "PeakMemory",
    "ForwardTimer",
    "psnr",
    "relative_l2",
    "set_threads",
    "environment",
    "median",
    "on_gpu",
    "format_table",
]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: fall back to the process' lifetime peak (then ``added_bytes`` means little)
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def on_gpu() -> bool:
    """Whether Paddle runs on a GPU here."""
    return paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")


class PeakMemory:
    """Peak memory while the ``with`` block runs: on GPU Paddle's max allocated bytes, on CPU the peak resident set
    size sampled every ``interval`` seconds (Paddle's CPU allocator returns large blocks to the OS, so the peak of
    one call is visible even after a larger call).

    >>> with PeakMemory() as mem:
    ...     _ = np.ones((256, 1024, 256), dtype=np.float32).sum()
    >>> mem.peak_bytes >= mem.baseline_bytes
    True
    """

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.kind = "gpu_max_allocated" if on_gpu() else "cpu_peak_rss"
        self.baseline_bytes = 0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, _rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        if self.kind == "gpu_max_allocated":
            paddle.device.cuda.synchronize()
            paddle.device.cuda.reset_max_memory_allocated()
            self.baseline_bytes = paddle.device.cuda.memory_allocated()
        else:
            self.baseline_bytes = self.peak_bytes = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.kind == "gpu_max_allocated":
            paddle.device.cuda.synchronize()
            self.peak_bytes = paddle.device.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, _rss_bytes())

    @property
    def added_bytes(self) -> int:
        """Peak minus what was already held when the block started (the call's own working memory)."""
        return max(self.peak_bytes - self.baseline_bytes, 0)


class ForwardTimer:
    """Wall time of every forward call of ``layer`` (e.g. a UNet) while installed, via a pre/post hook pair.

    >>> timer = ForwardTimer(paddle.nn.Linear(4, 4))
    >>> _ = timer.layer(paddle.ones([1, 4])); timer.remove()
    >>> len(timer.seconds)
    1
    """

    def __init__(self, layer: paddle.nn.Layer):
        self.layer = layer
        self.seconds: List[float] = []
        self._start = 0.0
        self._handles = [  # first in, last out: the layer's other hooks (ToMe's per-call work) are timed too
            layer.register_forward_pre_hook(self._before, prepend=True),
            layer.register_forward_post_hook(self._after),
        ]

    def _before(self, layer, args):
        if on_gpu():
            paddle.device.cuda.synchronize()
        self._start = time.perf_counter()

    def _after(self, layer, args, output):
        if on_gpu():
            paddle.device.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def format_table(rows: List[List[str]]) -> str:
    """Rows of strings (the first one the header) as an aligned text table.

    >>> print(format_table([["a", "bb"], ["ccc", "d"]]))
    a   | bb
    ----+---
    ccc | d
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def median(values: List[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def psnr(reference: np.ndarray, test: np.ndarray, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of ``test`` against ``reference`` (``inf`` when identical).

    >>> round(psnr(np.zeros(4), np.full(4, 0.1)), 6)
    20.0
    """
    mse = float(np.mean((np.asarray(reference, np.float64) - np.asarray(test, np.float64)) ** 2))
    return float("inf") if mse == 0 else float(10.0 * np.log10(data_range**2 / mse))


def relative_l2(reference: np.ndarray, test: np.ndarray) -> float:
    """``||test - reference|| / ||reference||`` over all elements.

    >>> relative_l2(np.array([3.0, 4.0]), np.array([3.0, 4.5]))
    0.1
    """
    reference = np.asarray(reference, np.float64)
    norm = float(np.linalg.norm(reference))
    if norm == 0:
        raise ValueError("relative_l2 needs a non-zero reference")
    return float(np.linalg.norm(np.asarray(test, np.float64) - reference) / norm)


def set_threads(threads: Optional[int]) -> int:
    """Let Paddle's CPU kernels use ``threads`` threads (all cores when None); returns the number set. Paddle's
    CPU build uses one thread unless told otherwise."""
    count = int(threads) if threads else (os.cpu_count() or 1)
    if count < 1:
        raise ValueError(f"threads must be >= 1; got {threads}")
    paddle.base.core.set_num_threads(count)
    return count


def environment(threads: int, dtype: str) -> Dict[str, Any]:
    """What a result was measured on: versions, device, dtype, threads, machine and date."""
    import ppdiffusers

    from . import __version__

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "paddle": paddle.__version__,
        "ppdiffusers": ppdiffusers.__version__,
        "ppdiffusers_tome": __version__,
        "device": paddle.get_device(),
        "dtype": dtype,
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "machine": f"{platform.system()} {platform.machine()} / Python {platform.python_version()}",
    }

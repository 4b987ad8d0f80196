"""Measurement helpers shared by the demo, the benchmarks and the tests: peak memory during a call, per-forward
timing, fidelity metrics, thread control, a record of the environment, and two instruments for the GPU path that
work on CPU:

* :class:`TransferCounter` counts host<->device transfers (each one a device sync on a GPU) made while it is active;
* :func:`count_ops` counts the eager operators a callable issues, with ``paddle.profiler``; with
  :class:`MergingBlocks` and :func:`ops_added_per_block` it gives the operators that merging adds per block.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import ppdiffusers
from paddle import profiler
from paddle.base.core import TracerEventType

from .. import __version__
from ..tome.patch import find_blocks

try:
    import resource  # the process' lifetime peak, where /proc is missing (not Linux)
except ImportError:  # pragma: no cover - Windows
    resource = None

__all__ = [
    "ForwardTimer",
    "MergingBlocks",
    "OpCount",
    "PeakMemory",
    "Transfer",
    "TransferCounter",
    "count_forward_ops",
    "count_ops",
    "environment",
    "median",
    "on_gpu",
    "ops_added_per_block",
    "psnr",
    "relative_l2",
    "render_table",
    "set_threads",
]

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: fall back to the process' lifetime peak (then ``added_bytes`` means little)
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
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, _rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
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
    ``synchronize`` (called before each clock read) defaults to a CUDA synchronize on a GPU and nothing on CPU.

    >>> timer = ForwardTimer(paddle.nn.Linear(4, 4))
    >>> _ = timer.layer(paddle.ones([1, 4])); timer.remove()
    >>> len(timer.seconds)
    1
    """

    def __init__(self, layer: paddle.nn.Layer, synchronize: Callable[[], None] | None = None):
        self.layer = layer
        self.seconds: list[float] = []
        self._start = 0.0
        # waits for queued device work before each clock read (default: a CUDA synchronize when on a GPU)
        self._sync = synchronize if synchronize is not None else (paddle.device.cuda.synchronize if on_gpu() else None)
        self._handles = [  # first in, last out: the layer's other hooks (ToMe's per-call work) are timed too
            layer.register_forward_pre_hook(self._before, prepend=True),
            layer.register_forward_post_hook(self._after),
        ]

    def _before(self, layer, args):
        if self._sync is not None:
            self._sync()
        self._start = time.perf_counter()

    def _after(self, layer, args, output):
        if self._sync is not None:
            self._sync()
        self.seconds.append(time.perf_counter() - self._start)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def render_table(rows: list[list[str]]) -> str:
    """Rows of strings (the first one the header) as an aligned text table.

    >>> print(render_table([["a", "bb"], ["ccc", "d"]]))
    a   | bb
    ----+---
    ccc | d
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def median(values: list[float]) -> float:
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


def set_threads(threads: int | None) -> int:
    """Let Paddle's CPU kernels use ``threads`` threads (all cores when None); returns the number set. Paddle's
    CPU build uses one thread unless told otherwise."""
    count = int(threads) if threads else (os.cpu_count() or 1)
    if count < 1:
        raise ValueError(f"threads must be >= 1; got {threads}")
    paddle.base.core.set_num_threads(count)
    return count


def environment(threads: int, dtype: str) -> dict[str, Any]:
    """What a result was measured on: versions, device, dtype, threads, machine and date."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "paddle": paddle.__version__,
        "ppdiffusers": ppdiffusers.__version__,
        "ppdiffusers_tome": __version__,
        "device": paddle.get_device(),
        "dtype": dtype,
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "machine": f"{platform.system()} {platform.machine()} / Python {platform.python_version()}",
    }


# host <-> device transfers -------------------------------------------------------------------------------------------
_PADDLE_DIR = os.path.dirname(os.path.abspath(paddle.__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)
# Tensor methods that copy device memory to the host (on a GPU each one waits for the device: a sync)
_TENSOR_READS = ("numpy", "item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__array__")
# functions that copy host data (numpy arrays, Python scalars and lists) to the device
_HOST_WRITES = ("to_tensor", "assign")
_HOST_SCALARS = (bool, int, float, complex, np.generic, np.ndarray)


def _is_host_data(data: Any) -> bool:
    """Whether ``data`` lives on the host: a numpy array or scalar, a Python number, or a list/tuple holding only
    such values. Tensors (and lists of them) are device data."""
    if isinstance(data, _HOST_SCALARS):
        return True
    if isinstance(data, (list, tuple)):
        return all(_is_host_data(item) for item in data)
    return False


def _caller() -> str:
    """``file:line in function`` of the first frame outside Paddle and this module (the code that asked for the
    transfer), else of the direct caller."""
    frame = sys._getframe(2)
    direct = None
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename != _THIS_FILE:
            if direct is None:
                direct = frame
            if not filename.startswith(_PADDLE_DIR):
                break
        frame = frame.f_back
    frame = frame or direct
    if frame is None:  # pragma: no cover - no Python caller
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


@dataclass
class Transfer:
    """One host<->device transfer: what did it (``kind``, e.g. ``"numpy"`` or ``"to_tensor"``) and from where."""

    kind: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}"


class TransferCounter:
    """Count host<->device transfers made while the ``with`` block runs, in any thread.

    Counted: ``paddle.to_tensor`` and ``paddle.assign`` called with host data (numpy arrays and scalars, Python
    numbers, lists/tuples of them; also where those functions were imported by name, e.g. into
    ``paddle.tensor.creation``), and the ``paddle.Tensor`` methods ``numpy``, ``item``, ``tolist``, ``__bool__``,
    ``__float__``, ``__int__``, ``__index__`` and ``__array__`` (``if t:``, ``float(t)``, ``np.asarray(t)``, ...). On
    a GPU each of them makes the host wait for the device. A transfer made inside another one (``__array__`` calls
    ``numpy``) counts once. Each :class:`Transfer` records the first caller outside Paddle, so a failing test says
    where the sync came from. Everything is restored on exit, also when the block raises. Not seen: other ways to
    move data, e.g. indexing a tensor with a numpy array or ``Tensor.set_value``.

    >>> x = paddle.ones([3])
    >>> with TransferCounter() as transfers:
    ...     y = x * 2                        # stays on the device
    ...     z = paddle.to_tensor(np.ones(3))  # host -> device
    ...     v = float(y.sum())               # device -> host
    >>> transfers.counts
    {'to_tensor': 1, '__float__': 1}
    """

    def __init__(self) -> None:
        self.events: list[Transfer] = []
        self._lock = threading.Lock()
        self._depth = threading.local()
        self._saved: list[tuple] = []  # (owner, name, original, had_own_attribute)

    # the window ---------------------------------------------------------------------------------------------------
    def __enter__(self) -> TransferCounter:
        if self._saved:
            raise RuntimeError("TransferCounter is already active; use a new one for a nested window")
        try:
            for name in _TENSOR_READS:
                original = getattr(paddle.Tensor, name, None)
                if original is not None:
                    self._replace(paddle.Tensor, name, original, self._wrap(name, original, None))
            for name in _HOST_WRITES:
                original = getattr(paddle, name)
                wrapper = self._wrap(name, original, _is_host_data)
                for module in list(sys.modules.values()):  # also where it was imported by name
                    namespace = getattr(module, "__dict__", None)
                    if isinstance(namespace, dict) and namespace.get(name) is original:
                        self._replace(module, name, original, wrapper)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _replace(self, owner: Any, name: str, original: Any, wrapper: Any) -> None:
        own = name in vars(owner)
        setattr(owner, name, wrapper)
        self._saved.append((owner, name, original, own))

    def _restore(self) -> None:
        while self._saved:
            owner, name, original, own = self._saved.pop()
            if own:
                setattr(owner, name, original)
            else:  # pragma: no cover - the attribute was inherited
                delattr(owner, name)

    def _wrap(self, kind: str, original: Callable, host_data: Callable[[Any], bool] | None) -> Callable:
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter._depth, "value", 0)
            if depth == 0:
                data = args[0] if args else kwargs.get("data", kwargs.get("x"))
                if host_data is None or host_data(data):
                    event = Transfer(kind, _caller())
                    with counter._lock:
                        counter.events.append(event)
            counter._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._depth.value = depth

        wrapper.__name__ = getattr(original, "__name__", kind)
        wrapper.__doc__ = getattr(original, "__doc__", None)
        wrapper.__wrapped__ = original
        return wrapper

    # what was seen ------------------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Transfers seen so far."""
        return len(self.events)

    @property
    def counts(self) -> dict[str, int]:
        """Transfers per kind, in the order first seen."""
        return dict(collections.Counter(event.kind for event in self.events))

    def by_site(self) -> dict[str, int]:
        """Transfers per ``kind at file:line``, most frequent first."""
        return dict(collections.Counter(str(event) for event in self.events).most_common())

    def report(self, limit: int = 20) -> str:
        """A readable summary (total, then the ``limit`` most frequent sites) for a log line or a test failure."""
        lines = [f"{self.total} host<->device transfer(s)"]
        for site, count in list(self.by_site().items())[:limit]:
            lines.append(f"  {count} x {site}")
        return "\n".join(lines)


# eager operator count ------------------------------------------------------------------------------------------------
@dataclass
class OpCount:
    """Eager operators issued by one call: ``total`` and ``by_name`` (operator type -> count); ``result`` is what
    the call returned and ``merging_blocks`` what a :class:`MergingBlocks` window counted, when one was given."""

    total: int
    by_name: dict[str, int]
    result: Any = None
    merging_blocks: int | None = None
    source: str = "profiler"


def _operator_name(name: str) -> str:
    return name.split(" ", 1)[0].split("[", 1)[0]


def _ops_from_tree(result: Any) -> collections.Counter | None:
    """Operator events from the profiler's host event trees (``_ProfilerResult.get_data()``: thread id -> root node
    with ``children_node``), or None when this Paddle does not expose them."""
    get_data = getattr(result, "get_data", None)
    if get_data is None:
        return None
    names: collections.Counter = collections.Counter()
    stack = list(get_data().values())
    while stack:
        node = stack.pop()
        if node.type == TracerEventType.Operator:
            names[_operator_name(node.name)] += 1
        stack.extend(node.children_node)
    return names


def _ops_from_export(prof: Any) -> collections.Counter:
    """Operator events from the profiler's own JSON export (chrome tracing: ``cat == "Operator"``)."""
    folder = tempfile.mkdtemp(prefix="ppdiffusers_tome_ops_")
    path = os.path.join(folder, "trace.json")
    try:
        prof.export(path, format="json")
        with open(path, encoding="utf-8") as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(folder)
    return collections.Counter(_operator_name(e.get("name", "")) for e in events if e.get("cat") == "Operator")


def count_ops(fn: Callable[[], Any]) -> OpCount:
    """Count the eager operators that ``fn()`` issues, with ``paddle.profiler`` (host events only, so it works on
    CPU and counts the same on a GPU).

    Paddle 3.3's profiler records one ``Operator`` event per eager operator (``"matmul dygraph"``), with its
    ``infer_meta`` and kernel launch as children; Python ops such as ``x + 1`` sit under a ``UserDefined`` event
    of the Python binding. Every ``Operator`` event is counted (none nest in a UNet forward on Paddle 3.3). They are read
    from the host event trees of the profiler result (``get_data()``) and, where a Paddle does not expose those,
    from the profiler's own JSON export. Run ``fn`` once before counting: first calls can issue one-off
    operators. The profiler cannot be nested.

    >>> x = paddle.ones([4, 4])
    >>> count_ops(lambda: paddle.matmul(x, x).sum()).total
    2
    """
    prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda _: None)
    prof.start()
    try:
        result = fn()
    finally:
        prof.stop()
    names = _ops_from_tree(prof.profiler_result)
    source = "profiler"
    if names is None:
        names, source = _ops_from_export(prof), "profiler-export"
    return OpCount(total=sum(names.values()), by_name=dict(names), result=result, source=source)


class MergingBlocks:
    """Count the transformer blocks that ran with fewer tokens than they were given while the ``with`` block runs:
    a block merged when the ``to_q`` of its self- or cross-attention or its feed-forward saw fewer tokens than the
    block's input (ToMe, the built-in port, the bound), or its self-attention's ``to_k`` did (ToDo's shorter keys).
    It watches from outside with forward hooks, so it counts any implementation alike; one block called twice
    counts twice.

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> unet = tiny_unet()
    >>> with MergingBlocks(unet) as blocks:
    ...     pass
    >>> blocks.count
    0
    """

    def __init__(self, models: Any):
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        self._blocks = [block for model in models for _, block in find_blocks(model)]
        self.count = 0
        self._handles: list[Any] = []
        self._tokens: dict[int, int] = {}  # block id -> tokens of the call in flight
        self._merged: dict[int, bool] = {}

    def __enter__(self) -> MergingBlocks:
        try:
            for block in self._blocks:
                key = id(block)
                self._handles.append(block.register_forward_pre_hook(self._block_pre(key), prepend=True))
                self._handles.append(block.register_forward_post_hook(self._block_post(key)))
                attn1, attn2 = getattr(block, "attn1", None), getattr(block, "attn2", None)
                # (the feed-forward's first layer, not the feed-forward itself: a technique's hook on a layer runs inside
                # its forward, after the layer's own pre-hooks)
                net = getattr(getattr(block, "ff", None), "net", None)
                watched = [getattr(attn1, "to_q", None), getattr(attn2, "to_q", None), net[0] if net else None]
                if attn1 is not None and not getattr(attn1, "is_cross_attention", False):
                    watched.append(getattr(attn1, "to_k", None))  # ToDo shortens self-attention's keys
                for layer in watched:
                    if isinstance(layer, paddle.nn.Layer):
                        self._handles.append(layer.register_forward_pre_hook(self._projection_pre(key)))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    @staticmethod
    def _tokens_of(args: Any) -> int | None:
        x = args[0] if args else None
        shape = getattr(x, "shape", None)
        return int(shape[1]) if shape is not None and len(shape) == 3 else None

    def _block_pre(self, key: int):
        def hook(layer, args):
            tokens = self._tokens_of(args)
            if tokens is not None:
                self._tokens[key] = tokens
                self._merged[key] = False

        return hook

    def _projection_pre(self, key: int):
        def hook(layer, args):
            tokens, expected = self._tokens_of(args), self._tokens.get(key)
            if tokens is not None and expected is not None and tokens < expected:
                self._merged[key] = True

        return hook

    def _block_post(self, key: int):
        def hook(layer, args, output):
            self._tokens.pop(key, None)
            if self._merged.pop(key, False):
                self.count += 1

        return hook


def ops_added_per_block(vanilla_ops: int, patched_ops: int, merging_blocks: int) -> float:
    """Eager operators that merging adds per merging block: ``(patched_ops - vanilla_ops) / merging_blocks``.

    >>> ops_added_per_block(700, 790, 3)
    30.0
    """
    if merging_blocks < 1:
        raise ValueError(f"merging_blocks must be >= 1 (no block merged, so there is nothing to divide); got {merging_blocks}")
    return (patched_ops - vanilla_ops) / merging_blocks


def count_forward_ops(run: Callable[[], Any], models: Any, warmup: int = 1) -> OpCount:
    """Eager operators of one ``run()`` after ``warmup`` untimed runs, with the number of blocks that merged in
    the counted run (see :class:`MergingBlocks`; ``models`` are the models whose blocks are watched)."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0; got {warmup}")
    for _ in range(warmup):
        run()
    with MergingBlocks(models) as blocks:
        counted = count_ops(run)
    counted.merging_blocks = blocks.count
    return counted

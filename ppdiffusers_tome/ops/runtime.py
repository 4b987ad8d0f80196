"""Which kernels the merge core runs (the CPU or the GPU family), whether it is being traced, and dtype names.

The two kernel families compute the same plans; they differ where a GPU and a CPU disagree on what is cheap. Each
family is one :class:`Kernels` object whose attributes name those differences, so the merge core reads
``family.few_launches`` rather than comparing names; :data:`KERNELS` finds it by name (or by itself). The family
follows the tensors' place (:func:`device_kind`); :func:`force_kernels` overrides it for a block of code, which is
how the GPU family's logic is tested and counted on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Any, Iterator, Optional

import paddle

__all__ = ["CPU_KERNELS", "GPU_KERNELS", "KERNELS", "KINDS", "Kernels", "argsort_rows", "begin_eager", "compute_dtype",
           "converting", "device_kind", "dtype_name", "end_eager", "force_kernels", "forced_kernels", "known_eager",
           "tracing"]

KINDS = ("cpu", "gpu")
LOW_PRECISION = ("float16", "bfloat16")


class Kernels:
    """One kernel family: its ``name`` (``"cpu"`` or ``"gpu"``) and, as plain attributes (read on the traced path),
    the four places where it differs from the other family. All four are True for the GPU family:

    * ``few_launches``: an operator costs a kernel launch, a pass over the tokens is cheap; so the matching makes
      unit rows with the 2-norm kernel in few operators (a CPU squares and sums with a matmul and normalises only
      the dst), feature order normalises src and dst at once, and local plans are dense per-window matrices;
    * ``half_math``: float16/bfloat16 tokens keep their dtype in the similarity and in the unmerge gather (a CPU
      has no half-precision matmul or gather: float32);
    * ``spare_sort_row``: a sort of a single row takes a synchronising path, so :func:`argsort_rows` sorts a spare
      row along;
    * ``atomic_adds``: ``index_add`` adds floats with atomics (the last bits may change run to run), so a
      ``deterministic`` merge sums groups with a scan instead (a CPU adds in order anyway).

    >>> KERNELS["gpu"].few_launches, KERNELS["cpu"].half_math, KERNELS[GPU_KERNELS] is GPU_KERNELS
    (True, False, True)
    """

    def __init__(self, name: str, gpu: bool):
        self.name = name
        self.few_launches = self.half_math = self.spare_sort_row = self.atomic_adds = gpu

    def __repr__(self) -> str:
        return f"Kernels({self.name!r})"

    def __reduce__(self) -> str:
        # pickled and copied as a reference to the module's object: there is one family of each kind, so
        # ``KERNELS[family]`` (an identity lookup) keeps working on an unpickled plan
        return f"{self.name.upper()}_KERNELS"


CPU_KERNELS, GPU_KERNELS = Kernels("cpu", False), Kernels("gpu", True)
# the family of a name, or of itself: ``KERNELS[kind]`` takes either, at the cost of a dictionary lookup
KERNELS = {"cpu": CPU_KERNELS, "gpu": GPU_KERNELS, CPU_KERNELS: CPU_KERNELS, GPU_KERNELS: GPU_KERNELS}


class _Forced:
    """The kernel family :func:`force_kernels` imposes. An attribute of an object, not a module global: Paddle's AST
    conversion runs a converted function with a *copy* of its module's globals taken when it converted it (and keeps
    that function for the process), so a rebound global would stay frozen at its value of the first conversion."""

    kind: Optional[str] = None  # written only by force_kernels, under lock
    lock = threading.Lock()


_FORCED = _Forced()


@functools.lru_cache(maxsize=64)  # (a hit runs no Python frame: called several times per merging block)
def dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``paddle.float32`` (and for the string itself)."""
    return str(dtype).replace("paddle.", "")


@functools.lru_cache(maxsize=64)
def compute_dtype(dtype: Any) -> str:
    """The dtype in which merge arithmetic runs for activations of ``dtype``: float16 and bfloat16 are promoted to
    float32 (a mean over many tokens loses precision in half types, and Paddle's CPU build has no half-precision
    gather); every other dtype is kept.

    >>> import paddle
    >>> compute_dtype(paddle.float16), compute_dtype(paddle.float32)
    ('float32', 'float32')
    """
    name = dtype_name(dtype)
    return "float32" if name in LOW_PRECISION else name


try:
    from paddle.base.dygraph.base import (
        in_sot_simulation_mode as _in_sot_simulation,
        in_to_static_mode as _in_to_static,
    )
except ImportError:  # pragma: no cover - older Paddle
    _in_sot_simulation = _in_to_static = None


class _Eager(threading.local):
    known = False  # True while a model call that this package hooks is known to run eagerly, in this thread


EAGER = _Eager()  # read by the device cache; written only through begin_eager / end_eager


def begin_eager() -> bool:
    """Note for this thread whether the model call starting now runs eagerly (not traced), so that the merge core
    need not ask Paddle again at every table it looks up; returns the previous note, for :func:`end_eager`."""
    previous = EAGER.known
    EAGER.known = not tracing()
    return previous


def end_eager(previous: bool) -> None:
    """Put back the note :func:`begin_eager` replaced (the model call has ended)."""
    EAGER.known = previous


def known_eager() -> bool:
    """Whether the model call in flight in this thread is known to run eagerly (see :func:`begin_eager`)."""
    return EAGER.known


def tracing() -> bool:
    """Whether this code is being converted to a static graph (``paddle.jit.to_static``) rather than run eagerly.

    In the default SOT mode Paddle simulates the bytecode and answers ``in_sot_simulation_mode()`` with True; the
    functions are imported once at module level, since an ``import`` statement inside the simulation breaks the
    graph and would run this check natively (where it says False)."""
    if EAGER.known:
        return False
    if not paddle.in_dynamic_mode():
        return True
    if _in_to_static is None:  # pragma: no cover - older Paddle
        return False
    return bool(_in_to_static() or _in_sot_simulation())


def converting() -> bool:
    """Whether this call runs under ``paddle.jit.to_static`` in any form: traced (:func:`tracing`), or run as plain
    Python inside a call that Paddle's SOT mode is translating (the parts it cannot trace, after a graph break, run
    eagerly on real tensors, where :func:`tracing` says False)."""
    if tracing():
        return True
    try:
        from paddle.jit.sot.utils.utils import StepInfoManager
    except ImportError:  # pragma: no cover - Paddle without SOT
        return False
    return getattr(StepInfoManager(), "current_code", None) is not None


def forced_kernels() -> Optional[str]:
    """The kernel family :func:`force_kernels` currently imposes, or None (the tensors' place decides)."""
    return _FORCED.kind


@contextlib.contextmanager
def force_kernels(kind: Optional[str]) -> Iterator[None]:
    """Run the merge core with ``kind``'s kernels (``"cpu"`` or ``"gpu"``) inside the ``with`` block, whatever the
    tensors' place, in every thread; ``None`` lets the place decide. The previous setting comes back on exit, so
    blocks nest. ``ppdiffusers_tome.testing.gpu_kernels()`` is this with ``"gpu"``.

    >>> import paddle
    >>> with force_kernels("gpu"):
    ...     device_kind(paddle.ones([1]))
    'gpu'
    >>> device_kind(paddle.ones([1]))
    'cpu'
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be None or one of {KINDS}; got {kind!r}")
    with _FORCED.lock:
        previous, _FORCED.kind = _FORCED.kind, kind
    try:
        yield
    finally:
        with _FORCED.lock:
            _FORCED.kind = previous


def device_kind(x: Any = None) -> str:
    """``"gpu"`` when ``x`` lives on a GPU (or, while tracing, when the program will run on one), else ``"cpu"``;
    :func:`force_kernels` takes precedence. ``KERNELS[device_kind(x)]`` is the family's :class:`Kernels`, which
    says where it differs from the other.

    >>> import paddle
    >>> device_kind(paddle.ones([1]))
    'cpu'
    """
    forced = _FORCED.kind
    if forced is not None:
        return forced
    place = getattr(x, "place", None)
    check = getattr(place, "is_gpu_place", None)
    if callable(check):
        try:
            return "gpu" if check() else "cpu"
        except Exception:  # pragma: no cover - a place that cannot answer
            pass
    return "gpu" if paddle.is_compiled_with_cuda() and str(paddle.device.get_device()).startswith("gpu") else "cpu"


def argsort_rows(keys: paddle.Tensor, kind: Any, axis: int = -1, descending: bool = False,
                 append: int = 0, fill: float = 0.0) -> paddle.Tensor:
    """Stable ``paddle.argsort`` of ``keys`` along ``axis``, each row on its own (a row: one index of every other
    axis), after ``append`` entries of ``fill`` are added at the end of every row (in the same pad).

    The one sort of the merge core; ``kind`` is a :class:`Kernels` or its name. On a family with
    ``spare_sort_row`` (the GPU's), when ``keys`` may hold a single row (one, or unknown while tracing a dynamic
    batch), a spare row is sorted along and dropped: Paddle's GPU argsort of a single row takes a Thrust path that
    synchronises with the host. The spare row goes in the same pad as ``append``.

    >>> import paddle
    >>> keys = paddle.to_tensor([[3.0, 1.0, 2.0]])
    >>> argsort_rows(keys, "cpu").tolist(), argsort_rows(keys, "gpu").tolist()
    ([[1, 2, 0]], [[1, 2, 0]])
    >>> argsort_rows(keys, "cpu", descending=True, append=1, fill=-float("inf")).tolist()
    [[0, 2, 1, 3]]
    """
    ndim = len(keys.shape)
    axis = axis % ndim
    spare = 0
    if KERNELS[kind].spare_sort_row:
        others = [size for dim, size in enumerate(keys.shape) if dim != axis]  # one row per index of these
        unknown = any(size is None or size < 0 for size in others)  # (a dynamic batch while tracing)
        spare = 1 if unknown or math.prod(others) == 1 else 0
    if spare or append:
        pad = [0] * (2 * ndim)  # (a constant pad listing every axis, from the first)
        if spare and axis == 0:
            raise ValueError("argsort_rows: on GPU kernels axis must not be the first (the spare row goes there)")
        pad[1], pad[2 * axis + 1] = spare, append
        keys = paddle.nn.functional.pad(keys, pad, value=fill)
    order = paddle.argsort(keys, axis=axis, descending=descending, stable=True)
    return order[:-1] if spare else order

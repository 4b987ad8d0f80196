"""The device cache: small tensors (index tables, constants, zero buffers) built once per key and place.

A forward must not upload anything from the host (each upload is a device sync on a GPU), so every constant a
plan needs is built on the device the first time and kept here, bounded by entries and bytes.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Sequence

import numpy as np
import paddle

from .runtime import EAGER, tracing

__all__ = ["CACHE", "DEFAULT_CACHE_BYTES", "DeviceCache", "Tables", "batch_tables", "cache_info", "clear_cache",
           "clear_table_cache", "const", "constant", "table_cache_info"]

DEFAULT_CACHE_BYTES = 64 * 2**20  # device memory the cache may hold; a table larger than this is built at each use
_MISSING = object()


class Tables:
    """Base of the merge core's typed tables: a plain object whose fields, listed in the subclass's ``__slots__``,
    its constructor sets once; read by name (``b.off_n``). Not a NamedTuple: when Paddle's SOT tracer resumes a
    function after a graph break, a NamedTuple built during its simulation comes back as a bare tuple (a plain
    object comes back as itself)."""

    __slots__ = ()

    def values(self) -> List[Any]:
        """The fields' values, in ``__slots__`` order."""
        return [getattr(self, name) for name in self.__slots__]


def _nbytes(value: Any) -> int:
    """Device bytes held by a cached value (a tensor, or :class:`Tables` / dict / tuple / list of them; other values
    count 0)."""
    if isinstance(value, paddle.Tensor):
        return int(np.prod(value.shape, dtype=np.int64)) * value.element_size()
    if isinstance(value, Tables):
        return sum(_nbytes(item) for item in value.values())
    if isinstance(value, dict):
        return sum(_nbytes(item) for item in value.values())
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(item) for item in value)
    return 0


class DeviceCache:
    """Small LRU of tensors built once per key and place, bounded by entries and by bytes; bypassed while tracing (a
    static program gets constants of its own instead of references to eager tensors). Safe for threads: lookups and
    evictions hold a lock; a table is built outside it (two threads may both build one, the first stored wins)."""

    def __init__(self, size: int = 64, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.size = size
        self.max_bytes = max_bytes
        self.items: "OrderedDict[Any, Any]" = OrderedDict()
        self.sizes: Dict[Any, int] = {}
        self.bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Any, build: Callable[..., Any], *args: Any) -> Any:
        """``build(*args)``, computed once per ``key`` and place; while tracing, built every time."""
        if not EAGER.known and tracing():
            return build(*args)
        key = (key, str(paddle.device.get_device()))
        with self._lock:
            value = self.items.get(key, _MISSING)
            if value is not _MISSING:
                self.items.move_to_end(key)
                return value
        value = build(*args)
        nbytes = _nbytes(value)
        if nbytes > self.max_bytes:
            return value  # too large to keep: built again at the next use
        with self._lock:
            stored = self.items.get(key, _MISSING)
            if stored is not _MISSING:  # another thread built it meanwhile
                self.items.move_to_end(key)
                return stored
            self.items[key] = value
            self.sizes[key] = nbytes
            self.bytes += nbytes
            while self.items and (len(self.items) > max(self.size, 1) or self.bytes > self.max_bytes):
                old, _ = self.items.popitem(last=False)
                self.bytes -= self.sizes.pop(old, 0)
        return value

    def clear(self) -> int:
        """Drop every entry; returns the bytes they held."""
        with self._lock:
            freed = self.bytes
            self.items.clear()
            self.sizes.clear()
            self.bytes = 0
        return freed

    def info(self) -> Dict[str, int]:
        """What the cache holds now (``entries``, ``bytes``) and its bounds (``max_entries``, ``max_bytes``)."""
        with self._lock:
            return {"entries": len(self.items), "bytes": self.bytes, "max_entries": self.size,
                    "max_bytes": self.max_bytes}


CACHE = DeviceCache()


def clear_table_cache() -> int:
    """Free the device tensors ToMe keeps between calls: index tables per grid and batch, constants, and zero
    buffers the size of a merged activation. Returns the bytes released (as counted by :func:`table_cache_info`).

    The table cache is shared by every model in the process and holds at most 64 entries and 64 MiB; clearing it is
    safe at any time (a call in flight keeps the tensors it already uses, and later calls build what they need
    again). (Not the step cache of ``apply_cache``, nor the plans kept by ``recompute_every``.)

    >>> import ppdiffusers_tome
    >>> freed = ppdiffusers_tome.clear_table_cache()
    >>> ppdiffusers_tome.table_cache_info()["entries"]
    0
    """
    return CACHE.clear()


def table_cache_info() -> Dict[str, int]:
    """What ToMe's device table cache holds now: ``entries``, ``bytes``, and its bounds ``max_entries`` and
    ``max_bytes`` (a table larger than ``max_bytes`` is not kept; the least recently used entries go first).

    >>> sorted(table_cache_info())
    ['bytes', 'entries', 'max_bytes', 'max_entries']
    """
    return CACHE.info()


def clear_cache() -> int:
    """Deprecated name of :func:`clear_table_cache` (0.12.0; "cache" alone now means the step cache of
    ``apply_cache``): warns, then does the same."""
    warnings.warn("ppdiffusers_tome.clear_cache is deprecated: call clear_table_cache (the device tables of the merge "
                  "core; the step cache is apply_cache's)", DeprecationWarning, stacklevel=2)
    return clear_table_cache()


def cache_info() -> Dict[str, int]:
    """Deprecated name of :func:`table_cache_info` (0.12.0): warns, then does the same."""
    warnings.warn("ppdiffusers_tome.cache_info is deprecated: call table_cache_info (the device tables of the merge "
                  "core; the step cache's state is cache_status)", DeprecationWarning, stacklevel=2)
    return table_cache_info()


def batch_tables(name: str, batch: int, like: paddle.Tensor, build: Callable[..., Any], *args: Any,
                 per_item: int = 1) -> Any:
    """``build(count, *args)``: tables for ``batch`` items, cached per ``(name, batch, *args)`` in eager mode; while
    tracing a dynamic batch (``batch < 0``) built from the runtime shape of ``like``, whose first axis holds
    ``per_item`` rows per item (so the program follows its input's batch). The one way every per-batch table of the
    merge core is made.

    >>> import paddle
    >>> offsets = batch_tables("doc", 2, None, lambda count, n: paddle.arange(count) * n, 5)
    >>> offsets.tolist()
    [0, 5]
    """
    if batch < 0:
        count = paddle.shape(like)[0]
        return build(count // per_item if per_item != 1 else count, *args)
    return CACHE.get((name, batch) + args, build, batch, *args)


def const(values: Any, dtype: str = "int64") -> paddle.Tensor:
    """A device tensor of ``values`` (a host array or number), uploaded now: for tables built once and cached."""
    return paddle.to_tensor(np.asarray(values, dtype=dtype))


def constant(value: float, dtype: str, shape: Sequence[int] = ()) -> paddle.Tensor:
    """A cached constant tensor on the current device (a Python scalar operand would be uploaded at every call)."""
    return CACHE.get(("constant", float(value), dtype, tuple(shape)), paddle.full, list(shape), value, dtype)

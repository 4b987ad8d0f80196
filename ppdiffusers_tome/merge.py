"""Pure token-merging core: partition, bipartite soft matching, merge and unmerge.

Nothing in this file knows about UNets, pipelines or hooks. It maps tensors to tensors, so it can be tested
and benchmarked on its own. The model glue in :mod:`ppdiffusers_tome.patch` builds one :class:`MergePlan` per
transformer block call and applies its ``merge``/``unmerge`` around the block's sub-layers.

Everything a forward pass runs stays on the device: the random partition is drawn from an integer hash of
``(seed, block, grid, timestep, cell)`` computed with tensor ops (no host RNG, no upload, no read of the timestep),
index tables are cached per grid and place, and no Python decision depends on a tensor's value or on the batch
size. So the same code runs eagerly and under ``paddle.jit.to_static``, also with a dynamic batch.

CUDA graphs: what is known, and what is not. Capturing a forward in a CUDA graph needs no host synchronisation, no
host-to-device copy and no Python decision on tensor values inside the captured region, and shapes fixed by the
input shapes. Tests check these properties on the CPU, running the GPU branch's kernels there
(:data:`DEVICE_OVERRIDE`): no host<->device transfer in a patched forward (``tests/test_gpu_path.py``, both
branches) and no single-row ``argsort``, which synchronises on Paddle's GPU build (``tests/test_merge.py``).
Export to a static graph with a dynamic batch (``tests/test_static_graph.py``, CPU kernels) shows that no Python
decision depends on tensor values or the batch size, and with a constant ratio ``r = int(N * ratio)`` follows from
the token count alone. What is not known: this code has never been captured in, or run from, a CUDA graph (the
project has no GPU). Index tables and constants are built and uploaded on the first call at a grid, so a capture
would need a warm-up call first; a ratio schedule and ``recompute_every`` read the timestep on the host (a sync)
and cannot be captured.

Layout of a plan (per batch item ``b``; ``N`` tokens in partition order: ``Ns`` src then ``Nd`` dst; ``r`` merged)::

    merged row:   0 ........ Ns-r-1 | Ns-r ........ Ns-r+Nd-1
    holds:        unmerged src       | dst (each the mean of itself and the src merged into it)

The merge is one ``index_add`` of the weighted rows on both branches. On a CPU it adds in order; on a GPU it adds
floats with atomics (the last bits may change run to run), unless a plan is built with ``deterministic=True``, which
sums each group as the difference of two float64 running sums instead. :func:`device_kind` picks the branch (CPU or
GPU kernels) from the tensor's place.
"""

from __future__ import annotations

import functools
import math
import random as _random
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import paddle
import paddle.nn.functional as F

__all__ = [
    "DOWNSAMPLE_MODES",
    "cache_info",
    "clear_cache",
    "DownsamplePlan",
    "LocalMergePlan",
    "MergePlan",
    "bipartite_soft_matching_random2d",
    "compute_dtype",
    "converting",
    "device_kind",
    "downsample_tokens",
    "find_downsample",
    "grid_partition",
    "max_ratio",
    "partition_table",
    "step_key",
    "tracing",
    "window_partition_table",
    "window_sides",
]

_LOW_PRECISION = ("float16", "bfloat16")
_MERGE_MODES = ("mean", "sum")
DOWNSAMPLE_MODES = ("nearest", "average")
_TINY = 1.1754944e-38  # smallest normal float32
_KINDS = ("cpu", "gpu")

GeneratorLike = Union[None, int, np.random.Generator]

# Which device's kernels to use, whatever the tensors' place: None (decide by place), "cpu" or "gpu". Tests set it
# to run the GPU branch's logic on a CPU.
DEVICE_OVERRIDE: Optional[str] = None


def _dtype_name(dtype) -> str:
    return str(dtype).replace("paddle.", "")


def compute_dtype(dtype) -> str:
    """Return the dtype in which merge arithmetic runs for activations of ``dtype``.

    float16 and bfloat16 are promoted to float32 (a mean over many tokens loses precision in half types, and
    Paddle's CPU build has no half-precision gather). Every other dtype is kept.

    >>> import paddle
    >>> compute_dtype(paddle.float16), compute_dtype(paddle.float32)
    ('float32', 'float32')
    """
    name = _dtype_name(dtype)
    return "float32" if name in _LOW_PRECISION else name


def max_ratio(sx: int, sy: int) -> float:
    """Largest admissible merge ratio (exclusive) for strides ``sx``, ``sy``: ``1 - 1/(sx*sy)``.

    >>> max_ratio(2, 2)
    0.75
    """
    return 1.0 - 1.0 / (sx * sy)


try:
    from paddle.base.dygraph.base import in_sot_simulation_mode as _in_sot_simulation
    from paddle.base.dygraph.base import in_to_static_mode as _in_to_static
except ImportError:  # pragma: no cover - older Paddle
    _in_sot_simulation = _in_to_static = None


def tracing() -> bool:
    """Whether this code is being converted to a static graph (``paddle.jit.to_static``) rather than run eagerly.

    In the default SOT mode Paddle simulates the bytecode and answers ``in_sot_simulation_mode()`` with True; the
    functions are imported once at module level, since an ``import`` statement inside the simulation breaks the
    graph and would run this check natively (where it says False)."""
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


def device_kind(x: Any = None) -> str:
    """``"gpu"`` when ``x`` lives on a GPU (or, while tracing, when the program will run on one), else ``"cpu"``.

    :data:`DEVICE_OVERRIDE` takes precedence. The GPU branch differs in four places: the matching (unit rows and
    similarity in the tokens' own dtype, fewer kernels), the unmerge gather (no float32 round trip for half dtypes),
    the sort (at least two rows, so Paddle never takes its synchronising single-row Thrust path) and the
    ``deterministic`` merge (a scan instead of ``index_add``'s float atomics; a CPU adds in order anyway).

    >>> import paddle
    >>> device_kind(paddle.ones([1]))
    'cpu'
    """
    if DEVICE_OVERRIDE is not None:
        if DEVICE_OVERRIDE not in _KINDS:
            raise ValueError(f"DEVICE_OVERRIDE must be None or one of {_KINDS}; got {DEVICE_OVERRIDE!r}")
        return DEVICE_OVERRIDE
    place = getattr(x, "place", None)
    check = getattr(place, "is_gpu_place", None)
    if callable(check):
        try:
            return "gpu" if check() else "cpu"
        except Exception:  # pragma: no cover - a place that cannot answer
            pass
    return "gpu" if paddle.is_compiled_with_cuda() and str(paddle.device.get_device()).startswith("gpu") else "cpu"


def find_downsample(latent_h: int, latent_w: int, num_tokens: int, limit: int = 1 << 12) -> Optional[int]:
    """Find the power-of-two downsampling factor ``d`` whose token grid ``ceil(H/d) x ceil(W/d)`` has exactly
    ``num_tokens`` tokens, or ``None`` if no level matches.

    A stride-2 convolution with padding 1 maps a side of length ``s`` to ``ceil(s/2)``, so the grid at level ``d``
    is ``ceil(H/d) x ceil(W/d)``. Unlike ``ceil(sqrt(H*W // N))`` this is right for odd latent sizes at every level.

    >>> find_downsample(9, 11, 2 * 2)  # the 8x level of a 9x11 latent: 2x2 tokens
    8
    >>> find_downsample(64, 64, 100) is None
    True
    """
    d = 1
    while d <= limit:
        gh, gw = -(-latent_h // d), -(-latent_w // d)
        if gh * gw == num_tokens:
            return d
        if gh * gw < num_tokens or (gh == 1 and gw == 1):
            return None
        d *= 2
    return None


# Device-side tables ---------------------------------------------------------------------------------------------
DEFAULT_CACHE_BYTES = 64 * 2**20  # device memory the cache may hold; a table larger than this is built at each use


def _nbytes(value: Any) -> int:
    """Device bytes held by a cached value (a tensor, or a dict / tuple / list of them; other values count 0)."""
    if isinstance(value, paddle.Tensor):
        return int(np.prod(value.shape, dtype=np.int64)) * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(item) for item in value.values())
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(item) for item in value)
    return 0


class _DeviceCache:
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
        """``build(*args)``, computed once per ``key`` and place. (Arguments instead of closures: Paddle's SOT
        tracer cannot follow closure cells.)"""
        if tracing():
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


_MISSING = object()
_CACHE = _DeviceCache()


def clear_cache() -> int:
    """Free the device tensors ToMe keeps between calls: index tables per grid and batch, constants, and zero
    buffers the size of a merged activation. Returns the bytes released (as counted by :func:`cache_info`).

    The cache is shared by every model in the process and holds at most 64 entries and 64 MiB; clearing it is safe
    at any time (a call in flight keeps the tensors it already uses, and later calls build what they need again).

    >>> import ppdiffusers_tome
    >>> freed = ppdiffusers_tome.clear_cache()
    >>> ppdiffusers_tome.cache_info()["entries"]
    0
    """
    return _CACHE.clear()


def cache_info() -> Dict[str, int]:
    """What ToMe's device cache holds now: ``entries``, ``bytes``, and its bounds ``max_entries`` and
    ``max_bytes`` (a table larger than ``max_bytes`` is not kept; the least recently used entries go first)."""
    return _CACHE.info()


def _const(values: Any, dtype: str = "int64") -> paddle.Tensor:
    return paddle.to_tensor(np.asarray(values, dtype=dtype))


# 31-bit integer hash: every value stays below 2**31 and every constant below 2**31, so products stay below 2**62
# and never overflow int64, on any device.
_MASK31 = (1 << 31) - 1
_MULTIPLIERS = (0x2C1B3C6D, 0x297A2D39)
_W_STEP, _W_BLOCK, _W_SEED, _W_CELL = 0x5BD1E995 & _MASK31, 0x1B873593, 0x68E31DA4, 0x3C6EF372 | 1


def _build_hash_constants() -> Dict[str, paddle.Tensor]:
    # every operand a device tensor: a Python scalar operand would be uploaded at each call (a sync on a GPU)
    return {
        "mask": _const(_MASK31), "m1": _const(_MULTIPLIERS[0]), "m2": _const(_MULTIPLIERS[1]),
        "step": _const(_W_STEP), "s15": _const(15), "s16": _const(16), "zero": _const(0.0, "float32"),
    }


def _hash_constants() -> Dict[str, paddle.Tensor]:
    return _CACHE.get("hash", _build_hash_constants)


def _mix31(x: paddle.Tensor, c: Dict[str, paddle.Tensor]) -> paddle.Tensor:
    """Avalanche a tensor of int64 values in [0, 2**31) (two xor-shift-multiply rounds, as in MurmurHash3's
    finaliser, on 31 bits)."""
    shift = paddle.bitwise_right_shift
    x = paddle.bitwise_xor(x, shift(x, c["s16"]))
    x = paddle.bitwise_and(x * c["m1"], c["mask"])
    x = paddle.bitwise_xor(x, shift(x, c["s15"]))
    x = paddle.bitwise_and(x * c["m2"], c["mask"])
    return paddle.bitwise_xor(x, shift(x, c["s16"]))


def _mix31_int(x: int) -> int:
    """The same hash on a Python int (for keys made on the host)."""
    x &= _MASK31
    x ^= x >> 16
    x = (x * _MULTIPLIERS[0]) & _MASK31
    x ^= x >> 15
    x = (x * _MULTIPLIERS[1]) & _MASK31
    return x ^ (x >> 16)


def step_key(timestep: Any) -> paddle.Tensor:
    """A 0-d int64 device tensor that identifies the denoising step of a call, computed from the timestep without
    reading it on the host: the largest timestep of the batch, in 1/1024 units, on 31 bits. Python numbers (and
    ``None``, as 0) are turned into a constant with a fill op, which uploads nothing.

    Both halves of classifier-free guidance (same timestep) get the same key whether they come in one call or two.

    >>> import paddle
    >>> int(step_key(paddle.to_tensor([999, 999]))) == int(step_key(999))
    True
    """
    if timestep is None or isinstance(timestep, (int, float, np.integer, np.floating)):
        return paddle.full([], _host_step_key(timestep), dtype="int64")
    c = _hash_constants()
    if _dtype_name(timestep.dtype) == "bool":  # (Paddle has no max kernel for bool)
        timestep = timestep.astype("int64")
    t = timestep.max()
    if _dtype_name(t.dtype) in ("int64", "int32"):
        t = t.astype("int64") * 1024
    else:
        t = (t.astype("float64") * 1024.0).round().astype("int64")
    return paddle.bitwise_and(t, c["mask"])


def _host_step_key(timestep: Any) -> int:
    """:func:`step_key` of a Python number (or ``None``): NaN and infinities, which the model itself accepts, key
    as 0 like ``None`` instead of failing to become an integer."""
    if timestep is None:
        return 0
    if isinstance(timestep, (int, np.integer)) and not isinstance(timestep, bool):
        return (int(timestep) * 1024) & _MASK31
    value = float(timestep)
    return int(round(value * 1024)) & _MASK31 if math.isfinite(value) else 0


class _Grid:
    """Host-side description of one ``h x w`` grid with ``sy x sx`` cells (numpy, cached by :func:`_grid`)."""

    def __init__(self, h: int, w: int, sx: int, sy: int):
        self.h, self.w, self.sx, self.sy = h, w, sx, sy
        self.slots = sx * sy
        rows = np.arange(h // sy, dtype=np.int64)[:, None] * (sy * w)
        cols = np.arange(w // sx, dtype=np.int64)[None, :] * sx
        self.cell_origin = (rows + cols).reshape(-1)
        self.num_dst = len(self.cell_origin)
        self.num_src = h * w - self.num_dst
        is_dst = np.zeros(h * w, dtype=bool)
        is_dst[self.cell_origin] = True
        self.top_left = np.concatenate([np.flatnonzero(~is_dst), self.cell_origin]).astype(np.int64)
        grid_salt = _mix31_int(h * 0x10001 + w * 0x101 + sx * 0x11 + sy)
        cells = np.arange(self.num_dst, dtype=np.int64)
        self.cell_key = (cells * _W_CELL + grid_salt) & _MASK31
        # for every grid position: its cell and its slot in the cell (leftover positions: cell 0, slot -1)
        ys, xs = np.divmod(np.arange(h * w, dtype=np.int64), w)
        inside = (ys < (h // sy) * sy) & (xs < (w // sx) * sx)
        self.cell_of = np.where(inside, (ys // sy) * (w // sx) + xs // sx, 0)
        self.slot_of = np.where(inside, (ys % sy) * sx + xs % sx, -1)

    def tensors(self) -> Dict[str, paddle.Tensor]:
        """The device copies of the tables (cached per place)."""
        return _CACHE.get(("grid", self.h, self.w, self.sx, self.sy), _grid_tensors, self)


def _grid_tensors(grid: "_Grid") -> Dict[str, paddle.Tensor]:
    return {
        "top_left": _const(grid.top_left),
        "cell_key": _const(grid.cell_key[None, :]),
        "cell_of": _const(grid.cell_of),
        "slot_of": _const(grid.slot_of[None, :]),
        "slots": _const(grid.slots),
    }


@functools.lru_cache(maxsize=64)
def _grid(h: int, w: int, sx: int, sy: int) -> _Grid:
    return _Grid(h, w, sx, sy)


def _cell_count(h: int, w: int, sx: int, sy: int) -> int:
    return (h // sy) * (w // sx)


def partition_table(h: int, w: int, sx: int, sy: int, step: paddle.Tensor, seed: int, blocks: int) -> paddle.Tensor:
    """Random partitions of an ``h x w`` grid for ``blocks`` blocks at once: an int64 ``[max(blocks, 2), h*w]``
    tensor whose row ``i`` lists the grid positions of block ``i`` in partition order (src in increasing position,
    then dst). Each full ``sy x sx`` cell holds one dst, drawn uniformly from a hash of ``(seed, block, grid,
    step, cell)``; leftover rows and columns are src.

    ``step`` is a 0-d int64 tensor (see :func:`step_key`). Everything runs on the device; a table of one block
    still has two rows, so the sort below never takes Paddle's synchronising single-row GPU path.

    >>> import paddle
    >>> table = partition_table(4, 4, 2, 2, step_key(999), seed=0, blocks=1)
    >>> list(table.shape), sorted(table[0].numpy().tolist()) == list(range(16))
    ([2, 16], True)
    """
    grid = _grid(int(h), int(w), int(sx), int(sy))
    rows = max(int(blocks), 2)
    if grid.num_dst == 0:
        return _CACHE.get(("top_left_rows", h, w, sx, sy, rows), _const, np.tile(grid.top_left, (rows, 1)))
    is_dst = _dst_flags(grid.tensors(), step, seed, rows)  # [rows, N]
    return paddle.argsort(is_dst, axis=1, stable=True)  # src (flag 0) first, then dst, each in position order


def _dst_flags(tables: Dict[str, paddle.Tensor], step: paddle.Tensor, seed: int, rows: int) -> paddle.Tensor:
    """``[rows, N]`` int32, 1 where a token is the dst of its cell: each cell's dst slot drawn from a hash of
    ``(seed, row, cell key, step)``; ``tables`` give every cell's key and every token's cell and slot."""
    c = _hash_constants()
    salts = _CACHE.get(("salts", int(seed), rows), _const, _block_salts(int(seed), rows))
    x = paddle.bitwise_and(step * c["step"] + salts + tables["cell_key"], c["mask"])  # [rows, cells]
    slot = paddle.remainder(_mix31(x, c), tables["slots"])  # the dst slot of every cell
    return paddle.equal(paddle.gather(slot, tables["cell_of"], axis=1), tables["slot_of"]).astype("int32")


def _seed_salt(seed: int) -> int:
    """The 31-bit salt of a partition seed, made from all of its bits: one-to-one on ``[0, 2**31)`` (and equal to
    the salt of releases up to 0.4.0 below ``2**29``); each further 31-bit chunk of a larger seed is mixed in with
    the integer hash, so seeds that differ in any bit give different partitions (up to chance collisions)."""
    seed = int(seed)
    low = seed & _MASK31
    # _W_SEED is a multiple of 4, so low * _W_SEED alone would repeat every 2**29: the top two bits fill the gap
    salt = (low * _W_SEED + (low >> 29)) & _MASK31
    high = seed >> 31
    while high:
        salt = _mix31_int(salt ^ (high & _MASK31) ^ 0x2545F491)
        high >>= 31
    return salt


def _block_salts(seed: int, rows: int) -> np.ndarray:
    """``[rows, 1]`` int64: the salt of every block's row for ``seed``. (No comprehension: Paddle's SOT tracer
    cannot follow its closure cells.)"""
    blocks = np.arange(rows, dtype=np.int64) * _W_BLOCK  # < 2**62
    return ((blocks + _seed_salt(seed)) & _MASK31).reshape([rows, 1])


def _generator_seed(generator: GeneratorLike) -> int:
    """The partition seed a ``generator`` stands for: its next 31-bit draw (an int seeds a numpy Generator first,
    so ``5`` and ``np.random.default_rng(5)`` give the same partition)."""
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool):
        generator = np.random.default_rng(int(generator))
    if isinstance(generator, np.random.Generator):
        return int(generator.integers(0, _MASK31))
    if generator is None:
        return _random.SystemRandom().randrange(_MASK31)
    raise TypeError(
        f"generator must be None, an int seed or a numpy.random.Generator, got {type(generator).__name__}"
    )


def grid_partition(
    h: int, w: int, sx: int, sy: int, no_rand: bool = True, generator: GeneratorLike = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Split an ``h x w`` token grid into src and dst positions (row-major token indices), on the host.

    Every full ``sy x sx`` cell holds exactly one dst token: its top-left token when ``no_rand``, otherwise the one
    :func:`bipartite_soft_matching_random2d` draws for the same ``generator`` (an int seed or a numpy Generator;
    Paddle's global RNG is never used). Rows and columns left over when ``h``/``w`` are not multiples of
    ``sy``/``sx`` are all src. Returns ``(src_pos, dst_pos)``, src in increasing position order.

    >>> src, dst = grid_partition(4, 4, 2, 2)
    >>> dst.tolist()
    [0, 2, 8, 10]
    >>> len(src)
    12
    """
    h, w, sx, sy = int(h), int(w), int(sx), int(sy)
    if _cell_count(h, w, sx, sy) == 0:
        return np.arange(h * w, dtype=np.int64), np.zeros(0, dtype=np.int64)
    grid = _grid(h, w, sx, sy)
    if no_rand:
        order = grid.top_left
    else:
        seed = _generator_seed(generator)
        order = partition_table(h, w, sx, sy, paddle.full([], 0, dtype="int64"), seed, 1)[0].numpy()
    return order[: grid.num_src].copy(), order[grid.num_src :].copy()


# Per-batch index helpers --------------------------------------------------------------------------------------------
def _batch_tables(batch: int, num_tokens: int, merged_tokens: int, kept: int, like: paddle.Tensor) -> Dict[str, Any]:
    """Row tables a plan of ``batch`` items needs: ``off_n`` (first row of each item in the input), ``off_dst``
    (row of each item's first dst in the merged output), ``rows_m`` (``[B, M]``: every merged row), and constant
    columns for the scatter and the group counts. Cached per batch size in eager mode; built from the tensor's runtime shape
    while tracing (a dynamic batch is ``-1`` there)."""
    if batch < 0:
        return _build_batch_tables(paddle.shape(like)[0], num_tokens, merged_tokens, kept)
    return _CACHE.get(("batch", batch, num_tokens, merged_tokens, kept), _build_batch_tables, batch, num_tokens,
                      merged_tokens, kept)


def _build_batch_tables(count: Any, num_tokens: int, merged_tokens: int, kept: int) -> Dict[str, Any]:
    items = paddle.arange(count, dtype="int64").unsqueeze(-1)
    return {
        "off_n": items * num_tokens,
        "off_dst": items * merged_tokens + kept,
        "rows_m": paddle.arange(merged_tokens, dtype="int64").unsqueeze(0) + items * merged_tokens,
        "zeros_n": paddle.zeros([count * num_tokens], dtype="int64"),
        "zeros_m": paddle.zeros([count * merged_tokens, 1], dtype="float32"),
        "ones_n": paddle.ones([count * num_tokens, 1], dtype="float32"),
    }


def _group_batch_tables(batch: int, num_dst: int, length: int, like: paddle.Tensor) -> Dict[str, Any]:
    """Per-batch tables of the deterministic merge: ``dst_keys`` (``[B, Nd]``: ``2d``), a ``spare`` key row, and
    ``last`` (``[B, 1]``: ``b * length - 1``, turning an item's group end count into a flat row)."""
    if batch < 0:
        return _build_group_tables(paddle.shape(like)[0], num_dst, length)
    return _CACHE.get(("groups", batch, num_dst, length), _build_group_tables, batch, num_dst, length)


def _build_group_tables(count: Any, num_dst: int, length: int) -> Dict[str, Any]:
    keys = paddle.arange(num_dst, dtype="int64").unsqueeze(0) * 2
    return {
        "dst_keys": paddle.tile(keys, [count, 1]),
        "spare": paddle.zeros([1, length], dtype="int64"),
        "last": paddle.arange(count, dtype="int64").unsqueeze(-1) * length - 1,
    }


def _score_offsets(batch: int, num_src: int, num_dst: int, like: paddle.Tensor) -> paddle.Tensor:
    """``[B, Ns]`` offset of each score row in the flattened ``[B, Ns, Nd]`` similarity (for reading each row's best
    score with one gather instead of a second pass over the matrix)."""
    if batch < 0:
        return _build_score_offsets(paddle.shape(like)[0], num_src, num_dst)
    return _CACHE.get(("score_rows", batch, num_src, num_dst), _build_score_offsets, batch, num_src, num_dst)


def _build_score_offsets(count: Any, num_src: int, num_dst: int) -> paddle.Tensor:
    return (paddle.arange(count * num_src, dtype="int64") * num_dst).reshape([-1, num_src])


def similarity_dtype(dtype: Any, kind: str) -> str:
    """The dtype in which tokens are normalised and compared (the ``[B, Ns, Nd]`` similarity) for tokens of
    ``dtype`` on ``kind`` kernels: a GPU keeps float16/bfloat16 (tensor cores, half the bytes of the largest
    temporary, as tomesd does); a CPU has no half-precision matmul and uses float32. float32 and float64 stay.

    >>> import paddle
    >>> similarity_dtype(paddle.float16, "gpu"), similarity_dtype(paddle.float16, "cpu")
    ('float16', 'float32')
    """
    name = _dtype_name(dtype)
    if name in _LOW_PRECISION:
        return name if kind == "gpu" else "float32"
    return name if name in ("float32", "float64") else "float32"


def _constant(value: float, dtype: str, shape: Sequence[int] = ()) -> paddle.Tensor:
    """A cached constant tensor on the current device (scalar operands would be uploaded at every call)."""
    return _CACHE.get(("constant", float(value), dtype, tuple(shape)), paddle.full, list(shape), value, dtype)


def _clear_non_finite(x: paddle.Tensor, value: float = 0.0) -> paddle.Tensor:
    """``x`` (this code's own buffer) with NaN and inf replaced by ``value``, in place. (``where_`` rather than
    ``masked_fill_``: Paddle 3.3's ``masked_fill_`` adds a cast of its bool mask, one more operator.)"""
    return paddle.where_(paddle.isfinite(x), x, _constant(value, _dtype_name(x.dtype)))


def _normalize_rows(x: paddle.Tensor, kind: str, in_place: bool = False) -> paddle.Tensor:
    """The rows of ``x`` as unit vectors, computed scale-free: each row is first divided by its largest absolute
    value, so neither the square of 1e30 (nor, in float16, of 300) nor that of 1e-30 leaves the dtype. Rows that
    are all zero or hold NaN or inf become NaN (0/0, x/inf): callers clear them. One new buffer at most (none with
    ``in_place``, for a tensor this code owns). A GPU takes the 2-norm in one kernel; Paddle's CPU build runs that
    kernel slowly, so a CPU squares and sums with a matmul."""
    largest = paddle.linalg.norm(x, p=float("inf"), axis=-1, keepdim=True)
    x = x.divide_(largest) if in_place else x / largest
    if kind == "gpu":
        return x.divide_(paddle.linalg.norm(x, p=2, axis=-1, keepdim=True))
    ones = _constant(1.0, _dtype_name(x.dtype), (x.shape[-1], 1))
    return x.multiply_(paddle.rsqrt(paddle.matmul(paddle.square(x), ones)))


def _unit_rows(metric: paddle.Tensor, kind: str = "gpu") -> paddle.Tensor:
    """``metric`` as unit vectors along the last axis in a new tensor of its dtype (see :func:`_normalize_rows`);
    tokens that are all zero or hold NaN or inf come out as zero vectors (similarity 0 to every token)."""
    return _clear_non_finite(_normalize_rows(metric, kind))


def _match_gpu(metric: paddle.Tensor, partition: paddle.Tensor, num_src: int) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Best dst and its cosine similarity for every src, the GPU way: few kernels (each one a launch), the unit rows
    and the similarity in the tokens' own dtype (see :func:`similarity_dtype`). Next to the similarity only one
    ``[B, N, C]`` temporary is alive."""
    work = similarity_dtype(metric.dtype, "gpu")
    unit = _unit_rows(metric if _dtype_name(metric.dtype) == work else metric.astype(work))
    src, dst = paddle.split(paddle.gather(unit, partition, axis=1), [num_src, metric.shape[1] - num_src], axis=1)
    del unit
    scores = paddle.matmul(src, dst, transpose_y=True)  # [B, Ns, Nd]
    del src, dst
    return scores.max(axis=-1), scores.argmax(axis=-1)


def _match_cpu(metric: paddle.Tensor, partition: paddle.Tensor, num_src: int) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Best dst and its cosine similarity for every src, the CPU way: fewer passes over the tokens, more (cheap)
    operators, since on a CPU a pass costs milliseconds and an operator microseconds.

    * One scale for all tokens, the reciprocal of the largest finite dst magnitude, keeps every square inside
      float32, so scaling all tokens by the same factor changes no decision (a token ~1e18 times smaller or larger
      than the dst counts as similarity 0, as do tokens holding NaN or inf).
    * Only the dst become unit rows; the src enter the similarity as they are (a positive factor per row does not
      move a row's argmax) and each src's best score is divided by its norm afterwards.
    * Row sums run as a matmul with a ones column (several times faster than a reduction on Paddle's CPU build),
      and each row's best score is read with one gather instead of a second pass over the similarity.
    """
    work = similarity_dtype(metric.dtype, "cpu")
    if _dtype_name(metric.dtype) != work:
        metric = metric.astype(work)
    batch, num_dst, channels = int(metric.shape[0]), metric.shape[1] - num_src, metric.shape[2]
    ones = _constant(1.0, work, (channels, 1))
    src = paddle.gather(metric, partition[:num_src], axis=1)
    dst = paddle.gather(metric, partition[num_src:], axis=1)
    dst_max = paddle.linalg.norm(dst, p=float("inf"), axis=-1, keepdim=True)  # [B, Nd, 1]
    scale = paddle.reciprocal(paddle.scale(paddle.max(_clear_non_finite(dst_max)), 1.0, _TINY))
    # in place wherever the tensor is this function's own: a fresh buffer costs about as much as the pass itself
    # (always rebinding the result: a static program's in-place op only takes effect through its output)
    dst = dst.scale_(scale)
    dst = dst.multiply_(paddle.rsqrt(paddle.matmul(paddle.square(dst), ones)))  # 0/0, inf/inf give NaN: cleared next
    dst = _clear_non_finite(dst)
    scaled = paddle.scale(src, scale)
    src_norm2 = paddle.matmul(paddle.square_(scaled), ones)  # [B, Ns, 1]
    del scaled
    scores = paddle.matmul(src, dst, transpose_y=True)  # [B, Ns, Nd]: cosine similarity times |src|
    best_dst = scores.argmax(axis=-1)
    rows = (best_dst + _score_offsets(-1 if tracing() else batch, num_src, num_dst, metric)).reshape([-1])
    best = paddle.gather(scores.reshape([-1]), rows).reshape([-1, num_src])
    cosine = best * scale * paddle.rsqrt(src_norm2.reshape([-1, num_src]))
    return _clear_non_finite(cosine), best_dst


class MergePlan:
    """How to merge ``[B, N, C]`` tokens to ``[B, N - r, C]`` and back; build one with :meth:`from_matching`.

    It unpacks as ``merge, unmerge = plan``. With ``r == 0`` both are identities.

    Attributes: ``r`` (tokens removed per item), ``num_tokens`` (N), ``batch_size`` (B, ``-1`` while tracing a
    dynamic batch), ``kind`` (``"cpu"`` or ``"gpu"`` kernels), and, for plans with ``r > 0``, ``src_pos``/``dst_pos``
    (the partition, ``[Ns]``/``[Nd]``), ``merged_pos`` and ``merged_into`` (``[B, r]``: the grid position of each
    merged src, and of the dst it joined).
    """

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: str = "cpu", deterministic: bool = False):
        self.num_tokens = int(num_tokens)
        self.batch_size = int(batch_size)
        self.r = max(int(r), 0)
        self.kind = kind
        self.deterministic = bool(deterministic)
        self.num_src = 0
        self.partition: Optional[paddle.Tensor] = None  # [N] grid positions in partition order
        self.merged_idx: Optional[paddle.Tensor] = None  # [B, r] partition slot of each merged src
        self.merged_dst: Optional[paddle.Tensor] = None  # [B, r] dst slot it joined
        self.tables: Dict[str, paddle.Tensor] = {}

    # construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_matching(
        cls, metric: paddle.Tensor, partition: paddle.Tensor, num_src: int, r: int, kind: Optional[str] = None,
        deterministic: bool = False,
    ) -> "MergePlan":
        """Match the src of ``partition`` (``[N]`` grid positions: ``num_src`` src, then the dst) to their most
        similar dst by cosine similarity of ``metric`` (``[B, N, C]``) and plan the merge of the ``r`` src with the
        highest similarity into their dst (``0 < r <= num_src``).

        ``deterministic=True`` makes the GPU kernels' merge free of float atomics (see :meth:`merge`); the CPU
        kernels are deterministic either way."""
        kind = kind or device_kind(metric)
        num_tokens, batch = int(metric.shape[1]), int(metric.shape[0])
        plan = cls(num_tokens, batch, r, kind, deterministic)
        plan.partition, plan.num_src = partition, int(num_src)
        num_dst = num_tokens - num_src
        with paddle.no_grad():
            match = _match_gpu if kind == "gpu" else _match_cpu
            best, best_dst = match(metric.detach(), partition, plan.num_src)
            # dst rank last (-inf), so one stable sort yields [merged src | kept src | dst]; on a GPU a spare row
            # keeps Paddle's argsort off its synchronising single-row path
            pad = [0, 1 if kind == "gpu" else 0, 0, num_dst]
            order = paddle.argsort(F.pad(best, pad, value=-float("inf")), axis=-1, descending=True, stable=True)
            if kind == "gpu":
                order = order[:-1]
            plan._build(order, best_dst)
        return plan

    def _build(self, order: paddle.Tensor, best_dst: paddle.Tensor) -> None:
        """Turn the sorted src slots into two tables over the ``B*N`` input rows: ``unmerge_rows`` (the merged row
        each input row ends in) and ``row_counts`` (``1+k`` for a row in a group of ``1+k``, 1 for kept src)."""
        n, r, kept = self.num_tokens, self.r, self.num_src - self.r
        m = n - r
        self.merged_idx = order[:, :r]
        self.merged_dst = paddle.take_along_axis(best_dst, self.merged_idx, axis=1, broadcast=False)
        b = _batch_tables(self.batch_size, n, m, kept, order)
        # input rows in sorted order per item: [merged src | kept src | dst]
        rows = paddle.take_along_axis(self.partition + b["off_n"], order, axis=1, broadcast=False).reshape([-1])
        # ... and the merged row of each: its dst's row for a merged src, rows 0 .. M-1 of the item for the rest;
        # every input row is written exactly once, so the scatter has no conflicts (its own base, not the index:
        # a static program may write the output in place)
        ends = paddle.concat([self.merged_dst + b["off_dst"], b["rows_m"]], axis=1).reshape([-1])
        unmerge_rows = paddle.scatter(b["zeros_n"], rows, ends)
        # group sizes 1 + k, counted with exact float adds of 1 (order-free, so deterministic on any device)
        counts = paddle.index_add(b["zeros_m"], unmerge_rows, 0, b["ones_n"])
        row_scale = paddle.gather(paddle.reciprocal(counts), unmerge_rows)  # float32: exact for counts < 2**24
        self.tables = {"unmerge_rows": unmerge_rows, "counts": counts, "row_scale": row_scale}
        if self.kind == "gpu" and self.deterministic:
            self.tables.update(self._group_tables(rows.reshape([-1, n]), counts, b))

    def _group_tables(self, rows: paddle.Tensor, counts: paddle.Tensor, b: Dict[str, Any]) -> Dict[str, Any]:
        """Tables of the deterministic merge (GPU kernels with ``deterministic=True``): every item's dst and merged
        src as one sequence ordered by group (each dst, then the src merged into it, in slot order), the position
        of every group's last member in it, the group sizes and the input rows of the kept src.

        ``rows`` is ``[B, N]``: the input rows in sorted order, ``[merged src | kept src | dst]``."""
        n, r, num_src = self.num_tokens, self.r, self.num_src
        num_dst, length = n - num_src, n - num_src + r
        merged, kept, dst = paddle.split(rows, [r, num_src - r, num_dst], axis=1)
        g = _group_batch_tables(self.batch_size, num_dst, length, rows)
        # group key: dst d is 2d, a src merged into d is 2d + 1; a stable sort keeps the src of a group in slot order
        keys = paddle.concat([g["dst_keys"], paddle.scale(self.merged_dst, 2.0, 1.0)], axis=1)
        # (a spare row keeps a GPU argsort off its synchronising single-row path)
        order = paddle.argsort(paddle.concat([keys, g["spare"]], axis=0), axis=-1, stable=True)[:-1]
        sequence = paddle.take_along_axis(paddle.concat([dst, merged], axis=1), order, axis=1, broadcast=False)
        sizes = counts.reshape([-1, n - r])[:, num_src - r:]  # [B, Nd] float32 1 + k, exact integers
        ends = paddle.cumsum(sizes, axis=1).astype("int64") + g["last"]  # flat row of each group's last member
        return {"group_rows": sequence.reshape([-1]), "group_ends": ends.reshape([-1]), "kept_rows": kept.reshape([-1]),
                "group_sizes": sizes.astype("float64").unsqueeze(-1)}

    def _merge_groups(self, x: paddle.Tensor, mode: str) -> paddle.Tensor:
        """The deterministic merge: each group's sum as the difference of two running sums over the group-ordered
        sequence, in float64 (a scan and gathers: no atomics, a fixed order, memory ``[B, Nd + r, C]``; float64
        keeps the difference of two long running sums exact to well below float32 rounding)."""
        t, channels = self.tables, x.shape[-1]
        num_dst, kept = self.num_tokens - self.num_src, self.num_src - self.r
        flat = x.reshape([-1, channels])
        sequence = paddle.gather(flat, t["group_rows"]).astype("float64").reshape([-1, num_dst + self.r, channels])
        running = paddle.cumsum(sequence, axis=1).reshape([-1, channels])
        del sequence
        totals = paddle.gather(running, t["group_ends"]).reshape([-1, num_dst, channels])  # through each group's end
        del running
        sums = totals - F.pad(totals[:, :-1], [0, 0, 1, 0, 0, 0])  # minus the total through the previous group
        out = sums / t["group_sizes"] if mode == "mean" else sums
        out = out.astype(x.dtype)
        if kept == 0:
            return out
        return paddle.concat([paddle.gather(flat, t["kept_rows"]).reshape([-1, kept, channels]), out], axis=1)

    # description ------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Callable]:
        return iter((self.merge, self.unmerge))

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"MergePlan(batch_size={self.batch_size}, num_tokens={self.num_tokens}, r={self.r}, kind={self.kind!r})"

    @property
    def is_identity(self) -> bool:
        return self.r <= 0

    @property
    def merged_tokens(self) -> int:
        """Tokens per item after ``merge``: ``N - r``."""
        return self.num_tokens - self.r

    @property
    def src_pos(self) -> Optional[paddle.Tensor]:
        """``[Ns]`` grid positions of the src tokens (None for an identity plan)."""
        return None if self.partition is None else self.partition[: self.num_src]

    @property
    def dst_pos(self) -> Optional[paddle.Tensor]:
        """``[Nd]`` grid positions of the dst tokens (None for an identity plan)."""
        return None if self.partition is None else self.partition[self.num_src :]

    @property
    def merged_pos(self) -> Optional[paddle.Tensor]:
        """``[B, r]`` grid position of every merged src (None for an identity plan)."""
        if self.merged_idx is None:
            return None
        return paddle.take_along_axis(self.partition.unsqueeze(0), self.merged_idx, axis=1)

    @property
    def merged_into(self) -> Optional[paddle.Tensor]:
        """``[B, r]`` grid position of the dst each merged src joined (None for an identity plan)."""
        if self.merged_dst is None:
            return None
        return paddle.take_along_axis(self.dst_pos.unsqueeze(0), self.merged_dst, axis=1)

    # application ------------------------------------------------------------------------------------------------
    def _check(self, x: paddle.Tensor, tokens: int, what: str) -> None:
        batch = x.shape[0] if x.ndim == 3 else None
        same_batch = batch == self.batch_size or self.batch_size < 0 or (batch is not None and batch < 0)
        if x.ndim != 3 or not same_batch or x.shape[1] != tokens:
            raise ValueError(
                f"{what} expects a [batch={self.batch_size}, tokens={tokens}, channels] tensor, got shape {list(x.shape)}"
            )

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        """Merge ``x`` of shape ``[B, N, C]`` into ``[B, N - r, C]``.

        ``mode="mean"`` averages each dst with the src merged into it (the ToMe SD rule); ``"sum"`` adds them.
        Arithmetic runs in :func:`compute_dtype`; the result has ``x``'s dtype. The mean is formed as
        ``dst/(1+k) + sum(src/(1+k))``, a convex combination, so it is finite wherever the inputs are.

        Kernels: one ``index_add`` of the (weighted) rows. On a CPU it adds in row order; on a GPU it uses float
        atomics, so the last bits of a sum may differ from run to run. A plan built with ``deterministic=True``
        on GPU kernels sums each group instead as the difference of two float64 running sums (one scan, gathers,
        no atomics): bit-identical run to run, for more kernels and a ``[B, Nd + r, C]`` float64 buffer.
        """
        if mode not in _MERGE_MODES:
            raise ValueError(f"mode must be one of {_MERGE_MODES}, got {mode!r}")
        self._check(x, self.num_tokens, "merge")
        if self.is_identity:
            return x
        if "group_rows" in self.tables:
            return self._merge_groups(x, mode)
        channels, work, t = x.shape[-1], compute_dtype(x.dtype), self.tables
        flat = x.reshape([-1, channels])
        if _dtype_name(x.dtype) != work:
            flat = flat.astype(work)
        if mode == "mean":
            flat = flat * self._row_scale(work)
        # every input row added onto the merged row it ends in
        if self.batch_size < 0:  # a dynamic batch while tracing
            zeros = paddle.zeros([paddle.shape(x)[0] * self.merged_tokens, channels], dtype=work)
        else:
            shape = [self.batch_size * self.merged_tokens, channels]
            zeros = _CACHE.get(("zeros", shape[0], channels, work), paddle.zeros, shape, work)
        out = paddle.index_add(zeros, t["unmerge_rows"], 0, flat)
        return out.astype(x.dtype).reshape([-1, self.merged_tokens, channels])

    def _row_scale(self, work: str) -> paddle.Tensor:
        """``1/(1+k)`` for every input row, in ``work`` (float64 tokens get float64 weights, not float32 ones)."""
        if work == "float32":
            return self.tables["row_scale"]
        counts = self.tables["counts"].astype(work)
        return paddle.gather(paddle.reciprocal(counts), self.tables["unmerge_rows"])

    def unmerge(self, y: paddle.Tensor) -> paddle.Tensor:
        """Map ``y`` of shape ``[B, N - r, C]`` back to ``[B, N, C]``: every token gets the row it was merged into
        (its own row when it was not merged). One gather; the result has ``y``'s dtype."""
        self._check(y, self.merged_tokens, "unmerge")
        if self.is_identity:
            return y
        channels = y.shape[-1]
        flat = y.reshape([-1, channels])
        work = compute_dtype(y.dtype) if self.kind == "cpu" else _dtype_name(y.dtype)
        if _dtype_name(y.dtype) != work:  # Paddle's CPU build has no half-precision gather; the round trip is exact
            flat = flat.astype(work)
        out = paddle.gather(flat, self.tables["unmerge_rows"])
        return out.astype(y.dtype).reshape([-1, self.num_tokens, channels])


def bipartite_soft_matching_random2d(
    metric: paddle.Tensor,
    w: int,
    h: int,
    sx: int,
    sy: int,
    r: int,
    no_rand: bool = False,
    generator: GeneratorLike = None,
    partition: Optional[paddle.Tensor] = None,
    kind: Optional[str] = None,
    deterministic: bool = False,
) -> MergePlan:
    """Plan the merge of ``r`` src tokens into their most similar dst tokens (ToMe SD, Bolya & Hoffman 2023).

    Args:
        metric: ``[B, N, C]`` tokens whose cosine similarity decides the matching (``N == h * w``). Any float
            dtype; similarity is computed scale-free, in float32 on CPU kernels and in the tokens' own dtype on GPU
            kernels (see :func:`similarity_dtype`); tokens that are all zero or not finite count as zero vectors
            (similarity 0), never NaN.
        w, h: the token grid, row-major.
        sx, sy: stride of the dst grid: one dst per ``sy x sx`` cell (see :func:`grid_partition`). A cell larger
            than the grid means no dst, and an identity plan at no cost.
        r: src tokens to merge per batch item; capped at the number of src tokens; ``r <= 0`` gives identities.
        no_rand: take the top-left token of each cell as dst instead of a random one.
        generator: int seed or numpy Generator that keys the random dst choice (Paddle's global RNG is never used);
            ``None`` draws fresh OS entropy. The partition is shared by the whole batch.
        partition: a precomputed ``[N]`` row of :func:`partition_table` (overrides ``no_rand``/``generator``);
            this is how the model glue passes partitions drawn on the device.
        kind: ``"cpu"`` or ``"gpu"`` kernels; default from ``metric``'s place (see :func:`device_kind`).
        deterministic: on GPU kernels, merge without float atomics (bit-identical run to run; see
            :meth:`MergePlan.merge` for the cost). CPU kernels are deterministic either way.

    Returns:
        A :class:`MergePlan`; ``merge, unmerge = bipartite_soft_matching_random2d(...)`` works.

    Example:
        >>> import paddle
        >>> x = paddle.randn([2, 64, 16])
        >>> merge, unmerge = bipartite_soft_matching_random2d(x, w=8, h=8, sx=2, sy=2, r=32, generator=0)
        >>> list(merge(x).shape), list(unmerge(merge(x)).shape)
        ([2, 32, 16], [2, 64, 16])
    """
    if metric.ndim != 3:
        raise ValueError(f"metric must be [batch, tokens, channels], got shape {list(metric.shape)}")
    batch, num_tokens = int(metric.shape[0]), int(metric.shape[1])
    if h * w != num_tokens:
        raise ValueError(f"h * w must equal the token count: {h} * {w} != {num_tokens}")
    if sx < 1 or sy < 1:
        raise ValueError(f"sx and sy must be >= 1, got sx={sx}, sy={sy}")
    num_dst = _cell_count(h, w, sx, sy)
    r = min(int(r), num_tokens - num_dst)
    if num_dst == 0 or r <= 0:
        return MergePlan(num_tokens, batch)
    if partition is None:
        if no_rand:
            partition = _grid(int(h), int(w), int(sx), int(sy)).tensors()["top_left"]
        else:
            step = paddle.full([], 0, dtype="int64")
            partition = partition_table(h, w, sx, sy, step, _generator_seed(generator), 1)[0]
    return MergePlan.from_matching(metric, partition, num_tokens - num_dst, r, kind, deterministic)


# Local matching with a dense plan (issue #17; the recipe of ToMA, Lu et al. 2025) ---------------------------------------
@functools.lru_cache(maxsize=256)
def window_sides(h: int, w: int, window: int, sx: int = 2, sy: int = 2) -> Tuple[int, int]:
    """The window ``(wy, wx)`` used for local matching on an ``h x w`` grid when ``window`` tokens per side are
    asked for: on each axis the divisor of the side closest to ``window`` (on a log scale, the larger one on a tie)
    among those that hold at least one cell (``>= sy`` / ``>= sx``), so that equal windows tile the grid exactly and
    every window has the same number of src and dst. A side with no such divisor but itself (a prime) is one window.

    >>> window_sides(64, 64, 16), window_sides(96, 72, 16), window_sides(65, 67, 16)
    ((16, 16), (16, 18), (13, 67))
    """

    return _window_side(int(h), int(sy), int(window)), _window_side(int(w), int(sx), int(window))


def _window_side(n: int, stride: int, window: int) -> int:
    """One axis of :func:`window_sides`. (A plain loop: Paddle's SOT tracer cannot follow the closure cells of a
    nested function or a comprehension.)"""
    best, best_key = n, None
    for d in range(stride, n + 1):
        if n % d == 0:
            key = (abs(math.log(d / window)), -d)
            if best_key is None or key < best_key:
                best, best_key = d, key
    return best


class _Windows:
    """Host-side description of an ``h x w`` grid cut into equal ``wy x wx`` windows, each with its own ``sy x sx``
    cells (numpy, cached by :func:`_windows`). Token tables are in window-major order: window by window, row-major
    inside a window."""

    def __init__(self, h: int, w: int, wy: int, wx: int, sx: int, sy: int):
        self.h, self.w, self.wy, self.wx, self.sx, self.sy = h, w, wy, wx, sx, sy
        self.count, self.size, self.slots = (h // wy) * (w // wx), wy * wx, sx * sy
        local = _grid(wy, wx, sx, sy)  # the cells of one window
        self.num_dst, self.num_src = local.num_dst, local.num_src  # per window
        win_y, win_x, ty, tx = np.meshgrid(np.arange(h // wy), np.arange(w // wx), np.arange(wy), np.arange(wx),
                                           indexing="ij")
        self.order = ((win_y * wy + ty) * w + (win_x * wx + tx)).reshape(self.count, self.size).astype(np.int64)
        self.inverse = np.argsort(self.order.reshape(-1)).astype(np.int64)  # grid position -> window-major index
        salt = _mix31_int(h * 0x10001 + w * 0x101 + sx * 0x11 + sy + wy * 0x3B9 + wx * 0x1F3 + 1)
        cells = np.arange(self.count * self.num_dst, dtype=np.int64)
        self.cell_key = (cells * _W_CELL + salt) & _MASK31
        self.cell_of = (np.arange(self.count)[:, None] * self.num_dst + local.cell_of[None, :]).reshape(-1)
        self.slot_of = np.tile(local.slot_of, self.count)
        self.top_left = np.tile(local.top_left, (self.count, 1))  # the partition with every cell's top-left as dst

    def tensors(self) -> Dict[str, paddle.Tensor]:
        return _CACHE.get(("windows", self.h, self.w, self.wy, self.wx, self.sx, self.sy), _window_tensors, self)


def _window_tensors(win: "_Windows") -> Dict[str, paddle.Tensor]:
    return {
        "order": _const(win.order), "flat_order": _const(win.order.reshape(-1)), "inverse": _const(win.inverse),
        "cell_key": _const(win.cell_key[None, :]), "cell_of": _const(win.cell_of), "slot_of": _const(win.slot_of[None, :]),
        "slots": _const(win.slots), "top_left": _const(win.top_left),
        "identity": _const(np.tile(np.arange(win.size, dtype=np.int64), (win.count, 1))),
    }


@functools.lru_cache(maxsize=64)
def _windows(h: int, w: int, wy: int, wx: int, sx: int, sy: int) -> _Windows:
    return _Windows(h, w, wy, wx, sx, sy)


def window_partition_table(
    h: int, w: int, wy: int, wx: int, sx: int, sy: int, step: Optional[paddle.Tensor], seed: int, blocks: int
) -> paddle.Tensor:
    """Partitions for local matching, for ``blocks`` blocks at once: an int64 ``[max(blocks, 2), W, T]`` tensor
    (``W`` windows of ``T = wy*wx`` tokens) whose ``[i, k]`` lists the tokens of window ``k`` (window-local,
    row-major) in partition order: src first, then dst, each in position order. Each cell's dst is drawn as in
    :func:`partition_table` (keyed by the window too); ``step=None`` takes every cell's top-left token instead.

    >>> import paddle
    >>> table = window_partition_table(8, 8, 4, 4, 2, 2, step_key(999), seed=0, blocks=1)
    >>> list(table.shape), sorted(table[0, 1].numpy().tolist()) == list(range(16))
    ([2, 4, 16], True)
    """
    win = _windows(int(h), int(w), int(wy), int(wx), int(sx), int(sy))
    rows, t = max(int(blocks), 2), win.tensors()
    if step is None or win.num_dst == 0:
        return paddle.expand(t["top_left"].unsqueeze(0), [rows, win.count, win.size])
    is_dst = _dst_flags(t, step, seed, rows).reshape([rows, win.count, win.size])
    return paddle.argsort(is_dst, axis=-1, stable=True)


def _window_positions(win: "_Windows", partition: paddle.Tensor) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """The grid positions of every window's src ``[W, Ns_w]`` and dst ``[W, Nd_w]`` under ``partition``."""
    pos = paddle.take_along_axis(win.tensors()["order"], partition, axis=1, broadcast=False)  # [W, T] positions
    return paddle.split(pos, [win.num_src, win.num_dst], axis=1)


def _best_in_windows(src: paddle.Tensor, dst: paddle.Tensor, win: "_Windows") -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Best dst and its cosine for every src, window by window (``[B*W, Ns_w]`` each), from unit src and dst rows
    in window order: one batched ``[B*W, Ns_w, Nd_w]`` product. A best similarity that is not finite counts as 0."""
    channels = src.shape[-1]
    src, dst = src.reshape([-1, win.num_src, channels]), dst.reshape([-1, win.num_dst, channels])
    scores = paddle.matmul(src, dst, transpose_y=True)  # [B*W, Ns_w, Nd_w]
    del src, dst
    return _clear_non_finite(scores.max(axis=-1)), scores.argmax(axis=-1)


def _match_windows(metric: paddle.Tensor, win: "_Windows", partition: paddle.Tensor, kind: str
                   ) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Best dst in its window and the cosine similarity to it, for every src of every window: ``[B*W, Ns_w]`` each.
    The src and the dst are gathered into window order (the one token-sized buffer, normalised in place) and
    compared with one batched ``[B*W, Ns_w, Nd_w]`` product. Non-finite tokens are not cleared token by token (a
    dense plan spreads them over their window anyway); a src whose best similarity is not finite counts as 0."""
    work = similarity_dtype(metric.dtype, kind)
    if _dtype_name(metric.dtype) != work:
        metric = metric.astype(work)
    src_pos, dst_pos = _window_positions(win, partition)
    # normalised before the reshape: a static program refuses in-place ops on a reshaped (viewed) tensor
    src = _normalize_rows(paddle.gather(metric, src_pos.reshape([-1]), axis=1), kind, in_place=True)
    dst = _normalize_rows(paddle.gather(metric, dst_pos.reshape([-1]), axis=1), kind, in_place=True)
    return _best_in_windows(src, dst, win)


# feature order cuts its windows along at most this many keys: the cosine with the mean token, then principal axes
# (a side experiment with exact axes on sd15-narrow at 768², 36 windows, 4 seeds: 6 x 6 cuts along two keys were +3%
# from tomesd's distance, 4 x 3 x 3 along three +1%, 2 x 2 x 3 x 3 along four +0%)
MAX_FEATURE_LEVELS = 4
# squarings of the second moment before an axis is read off it: 4 give the 16th power, i.e. 16 power iterations
# (on the inputs of sd15-narrow's 768² blocks 8 iterations left 5-8% of the third axis's variance uncaptured, 16
# left 0-5%; a fifth squaring underflows float32 when the spectrum is flat, see _start_axes)
_MOMENT_SQUARINGS = 4


def _start_axes(count: int, channels: int) -> paddle.Tensor:
    """Fixed start vectors for the power iterations of :func:`_principal_axes`, ``[1, count, C]`` float32 (drawn
    once from a seeded generator), scaled so that an axis's length stays inside float32's range before it is
    normalised.

    With the moment at Frobenius norm 1 its top eigenvalue lies in ``[C**-0.5, 1]``, so its ``2**k``-th power
    (``k`` squarings) shrinks the start vector by a factor in ``[C**-(2**(k-1)), 1]``; the start vectors are
    scaled by the middle of that range, ``C**(2**(k-2))``. For ``k = 4`` and ``C = 1280`` the length then stays
    within about ``1e-13 .. 1e14`` and its square within float32; unscaled, the squares of a flat spectrum's axis
    entries fall below float32's normal range and :func:`_unit_length` returns a vector of the wrong length (about
    1.1 at 1280 channels). (Five squarings would span ``C**-8 .. C**8``, whose square no scale fits.)"""
    return _CACHE.get(("start_axes", count, channels, _MOMENT_SQUARINGS), _build_start_axes, count, channels,
                      _MOMENT_SQUARINGS)


def _build_start_axes(count: int, channels: int, squarings: int) -> paddle.Tensor:
    scale = float(channels) ** (2.0 ** (squarings - 2))
    return _const(scale * np.random.default_rng(channels).standard_normal((1, count, channels)), "float32")


def _unit_length(v: paddle.Tensor) -> paddle.Tensor:
    """``v`` (``[B, 1, C]``) divided by its length; a zero or non-finite vector becomes 0."""
    return _clear_non_finite(v * paddle.rsqrt(paddle.sum(paddle.square(v), axis=-1, keepdim=True)))


def _principal_axes(metric: paddle.Tensor, rnorm: paddle.Tensor, along: paddle.Tensor, count: int) -> paddle.Tensor:
    """The top ``count`` principal axes (``[B, count, C]`` float32, orthonormal, strongest first) of the unit tokens'
    components orthogonal to ``along`` (the unit mean, ``[B, 1, C]`` float32). They have mean 0, so no centring.

    The ``[B, C, C]`` second-moment matrix of the unit tokens is one product over the tokens (in their dtype: the
    factors are scaled by ``1/sqrt(N)`` so every entry and sum stays below 1). Each axis is then found on that small
    matrix in float32: projected off ``along`` and the axes found so far, scaled to Frobenius norm 1, squared
    :data:`_MOMENT_SQUARINGS` times, and a fixed start vector times that power (16 power iterations) is the axis.
    (Deflating before the power, not orthonormalising after it: the 16th power of one matrix maps every start
    vector onto nearly the top axis, and what a Gram-Schmidt would keep of the others is rounding.) Nothing larger
    than ``B * C * C`` besides one transient copy of the tokens."""
    n, channels = metric.shape[1], metric.shape[2]
    scaled = metric * paddle.scale(rnorm, 1.0 / math.sqrt(n))  # [B, N, C]: unit rows / sqrt(N)
    moment = paddle.matmul(scaled, scaled, transpose_x=True)  # [B, C, C], trace <= 1
    del scaled
    if _dtype_name(moment.dtype) != "float32":
        moment = moment.astype("float32")
    start = _start_axes(count, channels)
    found, axes = along, []
    for index in range(count):
        project = _eye(channels) - paddle.matmul(found, found, transpose_x=True)  # [B, C, C]: off what is found
        power = paddle.matmul(paddle.matmul(project, moment), project)
        # (a zero or non-finite power gives a non-finite axis, which _unit_length clears to 0)
        power = power * paddle.rsqrt(paddle.sum(paddle.square(power), axis=[1, 2], keepdim=True))
        for _ in range(_MOMENT_SQUARINGS):
            power = paddle.matmul(power, power)
        axes.append(_unit_length(paddle.matmul(start[:, index:index + 1], power)))  # [B, 1, C]
        if index + 1 < count:
            found = paddle.concat([found, axes[-1]], axis=1)
    return paddle.concat(axes, axis=1) if count > 1 else axes[0]


def _eye(channels: int) -> paddle.Tensor:
    """A cached ``[C, C]`` float32 identity."""
    return _CACHE.get(("eye", channels), _build_eye, channels)


def _build_eye(channels: int) -> paddle.Tensor:
    return _const(np.eye(channels), "float32")


def _feature_keys(metric: paddle.Tensor, kind: str, levels: int) -> paddle.Tensor:
    """The sort keys of feature order, ``[B, N, levels]`` float32, in [-1, 1] (0 for a token that is zero or not
    finite): the cosine of every token with its item's mean unit token ``m``, then the projections of its unit
    vector on the top ``levels - 1`` principal axes of what ``m`` does not explain (:func:`_principal_axes`).
    (On a CPU one ``square`` of the tokens is transient.)"""
    n = metric.shape[1]
    if kind == "gpu":
        rnorm = paddle.reciprocal(paddle.linalg.norm(metric, p=2, axis=-1, keepdim=True))  # [B, N, 1]
    else:
        ones = _constant(1.0, _dtype_name(metric.dtype), (metric.shape[-1], 1))
        rnorm = paddle.rsqrt(paddle.matmul(paddle.square(metric), ones))
    rnorm = _clear_non_finite(rnorm)  # zero, NaN and inf rows weigh nothing
    # means over N (not sums): no product leaves a half-precision range; lengths do not change an order
    mean = paddle.scale(paddle.matmul(rnorm, metric, transpose_x=True), 1.0 / n)  # [B, 1, C]
    directions = mean
    if levels > 1:
        along = _unit_length(mean.astype("float32") if _dtype_name(mean.dtype) != "float32" else mean)
        axes = _principal_axes(metric, rnorm, along, levels - 1)
        if _dtype_name(metric.dtype) != "float32":
            axes = axes.astype(metric.dtype)
        directions = paddle.concat([mean, axes], axis=1)  # [B, levels, C]
    keys = paddle.matmul(metric, directions, transpose_y=True) * rnorm  # [B, N, levels]
    return _clear_non_finite(keys.astype("float32") if _dtype_name(keys.dtype) != "float32" else keys)


def feature_levels(windows: int) -> List[int]:
    """How feature order cuts ``windows`` windows: the number of parts at each level of its k-d tree (the product is
    ``windows``), the first level along the cosine with the mean token, each next one along the next principal
    axis. The prime factors of ``windows``, smallest first, the two smallest multiplied together while there are
    more than :data:`MAX_FEATURE_LEVELS`.

    >>> [feature_levels(w) for w in (1, 2, 4, 9, 16, 36, 64, 12)]
    [[], [2], [2, 2], [3, 3], [2, 2, 2, 2], [2, 2, 3, 3], [2, 2, 4, 4], [2, 2, 3]]
    """
    factors, rest, p = [], windows, 2
    while rest > 1:
        while rest % p == 0:
            factors.append(p)
            rest //= p
        p += 1
    while len(factors) > MAX_FEATURE_LEVELS:
        factors = sorted([factors[0] * factors[1]] + factors[2:])
    return factors


def _match_feature_windows(metric: paddle.Tensor, win: "_Windows", partition: paddle.Tensor, kind: str
                           ) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Like :func:`_match_windows`, but the windows are cut along the tokens' features instead of the grid, like
    the cells of a k-d tree over their directions (:func:`feature_levels` says how many parts at each level): the
    src (and, separately, the dst) of the partition are sorted by their first key (see :func:`_feature_keys`) and
    cut into equal parts, each part is sorted by the next key and cut again, and so on; window ``k`` holds the
    ``k``-th run of src and the ``k``-th run of dst: tokens that point the same way, wherever they are on the grid.
    Same sizes, the same similarity product as grid windows.

    Returns the best similarity and dst of every src (``[B*W, Ns_w]`` each) and the window layout ``[B, W, T]``:
    the grid position of each window's tokens, its src first, then its dst (so the window-local partition is the
    identity)."""
    work, channels, tokens = similarity_dtype(metric.dtype, kind), metric.shape[2], metric.shape[1]
    if _dtype_name(metric.dtype) != work:
        metric = metric.astype(work)
    num_src = win.count * win.num_src
    src_pos, dst_pos = _window_positions(win, partition)
    ranked = paddle.concat([src_pos.reshape([-1]), dst_pos.reshape([-1])])  # [N]: every src, then every dst
    levels = feature_levels(win.count)
    keys = paddle.gather(_feature_keys(metric, kind, max(len(levels), 1)), ranked, axis=1)  # [B, N, L] in rank order
    keys = paddle.unbind(keys, axis=2) if len(levels) > 1 else [keys.reshape([-1, tokens])]
    spare = 1 if kind == "gpu" and int(metric.shape[0]) == 1 else 0  # (a one-row GPU sort syncs)

    def sort(key: paddle.Tensor) -> paddle.Tensor:
        order = paddle.argsort(F.pad(key, [0, spare, 0, 0]) if spare else key, axis=-1, stable=True)
        return order[:-1] if spare else order

    order = sort(keys[0] + _cell_shift(win, 1))  # [B, N]: src by the first key, then dst by it
    cells = 1
    for level in range(1, len(levels)):  # within each cell of that order, by the next key
        cells *= levels[level - 1]
        key = paddle.take_along_axis(keys[level], order, axis=1, broadcast=False)
        order = paddle.take_along_axis(order, sort(key + _cell_shift(win, cells)), axis=1, broadcast=False)
    layout = paddle.gather(ranked, order.reshape([-1])).reshape([-1, tokens])  # [B, N] positions in window order
    rows = layout + _item_offsets(-1 if tracing() else int(metric.shape[0]), tokens, layout)  # [B, N] rows of the flattened [B*N, C] tokens
    flat = metric.reshape([-1, channels])
    src_rows, dst_rows = paddle.split(rows, [num_src, tokens - num_src], axis=1)
    src = _normalize_rows(paddle.gather(flat, src_rows.reshape([-1])), kind, in_place=True)
    dst = _normalize_rows(paddle.gather(flat, dst_rows.reshape([-1])), kind, in_place=True)
    best, best_dst = _best_in_windows(src, dst, win)
    del src, dst
    src_layout, dst_layout = paddle.split(layout, [num_src, tokens - num_src], axis=1)
    windows = paddle.concat([src_layout.reshape([-1, win.count, win.num_src]),
                             dst_layout.reshape([-1, win.count, win.num_dst])], axis=2)  # [B, W, T]
    return best, best_dst, windows


class LocalMergePlan(MergePlan):
    """A merge plan whose matching stays inside windows (build one with :meth:`from_matching`).

    Each src is matched only to the dst of its own ``wy x wx`` window, and every window merges the same number
    ``r_w`` of its src (its most similar ones), so shapes are static and the similarity is a batched
    ``[B*W, Ns_w, Nd_w]`` product: it grows as ``N * window`` instead of ``N**2``. Merged rows come window by
    window: the kept src of window 0, its dst, then window 1, ...

    Applying it differs by device kind:

    * ``"gpu"``: the plan is two per-window matrices in the tokens' dtype, ``unmerge_matrix`` ``[B*W, T, Mw]`` (a
      one-hot of the merged row of every token) and ``merge_matrix`` ``[B*W, Mw, T]`` (its transpose, each row
      divided by its group size). ``merge`` and ``unmerge`` are then one gather (the window layout) and one batched
      matmul each, plus two free reshapes: few kernel launches, a fixed summation order (bit-identical run to run)
      and memory that grows as ``N * window``;
    * ``"cpu"``: the same assignment as row tables, applied by :class:`MergePlan`'s ``index_add`` and gather (on a
      CPU a dense product over the window costs more than the scatter it replaces).

    Windows in ``order="feature"`` are cut along the tokens' features instead of the grid (see
    :func:`_match_feature_windows`): the same sizes and products, each window's tokens gathered per item (one
    ``gather_nd`` on each side instead of one ``gather``).

    Non-finite tokens: with the dense form a NaN or inf token makes its whole window non-finite (``0 * inf``), not
    just its group; attention would spread it further anyway. In feature order, tokens that are zero or not finite
    sort as if orthogonal to the rest, and a non-finite one can make every key 0 (then the windows are the
    partition's src and dst in position order).
    """

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: str = "cpu"):
        super().__init__(num_tokens, batch_size, r, kind)
        self.windows: Optional[_Windows] = None
        self.window_r = 0
        self.order = "grid"

    @classmethod
    def from_matching(  # type: ignore[override]
        cls, metric: paddle.Tensor, windows: Tuple[int, int, int, int, int, int], partition: paddle.Tensor,
        window_r: int, kind: Optional[str] = None, order: str = "grid",
    ) -> "LocalMergePlan":
        """Match within windows and plan the merge of ``window_r`` src per window.

        Args:
            metric: ``[B, N, C]`` tokens on an ``h x w`` grid.
            windows: ``(h, w, wy, wx, sx, sy)``: the grid, its window sides (see :func:`window_sides`) and strides.
            partition: ``[W, T]`` window-local partition (one row of :func:`window_partition_table`).
            window_r: src merged per window, ``0 < window_r <= Ns_w``.
            kind: ``"cpu"`` or ``"gpu"`` kernels; default from ``metric``'s place.
            order: ``"grid"`` (windows are tiles of the grid) or ``"feature"`` (the partition's src and dst sorted
                by their direction and cut into as many windows of the same sizes; see
                :func:`_match_feature_windows`).

        Example:
            >>> import paddle
            >>> x = paddle.randn([2, 256, 8])
            >>> table = window_partition_table(16, 16, 8, 8, 2, 2, step_key(5), seed=0, blocks=1)
            >>> plan = LocalMergePlan.from_matching(x, (16, 16, 8, 8, 2, 2), table[0], 24, order="feature")
            >>> plan.r, list(plan.unmerge(plan.merge(x)).shape)
            (96, [2, 256, 8])
        """
        if order not in ("grid", "feature"):
            raise ValueError(f"order must be 'grid' or 'feature', got {order!r}")
        kind = kind or device_kind(metric)
        win = _windows(*(int(v) for v in windows))
        batch = int(metric.shape[0])
        plan = cls(int(metric.shape[1]), batch, win.count * int(window_r), kind)
        plan.windows, plan.window_r, plan.num_src, plan.order = win, int(window_r), win.count * win.num_src, order
        with paddle.no_grad():
            if order == "feature":
                best, best_dst, layout = _match_feature_windows(metric.detach(), win, partition, kind)
                partition = win.tensors()["identity"]  # each window's tokens are laid out src first, then dst
            else:
                (best, best_dst), layout = _match_windows(metric.detach(), win, partition, kind), None
            spare = 1 if kind == "gpu" and batch == 1 and win.count == 1 else 0  # (a one-row GPU sort syncs)
            ranked = paddle.argsort(F.pad(best, [0, spare, 0, 0]), axis=-1, descending=True, stable=True)
            ranked = ranked[:-1] if spare else ranked
            plan._build_local(ranked, best_dst, partition, batch, layout)
        return plan

    def _build_local(self, order: paddle.Tensor, best_dst: paddle.Tensor, partition: paddle.Tensor, batch: int,
                     layout: Optional[paddle.Tensor] = None) -> None:
        """The merged row (within its window) of every token: kept src first, then the dst, each merged src on
        its dst's row; then either the two matrices (GPU) or the row tables (CPU). ``layout`` (feature order
        only): ``[B, W, T]`` grid positions of each window's tokens."""
        win, r_w = self.windows, self.window_r
        kept, m_w = win.num_src - r_w, win.size - r_w
        b = _local_tables(-1 if tracing() else batch, win, m_w, order)
        local = paddle.tile(partition, b["repeat"])  # [B*W, T]
        src_local, dst_local = paddle.split(local, [win.num_src, win.num_dst], axis=1)
        tokens = paddle.concat([paddle.take_along_axis(src_local, order, axis=1, broadcast=False), dst_local], axis=1)
        merged_dst = paddle.take_along_axis(best_dst, order[:, :r_w], axis=1, broadcast=False)
        rows = paddle.concat([merged_dst + kept, b["rows"]], axis=1)  # the row of each token, in sorted order
        # every token of a window is written exactly once: no conflicts (its own base: a static program may write
        # the output in place)
        row_of = paddle.put_along_axis(b["zeros"], tokens, rows, axis=1)  # [B*W, T], window-local token order
        if self.kind == "gpu":
            onehot = F.one_hot(row_of, m_w)  # [B*W, T, Mw] float32 of exact 0/1
            counts = paddle.sum(onehot, axis=1, keepdim=True)  # [B*W, 1, Mw]: group sizes, exact integers
            self.tables = {"unmerge_matrix": onehot, "merge_matrix": (onehot / counts).transpose([0, 2, 1])}
            if layout is not None:
                self.tables.update(self._feature_gathers(layout, b))
        else:
            flat = (row_of + b["offsets"]).reshape([-1, win.count * win.size])  # [B, W*T], window-major tokens
            if layout is None:
                unmerge_rows = paddle.gather(flat, win.tensors()["inverse"], axis=1).reshape([-1])  # grid order
            else:  # every position of an item appears once in its layout: no conflicts
                positions = layout.reshape([-1, self.num_tokens])
                unmerge_rows = paddle.put_along_axis(b["zeros"].reshape([-1, self.num_tokens]), positions, flat,
                                                     axis=1).reshape([-1])
            counts = paddle.index_add(b["zeros_m"], unmerge_rows, 0, b["ones_n"])
            row_scale = paddle.gather(paddle.reciprocal(counts), unmerge_rows)
            self.tables = {"unmerge_rows": unmerge_rows, "counts": counts, "row_scale": row_scale}

    def _feature_gathers(self, layout: paddle.Tensor, b: Dict[str, Any]) -> Dict[str, paddle.Tensor]:
        """The two ``gather_nd`` indices of a dense plan in feature order: ``window_index`` ``[B*W, T, 2]`` (the
        ``(item, position)`` of each window's tokens) and ``grid_index`` ``[B, N, 2]`` (the ``(window row, slot)``
        of each item's tokens in grid order)."""
        win, n = self.windows, self.num_tokens
        items = b["items"]  # [B, W, T]: the item of every window slot
        window_index = paddle.stack([items, layout], axis=-1).reshape([-1, win.size, 2])
        slots = paddle.put_along_axis(b["zeros"].reshape([-1, n]), layout.reshape([-1, n]), b["slots"], axis=1)
        window_rows = items.reshape([-1, n]) * win.count + paddle.floor_divide(slots, b["size"])
        grid_index = paddle.stack([window_rows, paddle.remainder(slots, b["size"])], axis=-1)  # [B, N, 2]
        return {"window_index": window_index, "grid_index": grid_index}

    def __repr__(self) -> str:
        win = self.windows
        shape = f", windows={win.count}x{win.wy}x{win.wx}" if win is not None else ""
        shape += ", order='feature'" if self.order == "feature" else ""
        return f"LocalMergePlan(batch_size={self.batch_size}, num_tokens={self.num_tokens}, r={self.r}{shape}, kind={self.kind!r})"

    def _matrix(self, name: str, dtype: str) -> paddle.Tensor:
        """One of the dense matrices in ``dtype`` (built in float32, cast once per dtype and kept)."""
        key = f"{name}:{dtype}"
        if key not in self.tables:
            matrix = self.tables[name]
            self.tables[key] = matrix if _dtype_name(matrix.dtype) == dtype else matrix.astype(dtype)
        return self.tables[key]

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        if self.kind != "gpu" or self.is_identity:
            return MergePlan.merge(self, x, mode)  # (not super(): SOT cannot read attributes through it)
        if mode != "mean":
            raise ValueError(f"a dense local plan only averages (mode='mean'); got {mode!r}")
        self._check(x, self.num_tokens, "merge")
        win, channels = self.windows, x.shape[-1]
        if "window_index" in self.tables:
            tokens = paddle.gather_nd(x, self.tables["window_index"])  # [B*W, T, C]
        else:
            tokens = paddle.gather(x, win.tensors()["flat_order"], axis=1).reshape([-1, win.size, channels])
        out = paddle.matmul(self._matrix("merge_matrix", _dtype_name(x.dtype)), tokens)  # [B*W, Mw, C]
        return out.reshape([-1, self.merged_tokens, channels])

    def unmerge(self, y: paddle.Tensor) -> paddle.Tensor:
        if self.kind != "gpu" or self.is_identity:
            return MergePlan.unmerge(self, y)
        self._check(y, self.merged_tokens, "unmerge")
        win, channels = self.windows, y.shape[-1]
        rows = y.reshape([-1, win.size - self.window_r, channels])
        out = paddle.matmul(self._matrix("unmerge_matrix", _dtype_name(y.dtype)), rows)  # [B*W, T, C]
        if "grid_index" in self.tables:
            return paddle.gather_nd(out, self.tables["grid_index"])  # [B, N, C]
        return paddle.gather(out.reshape([-1, self.num_tokens, channels]), win.tensors()["inverse"], axis=1)


def _cell_shift(win: "_Windows", cells: int) -> paddle.Tensor:
    """``[1, N]`` float32 added to the next key in the current order, where the src and the dst are each cut into
    ``cells`` equal runs: 4 per run (keys lie in [-1, 1]), the dst after every src, so one sort orders the tokens by
    run and by the key inside each."""
    return _CACHE.get(("cell_shift", win.count, win.num_src, win.num_dst, cells), _build_cell_shift, win, cells)


def _build_cell_shift(win: "_Windows", cells: int) -> paddle.Tensor:
    num_src, num_dst = win.count * win.num_src, win.count * win.num_dst
    src = np.arange(num_src) // (num_src // cells)
    dst = np.arange(num_dst) // (num_dst // cells) + cells
    return _const(4.0 * np.concatenate([src, dst])[None, :], "float32")


def _item_offsets(batch: int, tokens: int, like: paddle.Tensor) -> paddle.Tensor:
    """``[B, 1]`` int64: the first row of every item of a flattened ``[B*N, ...]`` tensor (cached per batch size in
    eager mode; from the runtime shape of ``like``, ``[B, ...]``, while tracing a dynamic batch)."""
    if batch < 0:
        return (paddle.arange(paddle.shape(like)[0], dtype="int64") * tokens).unsqueeze(-1)
    return _CACHE.get(("item_offsets", batch, tokens), _build_item_offsets, batch, tokens)


def _build_item_offsets(batch: int, tokens: int) -> paddle.Tensor:
    return (paddle.arange(batch, dtype="int64") * tokens).unsqueeze(-1)


def _local_tables(batch: int, win: "_Windows", m_w: int, like: paddle.Tensor) -> Dict[str, Any]:
    """Per-batch tables of a local plan: cached per batch size in eager mode, built from the runtime shape of
    ``like`` (``[B*W, ...]``) while tracing a dynamic batch."""
    if batch < 0:
        return _build_local_tables(paddle.shape(like)[0] // win.count, win.count, win.size, m_w)
    return _CACHE.get(("local", batch, win.count, win.size, m_w), _build_local_tables, batch, win.count, win.size, m_w)


def _build_local_tables(batch: Any, count: int, size: int, m_w: int) -> Dict[str, Any]:
    rows = batch * count
    return {
        "repeat": [batch, 1],
        "rows": paddle.tile(paddle.arange(m_w, dtype="int64").unsqueeze(0), [rows, 1]),  # [B*W, Mw]
        "zeros": paddle.zeros([rows, size], dtype="int64"),
        "offsets": (paddle.arange(rows, dtype="int64") * m_w).unsqueeze(-1),  # first row of every window
        "zeros_m": paddle.zeros([rows * m_w, 1], dtype="float32"),
        "ones_n": paddle.ones([rows * size, 1], dtype="float32"),
        # feature order: the item of every window slot, and the slots of an item's window layout
        "items": paddle.tile(paddle.arange(batch, dtype="int64").reshape([-1, 1, 1]), [1, count, size]),
        "slots": paddle.tile(paddle.arange(count * size, dtype="int64").unsqueeze(0), [batch, 1]),
        "size": paddle.full([], size, dtype="int64"),
    }


# ToDo: token downsampling of keys and values (Smith et al. 2024) ----------------------------------------------------
def downsample_tokens(x: paddle.Tensor, h: int, w: int, factor: int, mode: str = "nearest") -> paddle.Tensor:
    """Downsample ``[B, h*w, C]`` tokens on their 2D grid by ``factor`` to ``[B, ceil(h/f)*ceil(w/f), C]``.

    ``"nearest"`` keeps the top-left token of every ``factor x factor`` cell; ``"average"`` takes the mean of each
    cell (cells cut by the grid's edge average the tokens they hold). Arithmetic runs in :func:`compute_dtype`; the
    result has ``x``'s dtype. ``factor == 1`` returns ``x``.

    >>> import paddle
    >>> x = paddle.arange(16, dtype="float32").reshape([1, 16, 1])
    >>> downsample_tokens(x, 4, 4, 2, "nearest").flatten().tolist()
    [0.0, 2.0, 8.0, 10.0]
    >>> downsample_tokens(x, 4, 4, 2, "average").flatten().tolist()
    [2.5, 4.5, 10.5, 12.5]
    """
    if mode not in DOWNSAMPLE_MODES:
        raise ValueError(f"mode must be one of {DOWNSAMPLE_MODES}, got {mode!r}")
    if x.ndim != 3 or x.shape[1] != h * w:
        raise ValueError(f"x must be [batch, h*w={h * w}, channels], got shape {list(x.shape)}")
    if factor == 1:
        return x
    channels = x.shape[2]
    grid = x.reshape([-1, h, w, channels])  # one -1 only: the batch may be dynamic under to_static
    if mode == "nearest":
        out = grid[:, ::factor, ::factor, :]
    else:
        work = compute_dtype(x.dtype)
        grid = grid if _dtype_name(x.dtype) == work else grid.astype(work)
        out = paddle.nn.functional.avg_pool2d(
            grid, kernel_size=factor, stride=factor, ceil_mode=True, exclusive=True, data_format="NHWC"
        ).astype(x.dtype)
    return out.reshape([-1, -(-h // factor) * -(-w // factor), channels])


class DownsamplePlan:
    """What ToDo does to one self-attention call: every query stays, keys and values come from the tokens
    downsampled on their ``grid_h x grid_w`` grid (see :func:`downsample_tokens`). There is nothing to unmerge.

    >>> import paddle
    >>> plan = DownsamplePlan(num_tokens=64, batch_size=2, grid_h=8, grid_w=8, factor=2)
    >>> list(plan.keys_values(paddle.randn([2, 64, 4])).shape)
    [2, 16, 4]
    """

    def __init__(self, num_tokens: int, batch_size: int, grid_h: int, grid_w: int, factor: int, mode: str = "nearest"):
        if mode not in DOWNSAMPLE_MODES:
            raise ValueError(f"mode must be one of {DOWNSAMPLE_MODES}, got {mode!r}")
        self.num_tokens, self.batch_size = int(num_tokens), int(batch_size)
        self.grid_h, self.grid_w, self.factor, self.mode = int(grid_h), int(grid_w), int(factor), mode

        # a plain attribute, not a property: Paddle's SOT tracer cannot read properties of this object
        self.is_identity = self.factor <= 1

    def __repr__(self) -> str:
        return (
            f"DownsamplePlan(batch_size={self.batch_size}, grid={self.grid_h}x{self.grid_w}, "
            f"factor={self.factor}, mode={self.mode!r})"
        )

    @property
    def kv_tokens(self) -> int:
        """Keys/values per item after downsampling."""
        return -(-self.grid_h // self.factor) * -(-self.grid_w // self.factor)

    def keys_values(self, x: paddle.Tensor) -> paddle.Tensor:
        return downsample_tokens(x, self.grid_h, self.grid_w, self.factor, self.mode)

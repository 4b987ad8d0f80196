"""The random 2D-stride partition into src and dst tokens, drawn on the device.

Every full ``sy x sx`` cell of the token grid holds one dst; which slot of the cell it is comes from an integer
hash of ``(seed, block, grid, step, cell)`` computed with tensor ops. So the partition needs no host RNG, uploads
nothing, never reads the timestep on the host, is the same for both halves of classifier-free guidance, and is a
pure function of its inputs (identical calls give identical images).
"""

from __future__ import annotations

import functools
import math
import random
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import paddle

from .cache import CACHE, const
from .runtime import dtype_name

__all__ = ["find_downsample", "grid_partition", "max_ratio", "partition_table", "step_key"]

GeneratorLike = Union[None, int, np.random.Generator]

# 31-bit integer hash: every value stays below 2**31 and every constant below 2**31, so products stay below 2**62
# and never overflow int64, on any device.
MASK31 = (1 << 31) - 1
_MULTIPLIERS = (0x2C1B3C6D, 0x297A2D39)
_W_STEP, _W_BLOCK, _W_SEED = 0x5BD1E995 & MASK31, 0x1B873593, 0x68E31DA4
W_CELL = 0x3C6EF372 | 1


def max_ratio(sx: int, sy: int) -> float:
    """Largest admissible merge ratio (exclusive) for strides ``sx``, ``sy``: ``1 - 1/(sx*sy)``.

    >>> max_ratio(2, 2)
    0.75
    """
    return 1.0 - 1.0 / (sx * sy)


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


# the hash ------------------------------------------------------------------------------------------------------------
def _build_hash_constants() -> Dict[str, paddle.Tensor]:
    # every operand a device tensor: a Python scalar operand would be uploaded at each call (a sync on a GPU)
    return {
        "mask": const(MASK31), "m1": const(_MULTIPLIERS[0]), "m2": const(_MULTIPLIERS[1]),
        "step": const(_W_STEP), "s15": const(15), "s16": const(16), "zero": const(0.0, "float32"),
    }


def _hash_constants() -> Dict[str, paddle.Tensor]:
    return CACHE.get("hash", _build_hash_constants)


def _mix31(x: paddle.Tensor, c: Dict[str, paddle.Tensor]) -> paddle.Tensor:
    """Avalanche a tensor of int64 values in [0, 2**31) (two xor-shift-multiply rounds, as in MurmurHash3's
    finaliser, on 31 bits)."""
    shift = paddle.bitwise_right_shift
    x = paddle.bitwise_xor(x, shift(x, c["s16"]))
    x = paddle.bitwise_and(x * c["m1"], c["mask"])
    x = paddle.bitwise_xor(x, shift(x, c["s15"]))
    x = paddle.bitwise_and(x * c["m2"], c["mask"])
    return paddle.bitwise_xor(x, shift(x, c["s16"]))


def mix31_int(x: int) -> int:
    """The same hash on a Python int (for keys made on the host)."""
    x &= MASK31
    x ^= x >> 16
    x = (x * _MULTIPLIERS[0]) & MASK31
    x ^= x >> 15
    x = (x * _MULTIPLIERS[1]) & MASK31
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
    if dtype_name(timestep.dtype) == "bool":  # (Paddle has no max kernel for bool)
        timestep = timestep.astype("int64")
    t = timestep.max()
    if dtype_name(t.dtype) in ("int64", "int32"):
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
        return (int(timestep) * 1024) & MASK31
    value = float(timestep)
    return int(round(value * 1024)) & MASK31 if math.isfinite(value) else 0


# grids ---------------------------------------------------------------------------------------------------------------
class Grid:
    """Host-side description of one ``h x w`` grid with ``sy x sx`` cells (numpy, cached by :func:`grid`)."""

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
        grid_salt = mix31_int(h * 0x10001 + w * 0x101 + sx * 0x11 + sy)
        cells = np.arange(self.num_dst, dtype=np.int64)
        self.cell_key = (cells * W_CELL + grid_salt) & MASK31
        # for every grid position: its cell and its slot in the cell (leftover positions: cell 0, slot -1)
        ys, xs = np.divmod(np.arange(h * w, dtype=np.int64), w)
        inside = (ys < (h // sy) * sy) & (xs < (w // sx) * sx)
        self.cell_of = np.where(inside, (ys // sy) * (w // sx) + xs // sx, 0)
        self.slot_of = np.where(inside, (ys % sy) * sx + xs % sx, -1)

    def tensors(self) -> Dict[str, paddle.Tensor]:
        """The device copies of the tables (cached per place)."""
        return CACHE.get(("grid", self.h, self.w, self.sx, self.sy), _grid_tensors, self)


def _grid_tensors(grid: Grid) -> Dict[str, paddle.Tensor]:
    return {
        "top_left": const(grid.top_left),
        "cell_key": const(grid.cell_key[None, :]),
        "cell_of": const(grid.cell_of),
        "slot_of": const(grid.slot_of[None, :]),
        "slots": const(grid.slots),
    }


@functools.lru_cache(maxsize=64)
def grid(h: int, w: int, sx: int, sy: int) -> Grid:
    return Grid(h, w, sx, sy)


def cell_count(h: int, w: int, sx: int, sy: int) -> int:
    """Full ``sy x sx`` cells of an ``h x w`` grid: the number of dst tokens."""
    return (h // sy) * (w // sx)


# partitions ----------------------------------------------------------------------------------------------------------
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
    layout = grid(int(h), int(w), int(sx), int(sy))
    rows = max(int(blocks), 2)
    if layout.num_dst == 0:
        return CACHE.get(("top_left_rows", h, w, sx, sy, rows), const, np.tile(layout.top_left, (rows, 1)))
    is_dst = dst_flags(layout.tensors(), step, seed, rows)  # [rows, N]
    return paddle.argsort(is_dst, axis=1, stable=True)  # src (flag 0) first, then dst, each in position order


def dst_flags(tables: Dict[str, paddle.Tensor], step: paddle.Tensor, seed: int, rows: int) -> paddle.Tensor:
    """``[rows, N]`` int32, 1 where a token is the dst of its cell: each cell's dst slot drawn from a hash of
    ``(seed, row, cell key, step)``; ``tables`` give every cell's key and every token's cell and slot."""
    c = _hash_constants()
    salts = CACHE.get(("salts", int(seed), rows), const, _block_salts(int(seed), rows))
    x = paddle.bitwise_and(step * c["step"] + salts + tables["cell_key"], c["mask"])  # [rows, cells]
    slot = paddle.remainder(_mix31(x, c), tables["slots"])  # the dst slot of every cell
    return paddle.equal(paddle.gather(slot, tables["cell_of"], axis=1), tables["slot_of"]).astype("int32")


def _seed_salt(seed: int) -> int:
    """The 31-bit salt of a partition seed, made from all of its bits: one-to-one on ``[0, 2**31)``; each further
    31-bit chunk of a larger seed is mixed in with the integer hash, so seeds that differ in any bit give different
    partitions (up to chance collisions)."""
    seed = int(seed)
    low = seed & MASK31
    # _W_SEED is a multiple of 4, so low * _W_SEED alone would repeat every 2**29: the top two bits fill the gap
    salt = (low * _W_SEED + (low >> 29)) & MASK31
    high = seed >> 31
    while high:
        salt = mix31_int(salt ^ (high & MASK31) ^ 0x2545F491)
        high >>= 31
    return salt


def _block_salts(seed: int, rows: int) -> np.ndarray:
    """``[rows, 1]`` int64: the salt of every block's row for ``seed``."""
    blocks = np.arange(rows, dtype=np.int64) * _W_BLOCK  # < 2**62
    return ((blocks + _seed_salt(seed)) & MASK31).reshape([rows, 1])


def generator_seed(generator: GeneratorLike) -> int:
    """The partition seed a ``generator`` stands for: its next 31-bit draw (an int seeds a numpy Generator first,
    so ``5`` and ``np.random.default_rng(5)`` give the same partition)."""
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool):
        generator = np.random.default_rng(int(generator))
    if isinstance(generator, np.random.Generator):
        return int(generator.integers(0, MASK31))
    if generator is None:
        return random.SystemRandom().randrange(MASK31)
    raise TypeError(
        f"generator must be None, an int seed or a numpy.random.Generator, got {type(generator).__name__}"
    )


def grid_partition(
    h: int, w: int, sx: int, sy: int, no_rand: bool = True, generator: GeneratorLike = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Split an ``h x w`` token grid into src and dst positions (row-major token indices), on the host.

    Every full ``sy x sx`` cell holds exactly one dst token: its top-left token when ``no_rand``, otherwise the one
    :func:`~ppdiffusers_tome.ops.global_plan.bipartite_soft_matching_random2d` draws for the same ``generator`` (an
    int seed or a numpy Generator; Paddle's global RNG is never used). Rows and columns left over when ``h``/``w``
    are not multiples of ``sy``/``sx`` are all src. Returns ``(src_pos, dst_pos)``, src in increasing position order.

    >>> src, dst = grid_partition(4, 4, 2, 2)
    >>> dst.tolist()
    [0, 2, 8, 10]
    >>> len(src)
    12
    """
    h, w, sx, sy = int(h), int(w), int(sx), int(sy)
    if cell_count(h, w, sx, sy) == 0:
        return np.arange(h * w, dtype=np.int64), np.zeros(0, dtype=np.int64)
    layout = grid(h, w, sx, sy)
    if no_rand:
        order = layout.top_left
    else:
        seed = generator_seed(generator)
        order = partition_table(h, w, sx, sy, paddle.full([], 0, dtype="int64"), seed, 1)[0].numpy()
    return order[: layout.num_src].copy(), order[layout.num_src :].copy()

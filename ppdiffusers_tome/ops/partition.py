"""The random 2D-stride partition into src and dst tokens, picked on the device.

Every full ``sy x sx`` cell of the token grid holds one dst. For each grid and seed, :data:`VARIANTS` partitions are
drawn once on the host (every cell's dst slot uniform and independent, from a generator seeded with all the bits
of the seed and the grid) and kept on the device; a call picks one per block from its step key with three integer
ops. So the partition needs no host RNG in a forward, uploads nothing after the first call at a grid, never reads
the timestep on the host, is the same for both halves of classifier-free guidance, and is a pure function of
``(seed, block, grid, step)``: identical calls give identical images.
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

__all__ = ["VARIANTS", "draw_dst", "find_downsample", "grid_partition", "max_ratio", "partition_table", "step_key",
           "variant_index"]

GeneratorLike = Union[None, int, np.random.Generator]

MASK31 = (1 << 31) - 1
# partitions kept per grid and seed: a prime, so that step keys (multiples of 1024) and blocks spread over them
VARIANTS = 61
_W_STEP, _W_BLOCK = 0x5BD1E995 & MASK31, 0x1B873593


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


# step keys and variants ------------------------------------------------------------------------------------
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
    if dtype_name(timestep.dtype) == "bool":  # (Paddle has no max kernel for bool)
        timestep = timestep.astype("int64")
    t = timestep.max()
    if dtype_name(t.dtype) in ("int64", "int32"):
        t = t.astype("int64") * 1024
    else:
        t = (t.astype("float64") * 1024.0).round().astype("int64")
    return paddle.bitwise_and(t, CACHE.get(("constant", "mask31"), const, MASK31))


def _host_step_key(timestep: Any) -> int:
    """:func:`step_key` of a Python number (or ``None``): NaN and infinities, which the model itself accepts, key
    as 0 like ``None`` instead of failing to become an integer."""
    if timestep is None:
        return 0
    if isinstance(timestep, (int, np.integer)) and not isinstance(timestep, bool):
        return (int(timestep) * 1024) & MASK31
    value = float(timestep)
    return int(round(value * 1024)) & MASK31 if math.isfinite(value) else 0


def variant_index(step: paddle.Tensor, seed: int, rows: int) -> paddle.Tensor:
    """``[rows]`` int64: the variant each block row takes at step key ``step``,
    ``(step * a + salt(seed, row)) mod VARIANTS`` (three ops: the constants are cached device tensors). Distinct
    blocks take distinct variants at one step; a step's variant changes with every timestep that is not a multiple
    of :data:`VARIANTS` apart.

    >>> int(variant_index(step_key(999), 0, 2)[0]) in range(VARIANTS)
    True
    """
    c = CACHE.get(("variant_constants", int(seed) % VARIANTS, rows), _variant_constants, int(seed) % VARIANTS, rows)
    return paddle.remainder(step * c["step"] + c["salts"], c["variants"])


def _variant_constants(seed_salt: int, rows: int) -> Dict[str, paddle.Tensor]:
    salts = (seed_salt + np.arange(rows, dtype=np.int64) * (_W_BLOCK % VARIANTS)) % VARIANTS
    return {"step": const(_W_STEP), "salts": const(salts), "variants": const(VARIANTS)}


def draw_dst(cell_of: np.ndarray, slot_of: np.ndarray, cells: int, slots: int, key: Tuple[int, ...]) -> np.ndarray:
    """``[VARIANTS, N]`` bool on the host, True where a token is the dst of its cell: in each variant every cell's
    dst slot is drawn uniformly and independently (``slot_of`` is -1 for leftover tokens, which stay src) by a
    generator seeded with ``key`` (every bit of it counts)."""
    rng = np.random.default_rng([abs(int(k)) for k in key] + [int(k < 0) for k in key])
    chosen = rng.integers(0, slots, size=(VARIANTS, max(cells, 1)))
    return (chosen[:, cell_of] == slot_of[None, :]) & (slot_of[None, :] >= 0)


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
        # for every grid position: its cell and its slot in the cell (leftover positions: cell 0, slot -1)
        ys, xs = np.divmod(np.arange(h * w, dtype=np.int64), w)
        inside = (ys < (h // sy) * sy) & (xs < (w // sx) * sx)
        self.cell_of = np.where(inside, (ys // sy) * (w // sx) + xs // sx, 0)
        self.slot_of = np.where(inside, (ys % sy) * sx + xs % sx, -1)

    def tensors(self) -> Dict[str, paddle.Tensor]:
        """The device copies of the tables (cached per place)."""
        return CACHE.get(("grid", self.h, self.w, self.sx, self.sy), _grid_tensors, self)

    def variants(self, seed: int) -> paddle.Tensor:
        """The ``[VARIANTS, N]`` partitions of this grid for ``seed`` on the device (drawn once, cached)."""
        return CACHE.get(("variants", self.h, self.w, self.sx, self.sy, int(seed)), _grid_variants, self, int(seed))


def _grid_tensors(grid: Grid) -> Dict[str, paddle.Tensor]:
    return {"top_left": const(grid.top_left)}


def _grid_variants(grid: Grid, seed: int) -> paddle.Tensor:
    is_dst = draw_dst(grid.cell_of, grid.slot_of, grid.num_dst, grid.slots, (seed, grid.h, grid.w, grid.sx, grid.sy))
    return const(np.argsort(is_dst, axis=1, kind="stable"))  # src (False) first, then dst, each in position order


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
    then dst). Each full ``sy x sx`` cell holds one dst, uniformly drawn; leftover rows and columns are src. The
    rows are variants of the grid's table for ``seed`` (:meth:`Grid.variants`), picked by :func:`variant_index`:
    with the step key, four ops per call (a table of one block still has two rows, as a sort on a GPU needs).

    ``step`` is a 0-d int64 tensor (see :func:`step_key`).

    >>> import paddle
    >>> table = partition_table(4, 4, 2, 2, step_key(999), seed=0, blocks=1)
    >>> list(table.shape), sorted(table[0].numpy().tolist()) == list(range(16))
    ([2, 16], True)
    """
    layout = grid(int(h), int(w), int(sx), int(sy))
    rows = max(int(blocks), 2)
    if layout.num_dst == 0:
        return CACHE.get(("top_left_rows", h, w, sx, sy, rows), const, np.tile(layout.top_left, (rows, 1)))
    return paddle.gather(layout.variants(seed), variant_index(step, seed, rows))


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

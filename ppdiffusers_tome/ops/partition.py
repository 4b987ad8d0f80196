"""The token layout and the random 2D-stride partition into src and dst tokens over it, picked on the device.

One layout type, :class:`Layout`: an ``h x w`` grid with ``sy x sx`` cells, optionally cut into equal windows (the
global grid is one window). Every full cell holds one dst. For each layout and seed, :data:`VARIANTS` partitions are
drawn once on the host (every cell's dst slot uniform and independent, from a generator seeded with all the bits
of the seed and the grid) and kept on the device; a call picks one per block from its step key with three integer
ops. So the partition needs no host RNG in a forward, uploads nothing after the first call at a grid, never reads
the timestep on the host, is the same for both halves of classifier-free guidance, and is a pure function of
``(seed, block, grid, step)``: identical calls give identical images. One picker, :func:`pick_partitions`, serves
the global grid, grid windows and feature windows.
"""

from __future__ import annotations

import functools
import math
import random
from typing import Any, Optional, Tuple, Union

import numpy as np
import paddle

from .cache import CACHE, Tables, const
from .runtime import dtype_name

__all__ = ["VARIANTS", "Layout", "LayoutTables", "draw_dst", "find_downsample", "grid_partition", "layout", "max_ratio",
           "partition_table", "pick_partitions", "step_key", "variant_index"]

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
    return paddle.remainder(step * c.step + c.salts, c.variants)


class VariantConstants(Tables):
    """The device constants of :func:`variant_index`."""

    __slots__ = ("step", "salts", "variants")

    def __init__(self, step: paddle.Tensor, salts: paddle.Tensor, variants: paddle.Tensor) -> None:
        self.step = step  # the step multiplier
        self.salts = salts  # [rows] every block row's salt
        self.variants = variants  # VARIANTS


def _variant_constants(seed_salt: int, rows: int) -> VariantConstants:
    salts = (seed_salt + np.arange(rows, dtype=np.int64) * (_W_BLOCK % VARIANTS)) % VARIANTS
    return VariantConstants(step=const(_W_STEP), salts=const(salts), variants=const(VARIANTS))


def draw_dst(cell_of: np.ndarray, slot_of: np.ndarray, cells: int, slots: int, key: Tuple[int, ...]) -> np.ndarray:
    """``[VARIANTS, N]`` bool on the host, True where a token is the dst of its cell: in each variant every cell's
    dst slot is drawn uniformly and independently (``slot_of`` is -1 for leftover tokens, which stay src) by a
    generator seeded with ``key`` (every bit of it counts)."""
    rng = np.random.default_rng([abs(int(k)) for k in key] + [int(k < 0) for k in key])
    chosen = rng.integers(0, slots, size=(VARIANTS, max(cells, 1)))
    return (chosen[:, cell_of] == slot_of[None, :]) & (slot_of[None, :] >= 0)


# the layout ----------------------------------------------------------------------------------------------------------
class LayoutTables(Tables):
    """The device tables of a :class:`Layout` (cached per place by :meth:`Layout.tensors`)."""

    __slots__ = ("order", "flat_order", "inverse", "top_left")

    def __init__(self, order: paddle.Tensor, flat_order: paddle.Tensor, inverse: paddle.Tensor,
                 top_left: paddle.Tensor) -> None:
        self.order = order  # [W, T] grid position of every window's tokens, row-major inside a window
        self.flat_order = flat_order  # [N] the same, flattened: window-major token order
        self.inverse = inverse  # [N] window-major index of every grid position
        self.top_left = top_left  # [N] the top-left partition as grid positions (src of every window, then dst)


class Layout:
    """Host-side description (numpy, cached by :func:`layout`) of an ``h x w`` token grid with ``sy x sx`` cells,
    cut into equal ``wy x wx`` windows that each hold their own cells. Without windows (``wy``, ``wx`` None) the
    whole grid is the one window: ToMe's global matching. Token tables are in window-major order: window by window,
    row-major inside a window (for one window, the grid's own order). ``num_src`` and ``num_dst`` count one window.

    A partition comes in two forms (see :meth:`partitions`): window-local (``[W, T]``: each window's tokens, src
    first, then dst) and as grid positions (``[N]``: every window's src, window by window, then every window's dst;
    for one window, the global partition).

    >>> grid, tiles = layout(4, 4, 2, 2), layout(8, 8, 2, 2, 4, 4)
    >>> (grid.count, grid.num_src, grid.num_dst), (tiles.count, tiles.size, tiles.num_dst)
    ((1, 12, 4), (4, 16, 4))
    """

    def __init__(self, h: int, w: int, sx: int, sy: int, wy: Optional[int] = None, wx: Optional[int] = None):
        self.windowed = wy is not None
        wy, wx = (wy, wx) if self.windowed else (h, w)
        self.h, self.w, self.wy, self.wx, self.sx, self.sy = h, w, wy, wx, sx, sy
        self.count, self.size, self.slots = (h // wy) * (w // wx), wy * wx, sx * sy
        # what every random draw and device table of this layout is keyed by (a grid keeps the key it always had)
        self.key = (h, w, wy, wx, sx, sy, 1) if self.windowed else (h, w, sx, sy)
        # the cells of one window: each cell's top-left token, then for every token its cell and slot (leftover rows
        # and columns: cell 0, slot -1, always src)
        rows = np.arange(wy // sy, dtype=np.int64)[:, None] * (sy * wx)
        origin = (rows + np.arange(wx // sx, dtype=np.int64)[None, :] * sx).reshape(-1)
        self.num_dst = len(origin)
        self.num_src = self.size - self.num_dst
        is_dst = np.zeros(self.size, dtype=bool)
        is_dst[origin] = True
        ys, xs = np.divmod(np.arange(self.size, dtype=np.int64), wx)
        inside = (ys < (wy // sy) * sy) & (xs < (wx // sx) * sx)
        cell_of = np.where(inside, (ys // sy) * (wx // sx) + xs // sx, 0)
        slot_of = np.where(inside, (ys % sy) * sx + xs % sx, -1)
        # the windows
        win_y, win_x, ty, tx = np.meshgrid(np.arange(h // wy), np.arange(w // wx), np.arange(wy), np.arange(wx),
                                           indexing="ij")
        self.order = ((win_y * wy + ty) * w + (win_x * wx + tx)).reshape(self.count, self.size).astype(np.int64)
        self.inverse = np.argsort(self.order.reshape(-1)).astype(np.int64)  # grid position -> window-major index
        self.cell_of = (np.arange(self.count)[:, None] * self.num_dst + cell_of[None, :]).reshape(-1)
        self.slot_of = np.tile(slot_of, self.count)
        top_left = np.concatenate([np.flatnonzero(~is_dst), origin]).astype(np.int64)
        self.top_left = np.tile(top_left, (self.count, 1))  # [W, T]: every cell's top-left token as its dst

    def partitions(self, seed: Optional[int], local: bool = False) -> np.ndarray:
        """The :data:`VARIANTS` random partitions for ``seed`` on the host (``seed=None``: the one top-left
        partition): ``[VARIANTS, W, T]`` window-local with ``local``, else ``[VARIANTS, N]`` grid positions (see the
        class docstring). Every cell's dst is drawn uniformly and independently by :func:`draw_dst`."""
        if seed is None or self.num_dst == 0:
            chosen = self.top_left[None]
        else:
            is_dst = draw_dst(self.cell_of, self.slot_of, self.count * self.num_dst, self.slots,
                              (int(seed),) + self.key)
            # src (False) first, then dst, each in position order
            chosen = np.argsort(is_dst.reshape(-1, self.count, self.size), axis=-1, kind="stable")
        if local:
            return chosen
        positions = np.take_along_axis(np.broadcast_to(self.order, chosen.shape), chosen, axis=-1)
        slots = np.arange(self.count * self.size).reshape(self.count, self.size)
        ranked = np.concatenate([slots[:, :self.num_src].reshape(-1), slots[:, self.num_src:].reshape(-1)])
        return positions.reshape(len(chosen), -1)[:, ranked]

    def variants(self, seed: int, local: Optional[bool] = None) -> paddle.Tensor:
        """:meth:`partitions` for ``seed`` on the device (drawn once, cached; what :func:`pick_partitions` picks
        from); ``local`` defaults to whether the layout has windows (the forms of 0.11's grid and windows)."""
        local = self.windowed if local is None else bool(local)
        return CACHE.get(("variants", local, int(seed)) + self.key, _variants, self, local, int(seed))

    def tensors(self) -> LayoutTables:
        """The device copies of the tables (cached per place)."""
        return CACHE.get(("layout",) + self.key, _layout_tensors, self)


def _layout_tensors(layout: Layout) -> LayoutTables:
    return LayoutTables(order=const(layout.order), flat_order=const(layout.order.reshape(-1)),
                        inverse=const(layout.inverse), top_left=const(layout.partitions(None)[0]))


@functools.lru_cache(maxsize=128)
def layout(h: int, w: int, sx: int, sy: int, wy: Optional[int] = None, wx: Optional[int] = None) -> Layout:
    """The :class:`Layout` of an ``h x w`` grid with ``sy x sx`` cells, cut into ``wy x wx`` windows if given."""
    return Layout(h, w, sx, sy, wy, wx)


grid = layout  # 0.11's name: ``grid(h, w, sx, sy)``, the layout of a whole grid (one window)
Grid = Layout  # 0.11's name of the grid description


def cell_count(h: int, w: int, sx: int, sy: int) -> int:
    """Full ``sy x sx`` cells of an ``h x w`` grid: the number of dst tokens."""
    return (h // sy) * (w // sx)


# the partition-variant picker ----------------------------------------------------------------------------------------
def pick_partitions(layout: Layout, step: Optional[paddle.Tensor], seed: int, blocks: int,
                    local: bool = False) -> paddle.Tensor:
    """Random partitions of ``layout`` for ``blocks`` blocks at once, on the device: an int64 ``[max(blocks, 2), N]``
    tensor of grid positions, or with ``local`` ``[max(blocks, 2), W, T]`` window-local (the two forms of
    :meth:`Layout.partitions`). Row ``i`` is block ``i``'s variant of the layout's table for ``seed``, picked by
    :func:`variant_index` from the step key ``step`` (a 0-d int64 tensor, see :func:`step_key`): the variants are
    drawn and uploaded once, a call costs four ops. ``step=None`` (or a layout without cells) gives every row the
    top-left partition. A table of one block still has two rows, as a sort on a GPU needs.

    The one picker behind :func:`partition_table`,
    :func:`~ppdiffusers_tome.ops.windows.window_partition_table` and
    :func:`~ppdiffusers_tome.ops.feature_order.feature_partition_table`.
    """
    rows = max(int(blocks), 2)
    if step is None or layout.num_dst == 0:
        return CACHE.get(("top_left_rows", local, rows) + layout.key, _top_left_rows, layout, local, rows)
    return paddle.gather(layout.variants(seed, local), variant_index(step, seed, rows))


def _variants(layout: Layout, local: bool, seed: int) -> paddle.Tensor:
    # a module function, not a closure: Paddle's SOT tracer cannot read a lambda's cells
    return const(layout.partitions(seed, local))


def _top_left_rows(layout: Layout, local: bool, rows: int) -> paddle.Tensor:
    top_left = layout.partitions(None, local)
    return const(np.tile(top_left, (rows,) + (1,) * (top_left.ndim - 1)))


def partition_table(h: int, w: int, sx: int, sy: int, step: paddle.Tensor, seed: int, blocks: int) -> paddle.Tensor:
    """Random partitions of an ``h x w`` grid for ``blocks`` blocks at once: an int64 ``[max(blocks, 2), h*w]``
    tensor whose row ``i`` lists the grid positions of block ``i`` in partition order (src in increasing position,
    then dst). Each full ``sy x sx`` cell holds one dst, uniformly drawn; leftover rows and columns are src.
    :func:`pick_partitions` on the grid's :class:`Layout`.

    >>> import paddle
    >>> table = partition_table(4, 4, 2, 2, step_key(999), seed=0, blocks=1)
    >>> list(table.shape), sorted(table[0].numpy().tolist()) == list(range(16))
    ([2, 16], True)
    """
    return pick_partitions(layout(int(h), int(w), int(sx), int(sy)), step, seed, blocks)


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
    grid_layout = layout(h, w, sx, sy)
    if no_rand:
        order = grid_layout.partitions(None)[0]
    else:
        seed = generator_seed(generator)
        order = partition_table(h, w, sx, sy, paddle.full([], 0, dtype="int64"), seed, 1)[0].numpy()
    return order[: grid_layout.num_src].copy(), order[grid_layout.num_src :].copy()

"""Windows for local matching: equal ``wy x wx`` tiles of the token grid, each with its own cells and partition.

A src is then compared only with the dst of its own window: the similarity is a batched ``[B*W, Ns_w, Nd_w]``
product, which grows as ``N * window**2`` (``window`` tokens per side) instead of ``N**2`` (the recipe of ToMA, Lu et
al. 2025).
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Tuple

import numpy as np
import paddle

from .cache import CACHE, const, constant
from .partition import VARIANTS, draw_dst, grid, variant_index
from .runtime import dtype_name
from .similarity import normalize_rows, similarity_dtype

__all__ = ["Windows", "best_in_windows", "match_windows", "window_partition_table", "window_positions",
           "window_sides", "windows"]


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
    """One axis of :func:`window_sides`."""
    best, best_key = n, None
    for d in range(stride, n + 1):
        if n % d == 0:
            key = (abs(math.log(d / window)), -d)
            if best_key is None or key < best_key:
                best, best_key = d, key
    return best


class Windows:
    """Host-side description of an ``h x w`` grid cut into equal ``wy x wx`` windows, each with its own ``sy x sx``
    cells (numpy, cached by :func:`windows`). Token tables are in window-major order: window by window, row-major
    inside a window."""

    def __init__(self, h: int, w: int, wy: int, wx: int, sx: int, sy: int):
        self.h, self.w, self.wy, self.wx, self.sx, self.sy = h, w, wy, wx, sx, sy
        self.count, self.size, self.slots = (h // wy) * (w // wx), wy * wx, sx * sy
        local = grid(wy, wx, sx, sy)  # the cells of one window
        self.num_dst, self.num_src = local.num_dst, local.num_src  # per window
        win_y, win_x, ty, tx = np.meshgrid(np.arange(h // wy), np.arange(w // wx), np.arange(wy), np.arange(wx),
                                           indexing="ij")
        self.order = ((win_y * wy + ty) * w + (win_x * wx + tx)).reshape(self.count, self.size).astype(np.int64)
        self.inverse = np.argsort(self.order.reshape(-1)).astype(np.int64)  # grid position -> window-major index
        self.cell_of = (np.arange(self.count)[:, None] * self.num_dst + local.cell_of[None, :]).reshape(-1)
        self.slot_of = np.tile(local.slot_of, self.count)
        self.top_left = np.tile(local.top_left, (self.count, 1))  # the partition with every cell's top-left as dst

    def tensors(self) -> Dict[str, paddle.Tensor]:
        """The device copies of the tables (cached per place)."""
        return CACHE.get(("windows", self.h, self.w, self.wy, self.wx, self.sx, self.sy), _window_tensors, self)

    def variants(self, seed: int) -> paddle.Tensor:
        """``[VARIANTS, W, T]`` window-local partitions for ``seed`` on the device (drawn once, cached)."""
        key = ("window_variants", self.h, self.w, self.wy, self.wx, self.sx, self.sy, int(seed))
        return CACHE.get(key, _variant_tensor, self, seed)

    def local_partitions(self, seed: Optional[int]) -> np.ndarray:
        """``[VARIANTS, W, T]`` (``[1, W, T]`` for ``seed=None``: every cell's top-left token as its dst) on the host:
        each window's tokens (window-local) in partition order, src first, then dst, each in position order."""
        if seed is None or self.num_dst == 0:
            return self.top_left[None]
        key = (int(seed), self.h, self.w, self.wy, self.wx, self.sx, self.sy, 1)
        is_dst = draw_dst(self.cell_of, self.slot_of, self.count * self.num_dst, self.slots, key)
        return np.argsort(is_dst.reshape(VARIANTS, self.count, self.size), axis=-1, kind="stable")

    def ranked(self, local: np.ndarray) -> np.ndarray:
        """``[..., N]`` grid positions of window-local partitions ``local`` (``[..., W, T]``): every window's src,
        window by window, then every window's dst (the order feature order sorts)."""
        positions = np.take_along_axis(np.broadcast_to(self.order, local.shape), local, axis=-1)
        flat = positions.reshape(*local.shape[:-2], -1)
        slots = np.arange(self.count * self.size).reshape(self.count, self.size)
        return flat[..., np.concatenate([slots[:, :self.num_src].reshape(-1), slots[:, self.num_src:].reshape(-1)])]


def _variant_tensor(win: Windows, seed: int) -> paddle.Tensor:
    # a module function, not a closure: Paddle's SOT tracer cannot read a lambda's cells
    return const(win.local_partitions(seed))


def _window_tensors(win: Windows) -> Dict[str, paddle.Tensor]:
    return {
        "order": const(win.order), "flat_order": const(win.order.reshape(-1)), "inverse": const(win.inverse),
        "top_left": const(win.top_left),
        "identity": const(np.tile(np.arange(win.size, dtype=np.int64), (win.count, 1))),
    }


@functools.lru_cache(maxsize=64)
def windows(h: int, w: int, wy: int, wx: int, sx: int, sy: int) -> Windows:
    return Windows(h, w, wy, wx, sx, sy)


def window_partition_table(
    h: int, w: int, wy: int, wx: int, sx: int, sy: int, step: Optional[paddle.Tensor], seed: int, blocks: int
) -> paddle.Tensor:
    """Partitions for local matching, for ``blocks`` blocks at once: an int64 ``[max(blocks, 2), W, T]`` tensor
    (``W`` windows of ``T = wy*wx`` tokens) whose ``[i, k]`` lists the tokens of window ``k`` (window-local,
    row-major) in partition order: src first, then dst, each in position order. Each cell's dst is drawn as in
    :func:`~ppdiffusers_tome.ops.partition.partition_table` (variants of the windows' own table, picked by the step
    key); ``step=None`` takes every cell's top-left token instead.

    >>> import paddle
    >>> from ppdiffusers_tome.ops.partition import step_key
    >>> table = window_partition_table(8, 8, 4, 4, 2, 2, step_key(999), seed=0, blocks=1)
    >>> list(table.shape), sorted(table[0, 1].numpy().tolist()) == list(range(16))
    ([2, 4, 16], True)
    """
    win = windows(int(h), int(w), int(wy), int(wx), int(sx), int(sy))
    rows = max(int(blocks), 2)
    if step is None or win.num_dst == 0:
        return paddle.expand(win.tensors()["top_left"].unsqueeze(0), [rows, win.count, win.size])
    return paddle.gather(win.variants(seed), variant_index(step, seed, rows))


def window_positions(win: Windows, partition: paddle.Tensor) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """The grid positions of every window's src ``[W, Ns_w]`` and dst ``[W, Nd_w]`` under ``partition``."""
    pos = paddle.take_along_axis(win.tensors()["order"], partition, axis=1, broadcast=False)  # [W, T] positions
    return paddle.split(pos, [win.num_src, win.num_dst], axis=1)


def best_in_windows(src: paddle.Tensor, dst: paddle.Tensor, win: Windows) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Best dst and its cosine for every src, window by window (``[B*W, Ns_w]`` each), from unit src and dst rows
    in window order (``[B*W, Ns_w, C]`` and ``[B*W, Nd_w, C]``, or anything that reshapes to them): one batched
    ``[B*W, Ns_w, Nd_w]`` product. A best similarity that is not a number counts as -2, below any cosine: such a src
    merges last."""
    channels = src.shape[-1]
    if src.ndim != 3 or src.shape[1] != win.num_src:
        src, dst = src.reshape([-1, win.num_src, channels]), dst.reshape([-1, win.num_dst, channels])
    scores = paddle.matmul(src, dst, transpose_y=True)  # [B*W, Ns_w, Nd_w]
    del src, dst
    return paddle.fmax(scores.max(axis=-1), constant(-2.0, dtype_name(scores.dtype))), scores.argmax(axis=-1)


def match_windows(metric: paddle.Tensor, win: Windows, partition: paddle.Tensor, kind: str
                  ) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Best dst in its window and the cosine similarity to it, for every src of every window: ``[B*W, Ns_w]`` each.
    The src and the dst are gathered into window order (the one token-sized buffer, normalised in place) and
    compared with one batched ``[B*W, Ns_w, Nd_w]`` product. Non-finite tokens are not cleared token by token (a
    dense plan spreads them over their window anyway); a src whose best similarity is not finite counts as 0."""
    work = similarity_dtype(metric.dtype, kind)
    if dtype_name(metric.dtype) != work:
        metric = metric.astype(work)
    src_pos, dst_pos = window_positions(win, partition)
    # normalised before the reshape: a static program refuses in-place ops on a reshaped (viewed) tensor
    src = normalize_rows(paddle.gather(metric, src_pos.reshape([-1]), axis=1), kind, in_place=True)
    dst = normalize_rows(paddle.gather(metric, dst_pos.reshape([-1]), axis=1), kind, in_place=True)
    return best_in_windows(src, dst, win)

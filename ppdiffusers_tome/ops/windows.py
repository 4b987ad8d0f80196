"""Windows for local matching: equal ``wy x wx`` tiles of the token grid, each with its own cells and partition (a
:class:`~ppdiffusers_tome.ops.partition.Layout` with windows).

A src is then compared only with the dst of its own window: the similarity is a batched ``[B*W, Ns_w, Nd_w]``
product, which grows as ``N * window**2`` (``window`` tokens per side) instead of ``N**2`` (the recipe of ToMA, Lu et
al. 2025).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Tuple

import paddle

from .cache import constant
from .partition import Layout, layout, pick_partitions
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


Windows = Layout  # the name of 0.11's window description: a layout with windows


@functools.lru_cache(maxsize=64)  # (a hit runs no Python frame)
def windows(h: int, w: int, wy: int, wx: int, sx: int, sy: int) -> Layout:
    """The :class:`~ppdiffusers_tome.ops.partition.Layout` of an ``h x w`` grid cut into ``wy x wx`` windows with
    ``sy x sx`` cells (the argument order of a windows spec)."""
    return layout(h, w, sx, sy, wy, wx)


def window_partition_table(
    h: int, w: int, wy: int, wx: int, sx: int, sy: int, step: Optional[paddle.Tensor], seed: int, blocks: int
) -> paddle.Tensor:
    """Partitions for local matching, for ``blocks`` blocks at once: an int64 ``[max(blocks, 2), W, T]`` tensor
    (``W`` windows of ``T = wy*wx`` tokens) whose ``[i, k]`` lists the tokens of window ``k`` (window-local,
    row-major) in partition order: src first, then dst, each in position order. Each cell's dst is drawn as in
    :func:`~ppdiffusers_tome.ops.partition.partition_table` (variants of the windows' own table, picked by the step
    key); ``step=None`` takes every cell's top-left token instead. :func:`~ppdiffusers_tome.ops.partition.
    pick_partitions` in the window-local form.

    >>> import paddle
    >>> from ppdiffusers_tome.ops.partition import step_key
    >>> table = window_partition_table(8, 8, 4, 4, 2, 2, step_key(999), seed=0, blocks=1)
    >>> list(table.shape), sorted(table[0, 1].numpy().tolist()) == list(range(16))
    ([2, 4, 16], True)
    """
    return pick_partitions(windows(int(h), int(w), int(wy), int(wx), int(sx), int(sy)), step, seed, blocks, local=True)


def window_positions(win: Layout, partition: paddle.Tensor) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """The grid positions of every window's src ``[W, Ns_w]`` and dst ``[W, Nd_w]`` under ``partition``."""
    pos = paddle.take_along_axis(win.tensors().order, partition, axis=1, broadcast=False)  # [W, T] positions
    return paddle.split(pos, [win.num_src, win.num_dst], axis=1)


def best_in_windows(src: paddle.Tensor, dst: paddle.Tensor, win: Layout) -> Tuple[paddle.Tensor, paddle.Tensor]:
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


def match_windows(metric: paddle.Tensor, win: Layout, partition: paddle.Tensor, kind: Any
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

"""Feature order: matching windows cut along the tokens' features instead of the grid.

One step of spherical k-means, started from tiles of the grid (the windows, halved while there are at most 64
tiles): the mean token of every tile is a centroid, every token joins the centroid it points closest to, the
clusters are ordered by their centroid's cosine with the mean token, and the src (and,
separately, the dst) of the partition are sorted by their cluster's place in that order, stably (so a cluster keeps
its tokens in grid order), and cut into as many equal runs as there are windows. Window ``k`` holds the ``k``-th run of src and the ``k``-th run of dst: tokens that point the
same way wherever they are on the grid, with the same sizes and the same similarity product as grid windows, for
about twenty operators more than grid windows (two small products against the centroids, an argmax, one sort).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import paddle

from .cache import CACHE, Tables, batch_tables, const
from .partition import Layout, pick_partitions
from .runtime import KERNELS, argsort_rows, dtype_name, tracing
from .similarity import normalize_rows, similarity_dtype
from .windows import best_in_windows, windows

__all__ = ["FeatureTables", "cluster_keys", "feature_partition_table", "match_feature_windows", "tile_sides"]


MAX_CLUSTERS = 64  # centroids at most: the [B, N, K] scores against them stay as large as the windows' similarity


def tile_sides(win: Layout) -> Tuple[int, int]:
    """The tiles whose means are the centroids: the windows, halved on both sides while both sides are even and the
    tile count stays within :data:`MAX_CLUSTERS` (so tiles always divide the grid, and small windows, which hold
    few distinct contents, get finer tiles).

    >>> from ppdiffusers_tome.ops.windows import windows
    >>> tile_sides(windows(16, 16, 8, 8, 2, 2)), tile_sides(windows(64, 64, 16, 16, 2, 2))
    ((2, 2), (8, 8))
    """
    ty, tx = win.wy, win.wx
    while ty % 2 == 0 and tx % 2 == 0 and (win.h // (ty // 2)) * (win.w // (tx // 2)) <= MAX_CLUSTERS:
        ty, tx = ty // 2, tx // 2
    return ty, tx


def cluster_keys(metric: paddle.Tensor, win: Layout, kind: Any = "cpu") -> paddle.Tensor:
    """``[B, N, 1]`` int64: for every token, the place of its cluster when the clusters are ordered by their centroid's
    cosine with the mean token. A token's cluster is the centroid it points closest to (the largest dot product with
    the unit centroid; a token's own length does not change which one); tokens of one cluster share a key, and
    clusters that point alike get keys next to each other. (A tile whose mean is zero or not finite gives a centroid
    that is not finite: then the clusters are arbitrary, and windows still hold every token once.)"""
    channels = metric.shape[2]
    ty, tx = tile_sides(win)
    tiles = metric.reshape([-1, win.h // ty, ty, win.w // tx, tx, channels])
    means = paddle.mean(tiles, axis=[2, 4]).reshape([-1, (win.h // ty) * (win.w // tx), channels])  # [B, K, C]
    centroids = means / paddle.linalg.norm(means, p=2, axis=-1, keepdim=True)
    overall = paddle.mean(means, axis=1, keepdim=True)  # [B, 1, C]: the mean token (tiles are equally large)
    along = paddle.matmul(centroids, overall, transpose_y=True)  # [B, K, 1]
    place = argsort_rows(argsort_rows(along, kind, axis=1), kind, axis=1)  # [B, K, 1]: rank of every cluster
    cluster = paddle.matmul(metric, centroids, transpose_y=True).argmax(axis=-1, keepdim=True)  # [B, N, 1]
    return paddle.take_along_axis(place, cluster, axis=1, broadcast=False)  # [B, N, 1]


def match_feature_windows(metric: paddle.Tensor, win: Layout, partition: paddle.Tensor, kind: Any
                          ) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Like :func:`~ppdiffusers_tome.ops.windows.match_windows`, with the windows cut along the features (see the
    module docstring).

    ``partition`` is a row of :func:`feature_partition_table` (or a window-local ``[W, T]`` partition, three
    operators more). Returns the best similarity and dst of every src (``[B*W, Ns_w]`` each) and the window layout ``[B, N]``: the
    grid position of each window's tokens, window by window, each window's src first, then its dst (so the
    window-local partition is the identity)."""
    work, channels, tokens = similarity_dtype(metric.dtype, kind), metric.shape[2], metric.shape[1]
    if dtype_name(metric.dtype) != work:
        metric = metric.astype(work)
    t = _feature_tables(win)
    ranked = partition  # [N]: grid positions of every window's src, then of every window's dst
    if partition.ndim == 2:  # a window-local partition [W, T]
        positions = paddle.take_along_axis(win.tensors().order, partition, axis=1, broadcast=False).reshape([-1])
        ranked = paddle.gather(positions, t.ranked)
    # sort key in rank order: the token's cluster's place, the dst after every src; a stable sort keeps rank order
    # inside a cluster
    key = paddle.gather(cluster_keys(metric, win, kind), ranked, axis=1) + t.dst_after_src  # [B, N, 1]
    order = argsort_rows(key, kind, axis=1)
    # every item's grid positions sorted: its runs of src, then its runs of dst
    runs = paddle.gather(ranked, order.reshape([-1])).reshape([-1, tokens])  # [B, N]
    layout = paddle.gather(runs, t.window_major, axis=1)  # [B, N]: window by window, src first, then dst
    # the rows of [B*N, C] of every item's src, then of every item's dst: gathered at once (the one token-sized
    # buffer), then cut in two along its first axis (views, no copy)
    batch = -1 if tracing() else int(metric.shape[0])
    rows = paddle.gather((runs + _item_offsets(batch, tokens, runs)).reshape([-1]), _src_then_dst(batch, win, runs))
    tokens_in_order = paddle.gather(metric.reshape([-1, channels]), rows)
    src_rows = (paddle.shape(metric)[0] if batch < 0 else batch) * (win.count * win.num_src)
    if KERNELS[kind].few_launches:  # normalised in place at once
        unit = normalize_rows(tokens_in_order, kind, in_place=True)
        src, dst = unit[:src_rows], unit[src_rows:]
    else:  # a CPU squares the rows it normalises: half by half, its temporary stays below the buffer's size
        src = normalize_rows(tokens_in_order[:src_rows], kind, in_place=not tracing())
        dst = normalize_rows(tokens_in_order[src_rows:], kind, in_place=not tracing())
    best, best_dst = best_in_windows(src, dst, win)
    return best, best_dst, layout


def feature_partition_table(
    h: int, w: int, wy: int, wx: int, sx: int, sy: int, step: Optional[paddle.Tensor], seed: int, blocks: int
) -> paddle.Tensor:
    """:func:`~ppdiffusers_tome.ops.windows.window_partition_table` in the form feature order reads: an int64
    ``[max(blocks, 2), N]`` tensor whose rows list the grid positions of every window's src, window by window, then
    of every window's dst (the same partitions: :func:`~ppdiffusers_tome.ops.partition.pick_partitions` in the
    grid-position form).

    >>> from ppdiffusers_tome.ops.partition import step_key
    >>> table = feature_partition_table(8, 8, 4, 4, 2, 2, step_key(999), seed=0, blocks=1)
    >>> list(table.shape), sorted(table[0].numpy().tolist()) == list(range(64))
    ([2, 64], True)
    """
    return pick_partitions(windows(int(h), int(w), int(wy), int(wx), int(sx), int(sy)), step, seed, blocks)


class FeatureTables(Tables):
    """Constant index tables of feature order on one layout (cached per place)."""

    __slots__ = ("ranked", "window_major", "dst_after_src")

    def __init__(self, ranked: paddle.Tensor, window_major: paddle.Tensor, dst_after_src: paddle.Tensor) -> None:
        self.ranked = ranked  # [N] the window-major partition slots of every src, then of every dst
        self.window_major = window_major  # [N] the slots of a [src runs | dst runs] order that make up each window
        self.dst_after_src = dst_after_src  # [1, N, 1] the key shift that sorts every dst after every src


def _feature_tables(win: Layout) -> FeatureTables:
    return CACHE.get(("feature",) + win.key, _build_feature_tables, win)


def _build_feature_tables(win: Layout) -> FeatureTables:
    count, ns_w, nd_w = win.count, win.num_src, win.num_dst
    slots = np.arange(count * win.size).reshape(count, win.size)
    ranked = np.concatenate([slots[:, :ns_w].reshape(-1), slots[:, ns_w:].reshape(-1)])
    src_runs = np.arange(count * ns_w).reshape(count, ns_w)
    dst_runs = count * ns_w + np.arange(count * nd_w).reshape(count, nd_w)
    window_major = np.concatenate([src_runs, dst_runs], axis=1).reshape(-1)
    ty, tx = tile_sides(win)
    clusters = (win.h // ty) * (win.w // tx)
    shift = np.concatenate([np.zeros(count * ns_w), np.full(count * nd_w, clusters)])[None, :, None]
    return FeatureTables(ranked=const(ranked), window_major=const(window_major), dst_after_src=const(shift))


def _src_then_dst(batch: int, win: Layout, like: paddle.Tensor) -> paddle.Tensor:
    """``[B*N]`` int64: the places of a flattened ``[B, N]`` table of src runs then dst runs (per item) that list
    every item's src, then every item's dst (cached per batch size; from the runtime shape of ``like``, ``[B,
    ...]``, while tracing a dynamic batch)."""
    return batch_tables("src_then_dst", batch, like, _build_src_then_dst, win.count * win.num_src,
                        win.count * win.size)


def _build_src_then_dst(batch: Any, num_src: int, tokens: int) -> paddle.Tensor:
    starts = (paddle.arange(batch, dtype="int64") * tokens).unsqueeze(-1)  # [B, 1]
    src = starts + paddle.arange(num_src, dtype="int64").unsqueeze(0)
    dst = starts + paddle.arange(num_src, tokens, dtype="int64").unsqueeze(0)
    return paddle.concat([src.reshape([-1]), dst.reshape([-1])])


def _item_offsets(batch: int, tokens: int, like: paddle.Tensor) -> paddle.Tensor:
    """``[B, 1]`` int64: the first row of every item of a flattened ``[B*N, ...]`` tensor (cached per batch size in
    eager mode; from the runtime shape of ``like``, ``[B, ...]``, while tracing a dynamic batch)."""
    return batch_tables("item_offsets", batch, like, _build_item_offsets, tokens)


def _build_item_offsets(batch: Any, tokens: int) -> paddle.Tensor:
    return (paddle.arange(batch, dtype="int64") * tokens).unsqueeze(-1)

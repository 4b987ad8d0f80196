"""Feature order: matching windows cut along the tokens' features instead of the grid.

The src (and, separately, the dst) of the partition are sorted by their cosine with the mean token and cut into
equal parts; each part is sorted along the next principal axis of what the mean leaves out and cut again, up to
:data:`MAX_FEATURE_LEVELS` levels (the cells of a k-d tree over the tokens' directions). Window ``k`` then holds the
``k``-th run of src and the ``k``-th run of dst: tokens that point the same way wherever they are on the grid, with
the same sizes and the same similarity product as grid windows.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import numpy as np
import paddle
import paddle.nn.functional as F

from .cache import CACHE, const, constant
from .runtime import dtype_name, tracing
from .similarity import clear_non_finite, normalize_rows, similarity_dtype
from .windows import Windows, best_in_windows, window_positions

__all__ = ["DEFAULT_SQUARINGS", "MAX_FEATURE_LEVELS", "feature_keys", "feature_levels", "match_feature_windows",
           "principal_axes"]

# feature order cuts its windows along at most this many keys: the cosine with the mean token, then principal axes
MAX_FEATURE_LEVELS = 4
# squarings of the second moment before an axis is read off it: 4 give the 16th power, i.e. 16 power iterations
# (a fifth squaring underflows float32 when the spectrum is flat, see _start_axes)
DEFAULT_SQUARINGS = 4


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


def match_feature_windows(metric: paddle.Tensor, win: Windows, partition: paddle.Tensor, kind: str,
                          squarings: int = DEFAULT_SQUARINGS) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Like :func:`~ppdiffusers_tome.ops.windows.match_windows`, with the windows cut along the features (see the
    module docstring; :func:`feature_levels` says how many parts at each level).

    Returns the best similarity and dst of every src (``[B*W, Ns_w]`` each) and the window layout ``[B, W, T]``:
    the grid position of each window's tokens, its src first, then its dst (so the window-local partition is the
    identity)."""
    work, channels, tokens = similarity_dtype(metric.dtype, kind), metric.shape[2], metric.shape[1]
    if dtype_name(metric.dtype) != work:
        metric = metric.astype(work)
    num_src = win.count * win.num_src
    src_pos, dst_pos = window_positions(win, partition)
    ranked = paddle.concat([src_pos.reshape([-1]), dst_pos.reshape([-1])])  # [N]: every src, then every dst
    levels = feature_levels(win.count)
    keys = feature_keys(metric, kind, max(len(levels), 1), squarings)
    keys = paddle.gather(keys, ranked, axis=1)  # [B, N, L] in rank order
    keys = paddle.unbind(keys, axis=2) if len(levels) > 1 else [keys.reshape([-1, tokens])]
    spare = 1 if kind == "gpu" and int(metric.shape[0]) == 1 else 0  # (a one-row GPU sort syncs)
    order = _sort(keys[0] + _cell_shift(win, 1), spare)  # [B, N]: src by the first key, then dst by it
    cells = 1
    for level in range(1, len(levels)):  # within each cell of that order, by the next key
        cells *= levels[level - 1]
        key = paddle.take_along_axis(keys[level], order, axis=1, broadcast=False)
        order = paddle.take_along_axis(order, _sort(key + _cell_shift(win, cells), spare), axis=1, broadcast=False)
    layout = paddle.gather(ranked, order.reshape([-1])).reshape([-1, tokens])  # [B, N] positions in window order
    rows = layout + _item_offsets(-1 if tracing() else int(metric.shape[0]), tokens, layout)  # rows of [B*N, C]
    flat = metric.reshape([-1, channels])
    src_rows, dst_rows = paddle.split(rows, [num_src, tokens - num_src], axis=1)
    src = normalize_rows(paddle.gather(flat, src_rows.reshape([-1])), kind, in_place=True)
    dst = normalize_rows(paddle.gather(flat, dst_rows.reshape([-1])), kind, in_place=True)
    best, best_dst = best_in_windows(src, dst, win)
    del src, dst
    src_layout, dst_layout = paddle.split(layout, [num_src, tokens - num_src], axis=1)
    window_layout = paddle.concat([src_layout.reshape([-1, win.count, win.num_src]),
                                   dst_layout.reshape([-1, win.count, win.num_dst])], axis=2)  # [B, W, T]
    return best, best_dst, window_layout


def _sort(key: paddle.Tensor, spare: int) -> paddle.Tensor:
    """Stable ascending order of every row of ``key``; ``spare`` pads a row (a one-row GPU sort syncs)."""
    order = paddle.argsort(F.pad(key, [0, spare, 0, 0]) if spare else key, axis=-1, stable=True)
    return order[:-1] if spare else order


def feature_keys(metric: paddle.Tensor, kind: str, levels: int, squarings: int = DEFAULT_SQUARINGS) -> paddle.Tensor:
    """The sort keys of feature order, ``[B, N, levels]`` float32, in [-1, 1] (0 for a token that is zero or not
    finite): the cosine of every token with its item's mean unit token ``m``, then the projections of its unit
    vector on the top ``levels - 1`` principal axes of what ``m`` does not explain (:func:`principal_axes`).
    (On a CPU one ``square`` of the tokens is transient.)"""
    n = metric.shape[1]
    if kind == "gpu":
        rnorm = paddle.reciprocal(paddle.linalg.norm(metric, p=2, axis=-1, keepdim=True))  # [B, N, 1]
    else:
        ones = constant(1.0, dtype_name(metric.dtype), (metric.shape[-1], 1))
        rnorm = paddle.rsqrt(paddle.matmul(paddle.square(metric), ones))
    rnorm = clear_non_finite(rnorm)  # zero, NaN and inf rows weigh nothing
    # means over N (not sums): no product leaves a half-precision range; lengths do not change an order
    mean = paddle.scale(paddle.matmul(rnorm, metric, transpose_x=True), 1.0 / n)  # [B, 1, C]
    directions = mean
    if levels > 1:
        along = _unit_length(mean.astype("float32") if dtype_name(mean.dtype) != "float32" else mean)
        axes = principal_axes(metric, rnorm, along, levels - 1, squarings)
        if dtype_name(metric.dtype) != "float32":
            axes = axes.astype(metric.dtype)
        directions = paddle.concat([mean, axes], axis=1)  # [B, levels, C]
    keys = paddle.matmul(metric, directions, transpose_y=True) * rnorm  # [B, N, levels]
    return clear_non_finite(keys.astype("float32") if dtype_name(keys.dtype) != "float32" else keys)


def principal_axes(metric: paddle.Tensor, rnorm: paddle.Tensor, along: paddle.Tensor, count: int,
                   squarings: int = DEFAULT_SQUARINGS) -> paddle.Tensor:
    """The top ``count`` principal axes (``[B, count, C]`` float32, orthonormal, strongest first) of the unit tokens'
    components orthogonal to ``along`` (the unit mean, ``[B, 1, C]`` float32). They have mean 0, so no centring.

    The ``[B, C, C]`` second-moment matrix of the unit tokens is one product over the tokens (in their dtype: the
    factors are scaled by ``1/sqrt(N)`` so every entry and sum stays below 1). Each axis is then found on that small
    matrix in float32: projected off ``along`` and the axes found so far, scaled to Frobenius norm 1, squared
    ``squarings`` times, and a fixed start vector times that power (``2**squarings`` power iterations) is the axis.
    (Deflating before the power, not orthonormalising after it: a high power of one matrix maps every start vector
    onto nearly the top axis, and what a Gram-Schmidt would keep of the others is rounding.) Nothing larger than
    ``B * C * C`` besides one transient copy of the tokens."""
    n, channels = metric.shape[1], metric.shape[2]
    scaled = metric * paddle.scale(rnorm, 1.0 / math.sqrt(n))  # [B, N, C]: unit rows / sqrt(N)
    moment = paddle.matmul(scaled, scaled, transpose_x=True)  # [B, C, C], trace <= 1
    del scaled
    if dtype_name(moment.dtype) != "float32":
        moment = moment.astype("float32")
    start = _start_axes(count, channels, squarings)
    found, axes = along, []
    for index in range(count):
        project = _eye(channels) - paddle.matmul(found, found, transpose_x=True)  # [B, C, C]: off what is found
        power = paddle.matmul(paddle.matmul(project, moment), project)
        # (a zero or non-finite power gives a non-finite axis, which _unit_length clears to 0)
        power = power * paddle.rsqrt(paddle.sum(paddle.square(power), axis=[1, 2], keepdim=True))
        for _ in range(squarings):
            power = paddle.matmul(power, power)
        axes.append(_unit_length(paddle.matmul(start[:, index:index + 1], power)))  # [B, 1, C]
        if index + 1 < count:
            found = paddle.concat([found, axes[-1]], axis=1)
    return paddle.concat(axes, axis=1) if count > 1 else axes[0]


def _start_axes(count: int, channels: int, squarings: int) -> paddle.Tensor:
    """Fixed start vectors for the power iterations of :func:`principal_axes`, ``[1, count, C]`` float32 (drawn
    once from a seeded generator), scaled so that an axis's length stays inside float32's range before it is
    normalised.

    With the moment at Frobenius norm 1 its top eigenvalue lies in ``[C**-0.5, 1]``, so its ``2**k``-th power
    (``k`` squarings) shrinks the start vector by a factor in ``[C**-(2**(k-1)), 1]``; the start vectors are
    scaled by the middle of that range, ``C**(2**(k-2))``. For ``k = 4`` and ``C = 1280`` the length then stays
    within about ``1e-13 .. 1e14`` and its square within float32; unscaled, the squares of a flat spectrum's axis
    entries fall below float32's normal range and :func:`_unit_length` returns a vector of the wrong length (about
    1.1 at 1280 channels). (Five squarings would span ``C**-8 .. C**8``, whose square no scale fits.)"""
    return CACHE.get(("start_axes", count, channels, squarings), _build_start_axes, count, channels, squarings)


def _build_start_axes(count: int, channels: int, squarings: int) -> paddle.Tensor:
    scale = float(channels) ** (2.0 ** (squarings - 2))
    return const(scale * np.random.default_rng(channels).standard_normal((1, count, channels)), "float32")


def _unit_length(v: paddle.Tensor) -> paddle.Tensor:
    """``v`` (``[B, 1, C]``) divided by its length; a zero or non-finite vector becomes 0."""
    return clear_non_finite(v * paddle.rsqrt(paddle.sum(paddle.square(v), axis=-1, keepdim=True)))


def _eye(channels: int) -> paddle.Tensor:
    """A cached ``[C, C]`` float32 identity."""
    return CACHE.get(("eye", channels), _build_eye, channels)


def _build_eye(channels: int) -> paddle.Tensor:
    return const(np.eye(channels), "float32")


def _cell_shift(win: Windows, cells: int) -> paddle.Tensor:
    """``[1, N]`` float32 added to the next key in the current order, where the src and the dst are each cut into
    ``cells`` equal runs: 4 per run (keys lie in [-1, 1]), the dst after every src, so one sort orders the tokens by
    run and by the key inside each."""
    return CACHE.get(("cell_shift", win.count, win.num_src, win.num_dst, cells), _build_cell_shift, win, cells)


def _build_cell_shift(win: Windows, cells: int) -> paddle.Tensor:
    num_src, num_dst = win.count * win.num_src, win.count * win.num_dst
    src = np.arange(num_src) // (num_src // cells)
    dst = np.arange(num_dst) // (num_dst // cells) + cells
    return const(4.0 * np.concatenate([src, dst])[None, :], "float32")


def _item_offsets(batch: int, tokens: int, like: paddle.Tensor) -> paddle.Tensor:
    """``[B, 1]`` int64: the first row of every item of a flattened ``[B*N, ...]`` tensor (cached per batch size in
    eager mode; from the runtime shape of ``like``, ``[B, ...]``, while tracing a dynamic batch)."""
    if batch < 0:
        return (paddle.arange(paddle.shape(like)[0], dtype="int64") * tokens).unsqueeze(-1)
    return CACHE.get(("item_offsets", batch, tokens), _build_item_offsets, batch, tokens)


def _build_item_offsets(batch: int, tokens: int) -> paddle.Tensor:
    return (paddle.arange(batch, dtype="int64") * tokens).unsqueeze(-1)

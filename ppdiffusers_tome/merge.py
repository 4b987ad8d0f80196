"""Pure token-merging core: partition, bipartite soft matching, merge and unmerge.

Nothing in this file knows about UNets, pipelines or hooks. It maps tensors to tensors, so it can be tested
and benchmarked on its own. The model glue in :mod:`ppdiffusers_tome.patch` builds one :class:`MergePlan` per
transformer block call and applies its ``merge``/``unmerge`` around the block's sub-layers.

Layout of a plan (per batch item ``b``; ``N`` tokens, ``Nd`` dst, ``Ns = N - Nd`` src, ``r`` merged)::

    merged row:   0 ........ Ns-r-1 | Ns-r ........ Ns-r+Nd-1
    holds:        unmerged src       | dst (each the mean of itself and the src merged into it)

All index tensors are flattened over the batch once when the plan is built. ``merge`` gathers the kept rows and
adds ``(src - dst) / count`` onto each dst (exact when tokens are identical, and the differences of similar tokens
are small, which keeps the mean accurate); ``unmerge`` is a single gather.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, Optional, Tuple, Union

import numpy as np
import paddle

__all__ = [
    "DOWNSAMPLE_MODES",
    "DownsamplePlan",
    "MergePlan",
    "bipartite_soft_matching_random2d",
    "compute_dtype",
    "downsample_tokens",
    "find_downsample",
    "grid_partition",
    "max_ratio",
]

_LOW_PRECISION = ("float16", "bfloat16")
_NORM_EPS = 1e-6
_MERGE_MODES = ("mean", "sum")
DOWNSAMPLE_MODES = ("nearest", "average")

GeneratorLike = Union[None, int, np.random.Generator]


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


@functools.lru_cache(maxsize=64)
def _grid_geometry(h: int, w: int, sx: int, sy: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cached per resolution: top-left position of every full sy x sx cell, the in-cell (dy*w + dx) offset of each
    cell slot, and the top-left partition's src positions."""
    hsy, wsx = h // sy, w // sx
    rows = np.arange(hsy, dtype=np.int64)[:, None] * (sy * w)
    cols = np.arange(wsx, dtype=np.int64)[None, :] * sx
    cell_origin = (rows + cols).reshape(-1)
    slot = np.arange(sy * sx, dtype=np.int64)
    slot_offset = (slot // sx) * w + (slot % sx)
    is_dst = np.zeros(h * w, dtype=bool)
    is_dst[cell_origin] = True
    src_top_left = np.flatnonzero(~is_dst).astype(np.int64)
    for arr in (cell_origin, slot_offset, src_top_left):
        arr.flags.writeable = False
    return cell_origin, slot_offset, src_top_left


def _as_generator(generator: GeneratorLike) -> np.random.Generator:
    if isinstance(generator, np.random.Generator):
        return generator
    if generator is None or isinstance(generator, (int, np.integer)):
        return np.random.default_rng(generator)
    raise TypeError(
        f"generator must be None, an int seed or a numpy.random.Generator, got {type(generator).__name__}"
    )


def grid_partition(
    h: int, w: int, sx: int, sy: int, no_rand: bool = True, generator: GeneratorLike = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Split an ``h x w`` token grid into src and dst positions (row-major token indices).

    Every full ``sy x sx`` cell holds exactly one dst token: its top-left token when ``no_rand``, otherwise one drawn
    uniformly inside the cell from ``generator`` (a numpy Generator or seed, never Paddle's global RNG). Rows and
    columns left over when ``h``/``w`` are not multiples of ``sy``/``sx`` are all src.

    Returns ``(src_pos, dst_pos)``: dst in cell order, src in increasing position order.

    >>> src, dst = grid_partition(4, 4, 2, 2)
    >>> dst.tolist()
    [0, 2, 8, 10]
    >>> len(src)
    12
    """
    cell_origin, slot_offset, src_top_left = _grid_geometry(int(h), int(w), int(sx), int(sy))
    if no_rand or len(cell_origin) == 0:
        return src_top_left, cell_origin
    slots = _as_generator(generator).integers(0, sy * sx, size=len(cell_origin))
    dst_pos = cell_origin + slot_offset[slots]
    is_dst = np.zeros(h * w, dtype=bool)
    is_dst[dst_pos] = True
    return np.flatnonzero(~is_dst).astype(np.int64), dst_pos


def _rows_in_work_dtype(x: paddle.Tensor) -> Tuple[paddle.Tensor, str]:
    """``x`` as ``[rows, channels]`` in the dtype merge arithmetic runs in (see :func:`compute_dtype`)."""
    work = compute_dtype(x.dtype)
    flat = x.reshape([-1, x.shape[-1]])
    return (flat if _dtype_name(x.dtype) == work else flat.astype(work)), work


class MergePlan:
    """The result of matching: how to merge ``[B, N, C]`` tokens to ``[B, N - r, C]`` and back.

    It unpacks as ``merge, unmerge = plan``. With ``r == 0`` both are identities.

    Attributes: ``r`` (tokens removed per item), ``num_tokens`` (N), ``batch_size`` (B), and, for plans with
    ``r > 0``, ``src_pos``/``dst_pos`` (the partition, shared by the batch) and ``merged_pos``/``merged_into``
    (``[B, r]``: which grid position each merged src came from, and the grid position of the dst it joined).
    """

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0):
        self.num_tokens = int(num_tokens)
        self.batch_size = int(batch_size)
        self.r = int(r)
        self.src_pos: Optional[paddle.Tensor] = None
        self.dst_pos: Optional[paddle.Tensor] = None
        self.merged_pos: Optional[paddle.Tensor] = None
        self.merged_into: Optional[paddle.Tensor] = None
        # flat row indices, filled by _build
        self._keep_rows: Optional[paddle.Tensor] = None
        self._src_rows: Optional[paddle.Tensor] = None
        self._into_rows: Optional[paddle.Tensor] = None
        self._target_rows: Optional[paddle.Tensor] = None
        self._src_scale: Optional[paddle.Tensor] = None
        self._unmerge_rows: Optional[paddle.Tensor] = None

    def __iter__(self) -> Iterator[Callable]:
        return iter((self.merge, self.unmerge))

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"MergePlan(batch_size={self.batch_size}, num_tokens={self.num_tokens}, r={self.r})"

    @property
    def is_identity(self) -> bool:
        return self.r <= 0

    @property
    def merged_tokens(self) -> int:
        """Tokens per item after ``merge``: ``N - r``."""
        return self.num_tokens - max(self.r, 0)

    def _check(self, x: paddle.Tensor, tokens: int, what: str) -> None:
        if x.ndim != 3 or x.shape[0] != self.batch_size or x.shape[1] != tokens:
            raise ValueError(
                f"{what} expects a [batch={self.batch_size}, tokens={tokens}, channels] tensor, got shape {list(x.shape)}"
            )

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        """Merge ``x`` of shape ``[B, N, C]`` into ``[B, N - r, C]``.

        ``mode="mean"`` averages each dst with the src merged into it (the ToMe SD rule); ``"sum"`` adds them.
        Arithmetic runs in :func:`compute_dtype`; the result has ``x``'s dtype.
        """
        if mode not in _MERGE_MODES:
            raise ValueError(f"mode must be one of {_MERGE_MODES}, got {mode!r}")
        self._check(x, self.num_tokens, "merge")
        if self.is_identity:
            return x
        flat, work = _rows_in_work_dtype(x)
        out = paddle.gather(flat, self._keep_rows)
        src = paddle.gather(flat, self._src_rows)
        if mode == "mean":  # dst + sum(src - dst) / (1 + k) == (dst + sum(src)) / (1 + k)
            src = (src - paddle.gather(flat, self._into_rows)) * self._src_scale.astype(work)
        out = paddle.index_add(out, self._target_rows, 0, src)
        return out.astype(x.dtype).reshape([self.batch_size, self.merged_tokens, x.shape[-1]])

    def unmerge(self, y: paddle.Tensor) -> paddle.Tensor:
        """Map ``y`` of shape ``[B, N - r, C]`` back to ``[B, N, C]``: every token gets the row it was merged into
        (its own row when it was not merged). One gather; the result has ``y``'s dtype."""
        self._check(y, self.merged_tokens, "unmerge")
        if self.is_identity:
            return y
        flat, _ = _rows_in_work_dtype(y)  # (Paddle's CPU build has no half-precision gather; the round trip is exact)
        out = paddle.gather(flat, self._unmerge_rows)
        return out.astype(y.dtype).reshape([self.batch_size, self.num_tokens, y.shape[-1]])


def bipartite_soft_matching_random2d(
    metric: paddle.Tensor,
    w: int,
    h: int,
    sx: int,
    sy: int,
    r: int,
    no_rand: bool = False,
    generator: GeneratorLike = None,
) -> MergePlan:
    """Plan the merge of ``r`` src tokens into their most similar dst tokens (ToMe SD, Bolya & Hoffman 2023).

    Args:
        metric: ``[B, N, C]`` tokens whose cosine similarity decides the matching (``N == h * w``). Any float
            dtype; similarity is always computed in float32, and an all-zero token gives similarity 0, not NaN.
        w, h: the token grid, row-major.
        sx, sy: stride of the dst grid: one dst per ``sy x sx`` cell (see :func:`grid_partition`).
        r: src tokens to merge per batch item; capped at the number of src tokens; ``r <= 0`` gives identities.
        no_rand: take the top-left token of each cell as dst instead of a random one.
        generator: numpy Generator or int seed for the random dst choice (Paddle's global RNG is never used).
            ``None`` draws fresh OS entropy. The partition is shared by the whole batch.

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
    batch, num_tokens, _ = metric.shape
    if h * w != num_tokens:
        raise ValueError(f"h * w must equal the token count: {h} * {w} != {num_tokens}")
    if sx < 1 or sy < 1:
        raise ValueError(f"sx and sy must be >= 1, got sx={sx}, sy={sy}")
    r = int(r)
    if r <= 0:
        return MergePlan(num_tokens, batch)

    src_np, dst_np = grid_partition(h, w, sx, sy, no_rand=no_rand, generator=None if no_rand else _as_generator(generator))
    num_dst = len(dst_np)
    num_src = num_tokens - num_dst
    r = min(r, num_src)
    if num_dst == 0 or r <= 0:
        return MergePlan(num_tokens, batch)

    plan = MergePlan(num_tokens, batch, r)
    with paddle.no_grad():
        src_pos = paddle.to_tensor(src_np)
        dst_pos = paddle.to_tensor(dst_np)
        m = metric.detach()
        if _dtype_name(m.dtype) != "float32":
            m = m.astype("float32")
        inv_norm = 1.0 / paddle.clip(paddle.square(m).sum(axis=-1).sqrt(), min=_NORM_EPS)  # [B, N]
        a = paddle.gather(m, src_pos, axis=1)  # [B, Ns, C], left unnormalized
        b = paddle.gather(m, dst_pos, axis=1) * paddle.gather(inv_norm, dst_pos, axis=1).unsqueeze(-1)
        # One [Ns, Nd] score matrix per item: on CPU faster than a batched matmul, and only one is alive at a time.
        row_start = paddle.arange(num_src, dtype="int64") * num_dst
        best_dst, best = [], []
        for item in range(batch):
            scores = paddle.matmul(a[item], b[item], transpose_y=True)  # cosine similarity times |a|
            choice = scores.argmax(axis=-1)  # scaling a row by 1/|a| > 0 does not change its argmax
            best_dst.append(choice)
            best.append(paddle.gather(scores.reshape([-1]), row_start + choice))  # (take_along_axis is slow)
        best_dst = paddle.stack(best_dst)  # [B, Ns]
        best = paddle.stack(best) * paddle.gather(inv_norm, src_pos, axis=1)  # cosine similarity
        order = paddle.argsort(best, axis=-1, descending=True, stable=True)
        unm_idx = order[:, r:]  # [B, Ns - r] src slots kept
        mrg_idx = order[:, :r]  # [B, r] src slots merged
        mrg_dst = paddle.take_along_axis(best_dst, mrg_idx, axis=-1)  # [B, r] dst slot of each merged src

        kept = num_src - r
        merged_tokens = num_tokens - r
        unm_pos = paddle.gather(src_pos, unm_idx.reshape([-1])).reshape([batch, kept])
        mrg_pos = paddle.gather(src_pos, mrg_idx.reshape([-1])).reshape([batch, r])
        dst_b = dst_pos.unsqueeze(0).expand([batch, num_dst])
        item = paddle.arange(batch, dtype="int64").unsqueeze(-1)

        plan.src_pos, plan.dst_pos = src_pos, dst_pos
        plan.merged_pos = mrg_pos
        plan.merged_into = paddle.gather(dst_pos, mrg_dst.reshape([-1])).reshape([batch, r])

        # merge: gather kept rows (unmerged src then dst), index_add merged src onto their dst rows
        plan._keep_rows = (paddle.concat([unm_pos, dst_b], axis=1) + item * num_tokens).reshape([-1])
        plan._src_rows = (mrg_pos + item * num_tokens).reshape([-1])
        plan._into_rows = (plan.merged_into + item * num_tokens).reshape([-1])
        target = mrg_dst + kept + item * merged_tokens  # row of the dst in the merged output
        plan._target_rows = target.reshape([-1])
        counts = paddle.ones([batch * merged_tokens], dtype="float32")
        counts = paddle.index_add(counts, plan._target_rows, 0, paddle.ones([batch * r], dtype="float32"))
        plan._src_scale = (1.0 / paddle.gather(counts, plan._target_rows)).unsqueeze(-1)

        # unmerge: for every grid position, the merged-output row that now holds it
        positions = paddle.concat([unm_pos, dst_b, mrg_pos], axis=1) + item * num_tokens
        slot = paddle.arange(merged_tokens, dtype="int64").unsqueeze(0).expand([batch, merged_tokens])
        rows = paddle.concat([slot, mrg_dst + kept], axis=1) + item * merged_tokens
        plan._unmerge_rows = paddle.scatter(
            paddle.zeros([batch * num_tokens], dtype="int64"), positions.reshape([-1]), rows.reshape([-1])
        )
    return plan


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
    batch, channels = x.shape[0], x.shape[2]
    grid = x.reshape([batch, h, w, channels])
    if mode == "nearest":
        out = grid[:, ::factor, ::factor, :]
    else:
        work = compute_dtype(x.dtype)
        grid = grid if _dtype_name(x.dtype) == work else grid.astype(work)
        out = paddle.nn.functional.avg_pool2d(
            grid, kernel_size=factor, stride=factor, ceil_mode=True, exclusive=True, data_format="NHWC"
        ).astype(x.dtype)
    return out.reshape([batch, -1, channels])


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

    def __repr__(self) -> str:
        return (
            f"DownsamplePlan(batch_size={self.batch_size}, grid={self.grid_h}x{self.grid_w}, "
            f"factor={self.factor}, mode={self.mode!r})"
        )

    @property
    def is_identity(self) -> bool:
        return self.factor <= 1

    @property
    def kv_tokens(self) -> int:
        """Keys/values per item after downsampling."""
        return -(-self.grid_h // self.factor) * -(-self.grid_w // self.factor)

    def keys_values(self, x: paddle.Tensor) -> paddle.Tensor:
        return downsample_tokens(x, self.grid_h, self.grid_w, self.factor, self.mode)

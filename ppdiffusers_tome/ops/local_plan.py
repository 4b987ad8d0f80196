"""Plans from local matching: each src merges only into a dst of its own window.

Every window merges the same number ``r_w`` of its src (its most similar ones), so shapes are static. Merged rows
come window by window: the kept src of window 0, its dst, then window 1, ... Three kinds, one interface
(:class:`~ppdiffusers_tome.ops.global_plan.MergePlan`'s), chosen by :meth:`LocalMergePlan.from_matching`:

* :class:`LocalMergePlan` (CPU kernels): the assignment as row tables, applied by ``index_add`` and a gather (on a
  CPU a dense product over the window costs more than the scatter it replaces);
* :class:`DenseLocalPlan` (GPU kernels, grid windows): two per-window matrices, built once in the tokens' dtype, so
  merge and unmerge are one gather (the window layout) and one batched matmul each: few kernel launches, a fixed
  summation order (bit-identical run to run, no atomics); the plan holds the two matrices and nothing else,
  ``2 * B * N * (window tokens - r_w) * bytes`` (128 MiB at [16, 16384, 320] in float16 with 16 x 16 windows);
* :class:`DenseFeaturePlan` (GPU kernels, feature windows): the same matrices, each window's tokens gathered per
  item with one ``gather_nd`` on each side.

Non-finite tokens: with the dense form a NaN or inf token makes its whole window non-finite (``0 * inf``), not just
its group; attention would spread it further anyway. In feature order, tokens that are zero or not finite sort as
if orthogonal to the rest, and a non-finite one can make every key 0 (then the windows are the partition's src and
dst in position order).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import paddle
import paddle.nn.functional as F
from paddle import _C_ops

from .cache import CACHE, Tables, batch_tables
from .feature_order import match_feature_windows
from .global_plan import MergePlan
from .partition import Layout
from .runtime import KERNELS, argsort_rows, compute_dtype, device_kind, dtype_name, tracing
from .windows import match_windows, windows

__all__ = ["DenseFeaturePlan", "DenseLocalPlan", "LocalMergePlan"]

ORDERS = ("grid", "feature")


class LocalMergePlan(MergePlan):
    """A merge plan whose matching stays inside windows (build one with :meth:`from_matching`); this class is the
    CPU kernels' form, row tables applied as by :class:`~ppdiffusers_tome.ops.global_plan.MergePlan`. The
    similarity is a batched ``[B*W, Ns_w, Nd_w]`` product: it grows as ``N * window**2`` (``window`` tokens per side)
    instead of ``N**2``."""

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: Any = "cpu",
                 windows: Optional[Layout] = None, window_r: int = 0, order: str = "grid", dtype: str = "float32",
                 ranked: Optional[paddle.Tensor] = None, best_dst: Optional[paddle.Tensor] = None,
                 partition: Optional[paddle.Tensor] = None, layout: Optional[paddle.Tensor] = None):
        """A plan is complete once made: with ``ranked`` (every window's src slots sorted by similarity) and
        ``best_dst`` (see :meth:`from_matching`) its tables are built here; without, it is an identity."""
        num_src = 0 if windows is None else windows.count * windows.num_src
        MergePlan.__init__(self, num_tokens, batch_size, r, kind, False, None, num_src)
        self.windows = windows
        self.window_r = int(window_r)
        self.order = order
        self.dtype = dtype  # of the tokens the plan was made from
        if ranked is not None:
            self._build_local(ranked, best_dst, partition, layout)

    @classmethod
    def from_matching(  # type: ignore[override]
        cls, metric: paddle.Tensor, windows_spec: Tuple[int, int, int, int, int, int], partition: paddle.Tensor,
        window_r: int, kind: Any = None, order: str = "grid",
    ) -> "LocalMergePlan":
        """Match within windows and plan the merge of ``window_r`` src per window.

        Args:
            metric: ``[B, N, C]`` tokens on an ``h x w`` grid.
            windows_spec: ``(h, w, wy, wx, sx, sy)``: the grid, its window sides (see
                :func:`~ppdiffusers_tome.ops.windows.window_sides`) and strides.
            partition: ``[W, T]`` window-local partition (one row of
                :func:`~ppdiffusers_tome.ops.windows.window_partition_table`); feature order also takes the same
                partition as one row of :func:`~ppdiffusers_tome.ops.feature_order.feature_partition_table`.
            window_r: src merged per window, ``0 < window_r <= Ns_w``.
            kind: the kernel family, a :class:`~ppdiffusers_tome.ops.runtime.Kernels` or its name; default from
                ``metric``'s place. Its ``few_launches`` picks the dense plans.
            order: ``"grid"`` (windows are tiles of the grid) or ``"feature"`` (see
                :mod:`ppdiffusers_tome.ops.feature_order`).

        Example:
            >>> import paddle
            >>> from ppdiffusers_tome.ops.partition import step_key
            >>> from ppdiffusers_tome.ops.windows import window_partition_table
            >>> x = paddle.randn([2, 256, 8])
            >>> table = window_partition_table(16, 16, 8, 8, 2, 2, step_key(5), seed=0, blocks=1)
            >>> plan = LocalMergePlan.from_matching(x, (16, 16, 8, 8, 2, 2), table[0], 24, order="feature")
            >>> plan.r, list(plan.unmerge(plan.merge(x)).shape)
            (96, [2, 256, 8])
        """
        if order not in ORDERS:
            raise ValueError(f"order must be 'grid' or 'feature', got {order!r}")
        family = KERNELS[kind or device_kind(metric)]
        win = windows(*(int(v) for v in windows_spec))
        plan_type = LocalMergePlan
        if family.few_launches:
            plan_type = DenseFeaturePlan if order == "feature" else DenseLocalPlan
        with paddle.no_grad():
            layout = None
            if order == "feature":  # each window's tokens come laid out src first, then dst: no partition to apply
                best, best_dst, layout = match_feature_windows(metric.detach(), win, partition, family)
                partition = None
            else:
                best, best_dst = match_windows(metric.detach(), win, partition, family)
            ranked = argsort_rows(best, family, descending=True)
            return plan_type(int(metric.shape[1]), int(metric.shape[0]), win.count * int(window_r), family, win,
                             window_r, order, dtype_name(metric.dtype), ranked, best_dst, partition, layout)

    def _build_local(self, order: paddle.Tensor, best_dst: paddle.Tensor, partition: Optional[paddle.Tensor],
                     layout: Optional[paddle.Tensor]) -> None:
        """The merged row (within its window) of every token: kept src first, then the dst, each merged src on
        its dst's row; then the tables of this plan's kind (part of the construction). ``partition`` is None when
        each window's tokens are already src first, then dst; ``layout`` (feature order only): ``[B, N]`` grid
        positions of the tokens, window by window."""
        win, r_w = self.windows, self.window_r
        kept, m_w = win.num_src - r_w, win.size - r_w
        b = _local_tables(-1 if tracing() else self.batch_size, win, m_w, order)
        if partition is None:
            tokens = paddle.concat([order, b.dst_slots], axis=1)  # [B*W, T] window-local token of each place
        else:
            local = paddle.tile(partition, b.repeat)  # [B*W, T]
            src_local, dst_local = paddle.split(local, [win.num_src, win.num_dst], axis=1)
            tokens = paddle.concat([paddle.take_along_axis(src_local, order, axis=1, broadcast=False), dst_local],
                                   axis=1)
        merged_dst = paddle.take_along_axis(best_dst, order[:, :r_w], axis=1, broadcast=False)
        rows = paddle.concat([merged_dst + kept, b.rows], axis=1)  # the row of each token, in sorted order
        # every token of a window is written exactly once: no conflicts (its own base: a static program may write
        # the output in place)
        row_of = put_along(b.zeros, tokens, rows)  # [B*W, T], window-local token order
        self._build_tables(row_of, b, layout)

    def _build_tables(self, row_of: paddle.Tensor, b: "LocalTables", layout: Optional[paddle.Tensor]) -> None:
        """Row tables over the ``B*N`` input rows (see :class:`MergePlan`)."""
        win = self.windows
        flat = (row_of + b.offsets).reshape([-1, win.count * win.size])  # [B, W*T], window-major tokens
        if layout is None:
            unmerge_rows = paddle.gather(flat, win.tensors().inverse, axis=1).reshape([-1])  # grid order
        else:  # every position of an item appears once in its layout: no conflicts
            unmerge_rows = put_along(b.zeros.reshape([-1, self.num_tokens]), layout, flat).reshape([-1])
        self.unmerge_rows = unmerge_rows
        self.counts = paddle.index_add(b.zeros_m, unmerge_rows, 0, b.ones_n)
        self.row_scale = paddle.gather(paddle.reciprocal(self.counts), unmerge_rows)

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        """Merge ``x`` (``[B, N, C]``) into ``[B, N - r, C]``: every weighted input row added onto the merged row it
        ends in, in row order (the CPU kernels' form: one ``index_add`` onto zeros)."""
        if self._checked_merge(x, mode):
            return x
        channels, work = x.shape[-1], compute_dtype(x.dtype)
        flat = self._weighted_rows(x, mode, work)
        if self.batch_size < 0:  # a dynamic batch while tracing
            zeros = paddle.zeros([paddle.shape(x)[0] * self.merged_tokens, channels], dtype=work)
        else:
            shape = [self.batch_size * self.merged_tokens, channels]
            zeros = CACHE.get(("zeros", shape[0], channels, work), paddle.zeros, shape, work)
        out = paddle.index_add(zeros, self.unmerge_rows, 0, flat)
        return out.astype(x.dtype).reshape([-1, self.merged_tokens, channels])

    def __repr__(self) -> str:
        win = self.windows
        shape = f", windows={win.count}x{win.wy}x{win.wx}" if win is not None else ""
        shape += ", order='feature'" if self.order == "feature" else ""
        return (f"{type(self).__name__}(batch_size={self.batch_size}, num_tokens={self.num_tokens}, r={self.r}"
                f"{shape}, kind={self.kind!r})")


class DenseLocalPlan(LocalMergePlan):
    """The GPU kernels' local plan: ``unmerge_matrix`` ``[B*W, T, Mw]`` (a one-hot of the merged row of every token)
    and ``merge_matrix`` ``[B*W, Mw, T]`` (its transpose, each row divided by its group size), both in the dtype of
    the tokens the plan was made from; merge and unmerge are one layout gather and one batched matmul each, plus two
    free reshapes."""

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: Any = "gpu", *args: Any):
        # (declared before LocalMergePlan.__init__, which builds them through _build_tables; ``args`` are its own)
        self.unmerge_matrix: Optional[paddle.Tensor] = None
        self.merge_matrix: Optional[paddle.Tensor] = None
        LocalMergePlan.__init__(self, num_tokens, batch_size, r, kind, *args)

    def _build_tables(self, row_of: paddle.Tensor, b: "LocalTables", layout: Optional[paddle.Tensor]) -> None:
        onehot = F.one_hot(row_of, self.windows.size - self.window_r)  # [B*W, T, Mw] float32 of exact 0/1
        counts = paddle.sum(onehot, axis=1, keepdim=True)  # [B*W, 1, Mw]: group sizes, exact integers
        merge = (onehot / counts).transpose([0, 2, 1])
        if self.dtype != "float32":  # (the float32 ones are temporaries of the build: only these stay)
            onehot, merge = onehot.astype(self.dtype), merge.astype(self.dtype)
        self.unmerge_matrix, self.merge_matrix = onehot, merge

    def _matrix(self, matrix: paddle.Tensor, dtype: str) -> paddle.Tensor:
        """``matrix`` for tokens of ``dtype``: itself when the plan was made from tokens of that dtype, else a cast
        for this call only (nothing more is kept)."""
        return matrix if dtype == self.dtype else matrix.astype(dtype)

    def _window_tokens(self, x: paddle.Tensor) -> paddle.Tensor:
        """``[B, N, C]`` tokens as ``[B*W, T, C]``, window by window."""
        win = self.windows
        return paddle.gather(x, win.tensors().flat_order, axis=1).reshape([-1, win.size, x.shape[-1]])

    def _grid_tokens(self, out: paddle.Tensor) -> paddle.Tensor:
        """``[B*W, T, C]`` window tokens back in grid order, ``[B, N, C]``."""
        grid_order = out.reshape([-1, self.num_tokens, out.shape[-1]])
        return paddle.gather(grid_order, self.windows.tensors().inverse, axis=1)

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        if mode != "mean":
            raise ValueError(f"a dense local plan only averages (mode='mean'); got {mode!r}")
        self.check(x, self.num_tokens, "merge")
        if self.is_identity:
            return x
        out = paddle.matmul(self._matrix(self.merge_matrix, dtype_name(x.dtype)), self._window_tokens(x))  # [B*W, Mw, C]
        return out.reshape([-1, self.merged_tokens, x.shape[-1]])

    def unmerge(self, y: paddle.Tensor) -> paddle.Tensor:
        self.check(y, self.merged_tokens, "unmerge")
        if self.is_identity:
            return y
        rows = y.reshape([-1, self.windows.size - self.window_r, y.shape[-1]])
        return self._grid_tokens(paddle.matmul(self._matrix(self.unmerge_matrix, dtype_name(y.dtype)), rows))


class DenseFeaturePlan(DenseLocalPlan):
    """:class:`DenseLocalPlan` over windows in feature order: ``window_index`` ``[B*W, T, 2]`` (the ``(item,
    position)`` of each window's tokens) and ``grid_index`` ``[B, N, 2]`` (the ``(window row, slot)`` of each item's
    tokens in grid order) are the two ``gather_nd`` indices of the layout."""

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: Any = "gpu", *args: Any):
        self.window_index: Optional[paddle.Tensor] = None  # (declared before the build, as DenseLocalPlan's)
        self.grid_index: Optional[paddle.Tensor] = None
        DenseLocalPlan.__init__(self, num_tokens, batch_size, r, kind, *args)

    def _build_tables(self, row_of: paddle.Tensor, b: "LocalTables", layout: Optional[paddle.Tensor]) -> None:
        DenseLocalPlan._build_tables(self, row_of, b, layout)  # (not super(): SOT cannot follow it)
        # (the parent called by name, not through super(): see docs/design.md, the tracing rules)
        self.window_index = paddle.stack([b.items, layout], axis=-1).reshape([-1, self.windows.size, 2])
        slots = put_along(b.zeros.reshape([-1, self.num_tokens]), layout, b.slots)
        window_rows = b.window_of_item + paddle.floor_divide(slots, b.size)  # [B, N]
        self.grid_index = paddle.stack([window_rows, paddle.remainder(slots, b.size)], axis=-1)  # [B, N, 2]

    def _window_tokens(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.gather_nd(x, self.window_index)  # [B*W, T, C]

    def _grid_tokens(self, out: paddle.Tensor) -> paddle.Tensor:
        return paddle.gather_nd(out, self.grid_index)  # [B, N, C]


def put_along(arr: paddle.Tensor, indices: paddle.Tensor, values: paddle.Tensor) -> paddle.Tensor:
    """``paddle.put_along_axis(arr, indices, values, axis=1)`` for ``indices`` and ``values`` of ``arr``'s shape: one
    operator. (The public function broadcasts equal shapes with two more operators, or, told not to, checks the
    indices' bounds by reading them on the host: a device sync on a GPU.)"""
    if paddle.in_dynamic_mode() or paddle.framework.in_pir_mode():
        return _C_ops.put_along_axis(arr, indices, values, 1, "assign", True)
    return paddle.put_along_axis(arr, indices, values, axis=1)  # pragma: no cover - the legacy static graph


class LocalTables(Tables):
    """Per-batch tables of a local plan of ``B`` items on ``W`` windows of ``T`` tokens (``Mw`` merged rows each)."""

    __slots__ = ("repeat", "rows", "zeros", "offsets", "zeros_m", "ones_n", "dst_slots", "items", "slots",
                 "window_of_item", "size")

    def __init__(self, repeat: Any, rows: paddle.Tensor, zeros: paddle.Tensor, offsets: paddle.Tensor,
                 zeros_m: paddle.Tensor, ones_n: paddle.Tensor, dst_slots: paddle.Tensor, items: paddle.Tensor,
                 slots: paddle.Tensor, window_of_item: paddle.Tensor, size: paddle.Tensor) -> None:
        self.repeat = repeat  # [B, 1]: the tiling of a partition over the batch
        self.rows = rows  # [B*W, Mw] every merged row of a window
        self.zeros = zeros  # [B*W, T] int64 base of the scatters
        self.offsets = offsets  # [B*W, 1] first merged row of every window
        self.zeros_m = zeros_m  # [B*W*Mw, 1] float32 base of the group counts
        self.ones_n = ones_n  # [B*W*T, 1] float32 the ones they count
        # feature order: the window-local slot of every dst, the item of every place of an item's window layout, every
        # place's number, the first window row of every item, and T
        self.dst_slots = dst_slots  # [B*W, Nd_w]
        self.items = items  # [B, W*T]
        self.slots = slots  # [B, W*T]
        self.window_of_item = window_of_item  # [B, W*T]
        self.size = size  # 0-d int64


def _local_tables(batch: int, win: Layout, m_w: int, like: paddle.Tensor) -> LocalTables:
    """Per-batch tables of a local plan: cached per batch size in eager mode, built from the runtime shape of
    ``like`` (``[B*W, ...]``) while tracing a dynamic batch."""
    return batch_tables("local", batch, like, _build_local_tables, win.count, win.size, win.num_src, m_w,
                        per_item=win.count)


def _build_local_tables(batch: Any, count: int, size: int, num_src: int, m_w: int) -> LocalTables:
    rows = batch * count
    return LocalTables(
        repeat=[batch, 1],
        rows=paddle.tile(paddle.arange(m_w, dtype="int64").unsqueeze(0), [rows, 1]),
        zeros=paddle.zeros([rows, size], dtype="int64"),
        offsets=(paddle.arange(rows, dtype="int64") * m_w).unsqueeze(-1),
        zeros_m=paddle.zeros([rows * m_w, 1], dtype="float32"),
        ones_n=paddle.ones([rows * size, 1], dtype="float32"),
        dst_slots=paddle.tile(paddle.arange(num_src, size, dtype="int64").unsqueeze(0), [rows, 1]),
        items=paddle.tile(paddle.arange(batch, dtype="int64").unsqueeze(-1), [1, count * size]),
        slots=paddle.tile(paddle.arange(count * size, dtype="int64").unsqueeze(0), [batch, 1]),
        window_of_item=paddle.tile((paddle.arange(batch, dtype="int64") * count).unsqueeze(-1), [1, count * size]),
        size=paddle.full([], size, dtype="int64"),
    )

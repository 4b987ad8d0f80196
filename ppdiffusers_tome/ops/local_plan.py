"""Plans from local matching: each src merges only into a dst of its own window.

Every window merges the same number ``r_w`` of its src (its most similar ones), so shapes are static. Merged rows
come window by window: the kept src of window 0, its dst, then window 1, ... Three kinds, one interface
(:class:`~ppdiffusers_tome.ops.global_plan.MergePlan`'s), chosen by :meth:`LocalMergePlan.from_matching`:

* :class:`LocalMergePlan` (CPU kernels): the assignment as row tables, applied by ``index_add`` and a gather (on a
  CPU a dense product over the window costs more than the scatter it replaces);
* :class:`DenseLocalPlan` (GPU kernels, grid windows): two per-window matrices, so merge and unmerge are one gather
  (the window layout) and one batched matmul each: few kernel launches, a fixed summation order (bit-identical run
  to run, no atomics), memory ``B * N * window**2`` in all;
* :class:`DenseFeaturePlan` (GPU kernels, feature windows): the same matrices, each window's tokens gathered per
  item with one ``gather_nd`` on each side.

Non-finite tokens: with the dense form a NaN or inf token makes its whole window non-finite (``0 * inf``), not just
its group; attention would spread it further anyway. In feature order, tokens that are zero or not finite sort as
if orthogonal to the rest, and a non-finite one can make every key 0 (then the windows are the partition's src and
dst in position order).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import paddle
import paddle.nn.functional as F

from .cache import CACHE
from .feature_order import DEFAULT_SQUARINGS, match_feature_windows
from .global_plan import MergePlan
from .runtime import device_kind, dtype_name, tracing
from .windows import Windows, match_windows, windows

__all__ = ["DenseFeaturePlan", "DenseLocalPlan", "LocalMergePlan"]

ORDERS = ("grid", "feature")


class LocalMergePlan(MergePlan):
    """A merge plan whose matching stays inside windows (build one with :meth:`from_matching`); this class is the
    CPU kernels' form, row tables applied as by :class:`~ppdiffusers_tome.ops.global_plan.MergePlan`. The
    similarity is a batched ``[B*W, Ns_w, Nd_w]`` product: it grows as ``N * window**2`` (``window`` tokens per side)
    instead of ``N**2``."""

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: str = "cpu"):
        MergePlan.__init__(self, num_tokens, batch_size, r, kind)
        self.windows: Optional[Windows] = None
        self.window_r = 0
        self.order = "grid"

    @classmethod
    def from_matching(  # type: ignore[override]
        cls, metric: paddle.Tensor, windows_spec: Tuple[int, int, int, int, int, int], partition: paddle.Tensor,
        window_r: int, kind: Optional[str] = None, order: str = "grid", squarings: int = DEFAULT_SQUARINGS,
    ) -> "LocalMergePlan":
        """Match within windows and plan the merge of ``window_r`` src per window.

        Args:
            metric: ``[B, N, C]`` tokens on an ``h x w`` grid.
            windows_spec: ``(h, w, wy, wx, sx, sy)``: the grid, its window sides (see
                :func:`~ppdiffusers_tome.ops.windows.window_sides`) and strides.
            partition: ``[W, T]`` window-local partition (one row of
                :func:`~ppdiffusers_tome.ops.windows.window_partition_table`).
            window_r: src merged per window, ``0 < window_r <= Ns_w``.
            kind: ``"cpu"`` or ``"gpu"`` kernels; default from ``metric``'s place.
            order: ``"grid"`` (windows are tiles of the grid) or ``"feature"`` (see
                :mod:`ppdiffusers_tome.ops.feature_order`).
            squarings: feature order's power iterations are ``2**squarings``.

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
        kind = kind or device_kind(metric)
        win = windows(*(int(v) for v in windows_spec))
        batch = int(metric.shape[0])
        plan_type = LocalMergePlan
        if kind == "gpu":
            plan_type = DenseFeaturePlan if order == "feature" else DenseLocalPlan
        plan = plan_type(int(metric.shape[1]), batch, win.count * int(window_r), kind)
        plan.windows, plan.window_r, plan.num_src, plan.order = win, int(window_r), win.count * win.num_src, order
        with paddle.no_grad():
            layout = None
            if order == "feature":
                best, best_dst, layout = match_feature_windows(metric.detach(), win, partition, kind, squarings)
                partition = win.tensors()["identity"]  # each window's tokens are laid out src first, then dst
            else:
                best, best_dst = match_windows(metric.detach(), win, partition, kind)
            spare = 1 if kind == "gpu" and batch == 1 and win.count == 1 else 0  # (a one-row GPU sort syncs)
            ranked = paddle.argsort(F.pad(best, [0, spare, 0, 0]), axis=-1, descending=True, stable=True)
            ranked = ranked[:-1] if spare else ranked
            plan._build_local(ranked, best_dst, partition, batch, layout)
        return plan

    def _build_local(self, order: paddle.Tensor, best_dst: paddle.Tensor, partition: paddle.Tensor, batch: int,
                     layout: Optional[paddle.Tensor]) -> None:
        """The merged row (within its window) of every token: kept src first, then the dst, each merged src on
        its dst's row; then the tables of this plan's kind. ``layout`` (feature order only): ``[B, W, T]`` grid
        positions of each window's tokens."""
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
        self._build_tables(row_of, b, layout)

    def _build_tables(self, row_of: paddle.Tensor, b: Dict[str, Any], layout: Optional[paddle.Tensor]) -> None:
        """Row tables over the ``B*N`` input rows (see :class:`MergePlan`)."""
        win = self.windows
        flat = (row_of + b["offsets"]).reshape([-1, win.count * win.size])  # [B, W*T], window-major tokens
        if layout is None:
            unmerge_rows = paddle.gather(flat, win.tensors()["inverse"], axis=1).reshape([-1])  # grid order
        else:  # every position of an item appears once in its layout: no conflicts
            positions = layout.reshape([-1, self.num_tokens])
            unmerge_rows = paddle.put_along_axis(b["zeros"].reshape([-1, self.num_tokens]), positions, flat,
                                                 axis=1).reshape([-1])
        self.unmerge_rows = unmerge_rows
        self.counts = paddle.index_add(b["zeros_m"], unmerge_rows, 0, b["ones_n"])
        self.row_scale = paddle.gather(paddle.reciprocal(self.counts), unmerge_rows)

    def __repr__(self) -> str:
        win = self.windows
        shape = f", windows={win.count}x{win.wy}x{win.wx}" if win is not None else ""
        shape += ", order='feature'" if self.order == "feature" else ""
        return (f"{type(self).__name__}(batch_size={self.batch_size}, num_tokens={self.num_tokens}, r={self.r}"
                f"{shape}, kind={self.kind!r})")


class DenseLocalPlan(LocalMergePlan):
    """The GPU kernels' local plan: ``unmerge_matrix`` ``[B*W, T, Mw]`` (a one-hot of the merged row of every token)
    and ``merge_matrix`` ``[B*W, Mw, T]`` (its transpose, each row divided by its group size); merge and unmerge are
    one layout gather and one batched matmul each, plus two free reshapes."""

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: str = "gpu"):
        LocalMergePlan.__init__(self, num_tokens, batch_size, r, kind)
        self.matrices: Dict[str, paddle.Tensor] = {}  # "<name>:<dtype>" -> matrix

    def _build_tables(self, row_of: paddle.Tensor, b: Dict[str, Any], layout: Optional[paddle.Tensor]) -> None:
        onehot = F.one_hot(row_of, self.windows.size - self.window_r)  # [B*W, T, Mw] float32 of exact 0/1
        counts = paddle.sum(onehot, axis=1, keepdim=True)  # [B*W, 1, Mw]: group sizes, exact integers
        self.matrices = {"unmerge:float32": onehot, "merge:float32": (onehot / counts).transpose([0, 2, 1])}

    def _matrix(self, name: str, dtype: str) -> paddle.Tensor:
        """One of the dense matrices in ``dtype`` (built in float32, cast once per dtype and kept)."""
        key = f"{name}:{dtype}"
        if key not in self.matrices:
            self.matrices[key] = self.matrices[f"{name}:float32"].astype(dtype)
        return self.matrices[key]

    def _window_tokens(self, x: paddle.Tensor) -> paddle.Tensor:
        """``[B, N, C]`` tokens as ``[B*W, T, C]``, window by window."""
        win = self.windows
        return paddle.gather(x, win.tensors()["flat_order"], axis=1).reshape([-1, win.size, x.shape[-1]])

    def _grid_tokens(self, out: paddle.Tensor) -> paddle.Tensor:
        """``[B*W, T, C]`` window tokens back in grid order, ``[B, N, C]``."""
        grid_order = out.reshape([-1, self.num_tokens, out.shape[-1]])
        return paddle.gather(grid_order, self.windows.tensors()["inverse"], axis=1)

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        if mode != "mean":
            raise ValueError(f"a dense local plan only averages (mode='mean'); got {mode!r}")
        self.check(x, self.num_tokens, "merge")
        if self.is_identity:
            return x
        out = paddle.matmul(self._matrix("merge", dtype_name(x.dtype)), self._window_tokens(x))  # [B*W, Mw, C]
        return out.reshape([-1, self.merged_tokens, x.shape[-1]])

    def unmerge(self, y: paddle.Tensor) -> paddle.Tensor:
        self.check(y, self.merged_tokens, "unmerge")
        if self.is_identity:
            return y
        rows = y.reshape([-1, self.windows.size - self.window_r, y.shape[-1]])
        return self._grid_tokens(paddle.matmul(self._matrix("unmerge", dtype_name(y.dtype)), rows))  # [B*W, T, C]


class DenseFeaturePlan(DenseLocalPlan):
    """:class:`DenseLocalPlan` over windows in feature order: ``window_index`` ``[B*W, T, 2]`` (the ``(item,
    position)`` of each window's tokens) and ``grid_index`` ``[B, N, 2]`` (the ``(window row, slot)`` of each item's
    tokens in grid order) are the two ``gather_nd`` indices of the layout."""

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: str = "gpu"):
        DenseLocalPlan.__init__(self, num_tokens, batch_size, r, kind)
        self.window_index: Optional[paddle.Tensor] = None
        self.grid_index: Optional[paddle.Tensor] = None

    def _build_tables(self, row_of: paddle.Tensor, b: Dict[str, Any], layout: Optional[paddle.Tensor]) -> None:
        DenseLocalPlan._build_tables(self, row_of, b, layout)  # (not super(): SOT cannot follow it)
        win, n = self.windows, self.num_tokens
        items = b["items"]  # [B, W, T]: the item of every window slot
        self.window_index = paddle.stack([items, layout], axis=-1).reshape([-1, win.size, 2])
        slots = paddle.put_along_axis(b["zeros"].reshape([-1, n]), layout.reshape([-1, n]), b["slots"], axis=1)
        window_rows = items.reshape([-1, n]) * win.count + paddle.floor_divide(slots, b["size"])
        self.grid_index = paddle.stack([window_rows, paddle.remainder(slots, b["size"])], axis=-1)  # [B, N, 2]

    def _window_tokens(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.gather_nd(x, self.window_index)  # [B*W, T, C]

    def _grid_tokens(self, out: paddle.Tensor) -> paddle.Tensor:
        return paddle.gather_nd(out, self.grid_index)  # [B, N, C]


def _local_tables(batch: int, win: Windows, m_w: int, like: paddle.Tensor) -> Dict[str, Any]:
    """Per-batch tables of a local plan: cached per batch size in eager mode, built from the runtime shape of
    ``like`` (``[B*W, ...]``) while tracing a dynamic batch."""
    if batch < 0:
        return _build_local_tables(paddle.shape(like)[0] // win.count, win.count, win.size, m_w)
    return CACHE.get(("local", batch, win.count, win.size, m_w), _build_local_tables, batch, win.count, win.size, m_w)


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

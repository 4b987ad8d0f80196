"""Bipartite soft matching over the whole grid (ToMe SD), and the plan that merges and unmerges with it.

Steps of :func:`bipartite_soft_matching_random2d`: draw the partition (one dst per ``sy x sx`` cell), find every
src's most similar dst, sort the src by that similarity, merge the ``r`` most similar into their dst. The result is a
:class:`MergePlan`, which unpacks as ``merge, unmerge`` like tomesd's pair of closures.

Layout of a merged item (``N`` tokens in partition order: ``Ns`` src then ``Nd`` dst; ``r`` merged)::

    merged row:   0 ........ Ns-r-1 | Ns-r ........ Ns-r+Nd-1
    holds:        unmerged src       | dst (each the mean of itself and the src merged into it)

The merge is one ``index_add`` of the weighted rows. On a CPU it adds in order; on a GPU it adds floats with
atomics (the last bits may change run to run), unless the plan is a :class:`GroupMergePlan` (``deterministic=True``
on GPU kernels), which sums each group as the difference of two float64 running sums instead.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import paddle
import paddle.nn.functional as F

from .cache import Tables, batch_tables
from .partition import GeneratorLike, cell_count, generator_seed, layout, partition_table
from .runtime import KERNELS, argsort_rows, compute_dtype, device_kind, dtype_name
from .similarity import best_dst

__all__ = ["GroupMergePlan", "MergePlan", "bipartite_soft_matching_random2d"]

MERGE_MODES = ("mean", "sum")


class MergePlan:
    """How to merge ``[B, N, C]`` tokens to ``[B, N - r, C]`` and back; build one with :meth:`from_matching`.

    Every plan kind of the package has this interface: ``merge(x, mode)``, ``unmerge(y)``, and the attributes
    ``r`` (tokens removed per item), ``num_tokens`` (N), ``merged_tokens`` (N - r), ``batch_size`` (B, ``-1``
    while tracing a dynamic batch), ``is_identity`` (``r == 0``: both are identities), ``kernels`` (the
    :class:`~ppdiffusers_tome.ops.runtime.Kernels` it was built for) and ``kind`` (that family's name). It unpacks
    as ``merge, unmerge = plan``. A plan is complete once constructed: nothing assigns its fields afterwards.

    This class applies a plan with two row tables over the ``B*N`` input rows: ``unmerge_rows`` (the merged row
    each input row ends in) and ``row_scale`` (``1/(1+k)`` for a row of a group of ``1+k``). A plan from global
    matching also has ``src_pos``/``dst_pos`` (the partition) and ``merged_pos``/``merged_into`` (``[B, r]``: the
    grid position of each merged src and of the dst it joined).

    >>> import paddle
    >>> from ppdiffusers_tome.ops.partition import partition_table, step_key
    >>> x = paddle.randn([2, 16, 8])
    >>> plan = MergePlan.from_matching(x, partition_table(4, 4, 2, 2, step_key(5), 0, 1)[0], num_src=12, r=6)
    >>> plan.merged_tokens, list(plan.unmerge(plan.merge(x)).shape)
    (10, [2, 16, 8])
    """

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: Any = "cpu", deterministic: bool = False,
                 partition: Optional[paddle.Tensor] = None, num_src: int = 0, order: Optional[paddle.Tensor] = None,
                 best_dst_slot: Optional[paddle.Tensor] = None):
        """A plan is complete once made: with ``order`` (the sorted src slots, ``[B, N]``: see :meth:`from_matching`)
        and ``best_dst_slot`` its tables are built here; without, it is an identity of ``num_tokens`` tokens."""
        self.num_tokens = int(num_tokens)
        self.batch_size = int(batch_size)
        self.r = max(int(r), 0)
        self.kernels = KERNELS[kind]  # the kernel family (a Kernels, or its name)
        self.kind = self.kernels.name
        self.deterministic = bool(deterministic)
        # plain attributes: every block call reads them
        self.is_identity = self.r <= 0
        self.merged_tokens = self.num_tokens - self.r
        self.num_src = int(num_src)
        self.partition = partition  # [N] grid positions in partition order
        self.merged_idx: Optional[paddle.Tensor] = None  # [B, r] partition slot of each merged src
        self.merged_dst: Optional[paddle.Tensor] = None  # [B, r] dst slot it joined
        self.unmerge_rows: Optional[paddle.Tensor] = None  # [B*N] merged row of every input row
        self.keep_rows: Optional[paddle.Tensor] = None  # [B*M] input row each merged row starts from (kept src, dst)
        self.merge_rows: Optional[paddle.Tensor] = None  # [B*r] input rows of the merged src
        self.merge_targets: Optional[paddle.Tensor] = None  # [B*r] the merged row (its dst's) each one is added to
        self.counts: Optional[paddle.Tensor] = None  # [B*M, 1] float32 group sizes 1 + k
        self.row_scale: Optional[paddle.Tensor] = None  # [B*N, 1] float32 1 / (1 + k) of every input row
        if order is not None:
            self._build(order, best_dst_slot)

    @classmethod
    def from_matching(
        cls, metric: paddle.Tensor, partition: paddle.Tensor, num_src: int, r: int, kind: Any = None,
        deterministic: bool = False,
    ) -> "MergePlan":
        """Match the src of ``partition`` (``[N]`` grid positions: ``num_src`` src, then the dst) to their most
        similar dst by cosine similarity of ``metric`` (``[B, N, C]``) and plan the merge of the ``r`` src with the
        highest similarity into their dst (``0 < r <= num_src``). ``kind`` (a kernel family or its name) defaults
        to ``metric``'s place. ``deterministic=True`` on GPU kernels gives a :class:`GroupMergePlan` (no float
        atomics); the CPU kernels are deterministic either way."""
        family = KERNELS[kind or device_kind(metric)]
        plan_type = GroupMergePlan if family.atomic_adds and deterministic else MergePlan
        num_tokens, batch = int(metric.shape[1]), int(metric.shape[0])
        with paddle.no_grad():
            best, best_dst_slot = best_dst(metric.detach(), partition, int(num_src), family)
            # dst rank last (-inf), so one stable sort yields [merged src | kept src | dst]
            order = argsort_rows(best, family, descending=True, append=num_tokens - num_src, fill=-float("inf"))
            return plan_type(num_tokens, batch, r, family, deterministic, partition, num_src, order, best_dst_slot)

    def _build(self, order: paddle.Tensor, best_dst_slot: paddle.Tensor) -> None:
        """Turn the sorted src slots into the row tables (see the class docstring); part of the construction."""
        n, r, kept = self.num_tokens, self.r, self.num_src - self.r
        m = n - r
        self.merged_idx = order[:, :r]
        self.merged_dst = paddle.take_along_axis(best_dst_slot, self.merged_idx, axis=1, broadcast=False)
        b = batch_tables("batch", self.batch_size, order, _build_batch_tables, n, m, kept)
        # input rows in sorted order per item: [merged src | kept src | dst]; the merged rows are [kept src | dst], so
        # a merge starts from the rows after the first r and adds the first r onto their dst's merged row
        sorted_rows = paddle.take_along_axis(self.partition + b.off_n, order, axis=1, broadcast=False)
        merged, keep = paddle.split(sorted_rows, [r, m], axis=1)
        targets = self.merged_dst + b.off_dst
        self.keep_rows, self.merge_rows, self.merge_targets = keep.reshape([-1]), merged.reshape([-1]), targets.reshape([-1])
        # the merged row of every input row, for the unmerge: its dst's row for a merged src, rows 0 .. M-1 of the
        # item for the rest; every input row is written exactly once, so the scatter has no conflicts (its own base,
        # not the index: a static program may write the output in place)
        rows = sorted_rows.reshape([-1])
        ends = paddle.concat([targets, b.rows_m], axis=1).reshape([-1])
        self.unmerge_rows = paddle.scatter(b.zeros_n, rows, ends)
        # group sizes 1 + k, counted with exact float adds of 1 (order-free, so deterministic on any device)
        self.counts = paddle.index_add(b.zeros_m, self.unmerge_rows, 0, b.ones_n)
        self.row_scale = paddle.gather(paddle.reciprocal(self.counts), self.unmerge_rows)  # exact below 2**24
        self._build_groups(rows)

    def _build_groups(self, rows: paddle.Tensor) -> None:
        """Extra tables of a subclass's merge from ``rows`` (``[B*N]``: the input rows in sorted order); none here."""

    # description ------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Callable]:
        return iter((self.merge, self.unmerge))

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(batch_size={self.batch_size}, num_tokens={self.num_tokens}, r={self.r}, "
                f"kind={self.kind!r})")

    @property
    def src_pos(self) -> Optional[paddle.Tensor]:
        """``[Ns]`` grid positions of the src tokens (None for an identity plan)."""
        return None if self.partition is None else self.partition[: self.num_src]

    @property
    def dst_pos(self) -> Optional[paddle.Tensor]:
        """``[Nd]`` grid positions of the dst tokens (None for an identity plan)."""
        return None if self.partition is None else self.partition[self.num_src :]

    @property
    def merged_pos(self) -> Optional[paddle.Tensor]:
        """``[B, r]`` grid position of every merged src (None for an identity plan)."""
        if self.merged_idx is None:
            return None
        return paddle.take_along_axis(self.partition.unsqueeze(0), self.merged_idx, axis=1)

    @property
    def merged_into(self) -> Optional[paddle.Tensor]:
        """``[B, r]`` grid position of the dst each merged src joined (None for an identity plan)."""
        if self.merged_dst is None:
            return None
        return paddle.take_along_axis(self.dst_pos.unsqueeze(0), self.merged_dst, axis=1)

    # application ------------------------------------------------------------------------------------------------
    def check(self, x: paddle.Tensor, tokens: int, what: str) -> None:
        """Raise ``ValueError`` unless ``x`` is ``[batch_size, tokens, C]``. While tracing, a dimension that the
        graph does not know (``-1``) is accepted: an attention processor that cuts its output out of a longer
        sequence (SD3's joint attention: ``joint[:, :image_tokens]`` after a ``reshape([B, -1, C])``) leaves the
        token count unknown to the static graph, although it is ``tokens`` at run time."""
        batch = x.shape[0] if x.ndim == 3 else None
        same_batch = batch == self.batch_size or self.batch_size < 0 or (batch is not None and batch < 0)
        count = x.shape[1] if x.ndim == 3 else None
        same_tokens = count == tokens or (count is not None and count < 0)
        if x.ndim != 3 or not same_batch or not same_tokens:
            raise ValueError(
                f"{what} expects a [batch={self.batch_size}, tokens={tokens}, channels] tensor, got shape {list(x.shape)}"
            )

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        """Merge ``x`` of shape ``[B, N, C]`` into ``[B, N - r, C]``.

        ``mode="mean"`` averages each dst with the src merged into it (the ToMe SD rule); ``"sum"`` adds them.
        Arithmetic runs in :func:`~ppdiffusers_tome.ops.runtime.compute_dtype`; the result has ``x``'s dtype. The
        mean is formed as ``dst/(1+k) + sum(src/(1+k))``, a convex combination, so it is finite wherever the inputs
        are. The merged rows start as the weighted kept src and dst (one gather) and the weighted merged src are
        added onto their dst's row (one ``index_add``: in order on a CPU, with float atomics on a GPU, where the last
        bits of a sum may differ run to run; see :class:`GroupMergePlan`). No buffer is zeroed or kept for it.
        """
        if self._checked_merge(x, mode):
            return x
        channels, work = x.shape[-1], compute_dtype(x.dtype)
        flat = self._weighted_rows(x, mode, work)
        # (the gathered base is this method's own buffer: added to in place, the result always rebound, as a static
        # program needs)
        out = paddle.gather(flat, self.keep_rows).index_add_(self.merge_targets, 0, paddle.gather(flat, self.merge_rows))
        return out.astype(x.dtype).reshape([-1, self.merged_tokens, channels])

    def _checked_merge(self, x: paddle.Tensor, mode: str) -> bool:
        """Check a merge's arguments; True when the plan merges nothing (the merge is ``x`` itself)."""
        if mode not in MERGE_MODES:
            raise ValueError(f"mode must be one of {MERGE_MODES}, got {mode!r}")
        self.check(x, self.num_tokens, "merge")
        return self.is_identity

    def _weighted_rows(self, x: paddle.Tensor, mode: str, work: str) -> paddle.Tensor:
        """``x`` as ``[B*N, C]`` rows in the working dtype ``work``, each weighted by ``1/(1+k)`` for a mean."""
        flat = x.reshape([-1, x.shape[-1]])
        if dtype_name(x.dtype) != work:
            flat = flat.astype(work)
        if mode == "mean":
            flat = flat * self._row_scale(work)
        return flat

    def _row_scale(self, work: str) -> paddle.Tensor:
        """``1/(1+k)`` for every input row, in ``work`` (float64 tokens get float64 weights, not float32 ones)."""
        if work == "float32":
            return self.row_scale
        return paddle.gather(paddle.reciprocal(self.counts.astype(work)), self.unmerge_rows)

    def unmerge(self, y: paddle.Tensor) -> paddle.Tensor:
        """Map ``y`` of shape ``[B, N - r, C]`` back to ``[B, N, C]``: every token gets the row it was merged into
        (its own row when it was not merged). One gather; the result has ``y``'s dtype."""
        self.check(y, self.merged_tokens, "unmerge")
        if self.is_identity:
            return y
        channels = y.shape[-1]
        flat = y.reshape([-1, channels])
        work = dtype_name(y.dtype) if self.kernels.half_math else compute_dtype(y.dtype)
        if dtype_name(y.dtype) != work:  # Paddle's CPU build has no half-precision gather; the round trip is exact
            flat = flat.astype(work)
        out = paddle.gather(flat, self.unmerge_rows)
        return out.astype(y.dtype).reshape([-1, self.num_tokens, channels])

    def run_sublayer(self, sublayer: Any, x: paddle.Tensor, args: tuple, kwargs: dict) -> Any:
        """Run ``sublayer`` (a sub-layer hook: ``sublayer.next`` runs the layer, with ``x`` as ``args[0]`` or the
        keyword ``hidden_states``) on ``x`` merged, and unmerge its output (the first item of a tuple output), so
        the block around it sees ``[B, N, C]`` tensors: what tomesd does around ``attn1``, ``attn2`` and ``ff``."""
        merged = self.merge(x)
        if args:
            output = sublayer.next(merged, *args[1:], **kwargs)
        else:
            output = sublayer.next(*args, **dict(kwargs, hidden_states=merged))
        if isinstance(output, (tuple, list)):
            return type(output)([self.unmerge(output[0]), *output[1:]])
        return self.unmerge(output)


class GroupMergePlan(MergePlan):
    """A global plan whose merge has no float atomics (``deterministic=True`` on GPU kernels): bit-identical run to
    run. Each group's sum is the difference of two float64 running sums over the group-ordered sequence (a scan and
    gathers, a fixed order, a ``[B, Nd + r, C]`` float64 buffer; float64 keeps the difference of two long running
    sums exact to well below float32 rounding). The unmerge is :class:`MergePlan`'s."""

    def __init__(self, num_tokens: int, batch_size: int, r: int = 0, kind: Any = "gpu", deterministic: bool = True,
                 partition: Optional[paddle.Tensor] = None, num_src: int = 0, order: Optional[paddle.Tensor] = None,
                 best_dst_slot: Optional[paddle.Tensor] = None):
        # (declared before MergePlan.__init__, which builds them through _build_groups)
        self.group_rows: Optional[paddle.Tensor] = None  # dst and merged src of every item, ordered by group
        self.group_ends: Optional[paddle.Tensor] = None  # flat position of every group's last member in it
        self.kept_rows: Optional[paddle.Tensor] = None  # input rows of the kept src
        self.group_sizes: Optional[paddle.Tensor] = None  # [B, Nd, 1] float64 1 + k
        MergePlan.__init__(self, num_tokens, batch_size, r, kind, deterministic, partition, num_src, order,
                           best_dst_slot)

    def _build_groups(self, rows: paddle.Tensor) -> None:
        """The group tables from ``rows`` (``[B*N]``: the input rows in sorted order, ``[merged src | kept src |
        dst]`` per item): every item's dst and merged src as one sequence ordered by group (each dst, then the src
        merged into it, in slot order)."""
        n, r, num_src = self.num_tokens, self.r, self.num_src
        num_dst, length = n - num_src, n - num_src + r
        rows = rows.reshape([-1, n])
        merged, kept, dst = paddle.split(rows, [r, num_src - r, num_dst], axis=1)
        g = _group_batch_tables(self.batch_size, num_dst, length, rows)
        # group key: dst d is 2d, a src merged into d is 2d + 1; a stable sort keeps the src of a group in slot order
        keys = paddle.concat([g.dst_keys, paddle.scale(self.merged_dst, 2.0, 1.0)], axis=1)
        order = argsort_rows(keys, self.kernels)
        sequence = paddle.take_along_axis(paddle.concat([dst, merged], axis=1), order, axis=1, broadcast=False)
        sizes = self.counts.reshape([-1, n - r])[:, num_src - r:]  # [B, Nd] float32 1 + k, exact integers
        ends = paddle.cumsum(sizes, axis=1).astype("int64") + g.last  # flat row of each group's last member
        self.group_rows, self.group_ends = sequence.reshape([-1]), ends.reshape([-1])
        self.kept_rows, self.group_sizes = kept.reshape([-1]), sizes.astype("float64").unsqueeze(-1)

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        if self._checked_merge(x, mode):
            return x
        channels = x.shape[-1]
        num_dst, kept = self.num_tokens - self.num_src, self.num_src - self.r
        flat = x.reshape([-1, channels])
        sequence = paddle.gather(flat, self.group_rows).astype("float64").reshape([-1, num_dst + self.r, channels])
        running = paddle.cumsum(sequence, axis=1).reshape([-1, channels])
        del sequence
        totals = paddle.gather(running, self.group_ends).reshape([-1, num_dst, channels])  # through each group's end
        del running
        sums = totals - F.pad(totals[:, :-1], [0, 0, 1, 0, 0, 0])  # minus the total through the previous group
        out = sums / self.group_sizes if mode == "mean" else sums
        out = out.astype(x.dtype)
        if kept == 0:
            return out
        return paddle.concat([paddle.gather(flat, self.kept_rows).reshape([-1, kept, channels]), out], axis=1)


# per-batch tables ----------------------------------------------------------------------------------------------------
class BatchTables(Tables):
    """Row tables a global plan of ``B`` items needs (see :func:`~ppdiffusers_tome.ops.cache.batch_tables`)."""

    __slots__ = ("off_n", "off_dst", "rows_m", "zeros_n", "zeros_m", "ones_n")

    def __init__(self, off_n: paddle.Tensor, off_dst: paddle.Tensor, rows_m: paddle.Tensor, zeros_n: paddle.Tensor,
                 zeros_m: paddle.Tensor, ones_n: paddle.Tensor) -> None:
        self.off_n = off_n  # [B, 1] first row of each item in the input
        self.off_dst = off_dst  # [B, 1] row of each item's first dst in the merged output
        self.rows_m = rows_m  # [B, M] every merged row
        self.zeros_n = zeros_n  # [B*N] int64 base of the unmerge scatter
        self.zeros_m = zeros_m  # [B*M, 1] float32 base of the group counts
        self.ones_n = ones_n  # [B*N, 1] float32 the ones they count


def _build_batch_tables(count: Any, num_tokens: int, merged_tokens: int, kept: int) -> BatchTables:
    items = paddle.arange(count, dtype="int64").unsqueeze(-1)
    return BatchTables(
        off_n=items * num_tokens,
        off_dst=items * merged_tokens + kept,
        rows_m=paddle.arange(merged_tokens, dtype="int64").unsqueeze(0) + items * merged_tokens,
        zeros_n=paddle.zeros([count * num_tokens], dtype="int64"),
        zeros_m=paddle.zeros([count * merged_tokens, 1], dtype="float32"),
        ones_n=paddle.ones([count * num_tokens, 1], dtype="float32"),
    )


class GroupTables(Tables):
    """Per-batch tables of the group merge (:class:`GroupMergePlan`)."""

    __slots__ = ("dst_keys", "last")

    def __init__(self, dst_keys: paddle.Tensor, last: paddle.Tensor) -> None:
        self.dst_keys = dst_keys  # [B, Nd] 2d: the sort key of dst d
        self.last = last  # [B, 1] b * length - 1: turns an item's group end count into a flat row


def _group_batch_tables(batch: int, num_dst: int, length: int, like: paddle.Tensor) -> GroupTables:
    return batch_tables("groups", batch, like, _build_group_tables, num_dst, length)


def _build_group_tables(count: Any, num_dst: int, length: int) -> GroupTables:
    keys = paddle.arange(num_dst, dtype="int64").unsqueeze(0) * 2
    return GroupTables(dst_keys=paddle.tile(keys, [count, 1]),
                       last=paddle.arange(count, dtype="int64").unsqueeze(-1) * length - 1)


def bipartite_soft_matching_random2d(
    metric: paddle.Tensor,
    w: int,
    h: int,
    sx: int,
    sy: int,
    r: int,
    no_rand: bool = False,
    generator: GeneratorLike = None,
    partition: Optional[paddle.Tensor] = None,
    kind: Any = None,
    deterministic: bool = False,
) -> MergePlan:
    """Plan the merge of ``r`` src tokens into their most similar dst tokens (ToMe SD, Bolya & Hoffman 2023).

    Args:
        metric: ``[B, N, C]`` tokens whose cosine similarity decides the matching (``N == h * w``). Any float
            dtype; similarity is computed scale-free, in float32 on CPU kernels and in the tokens' own dtype on GPU
            kernels; tokens that are all zero or not finite count as zero vectors (similarity 0), never NaN.
        w, h: the token grid, row-major.
        sx, sy: stride of the dst grid: one dst per ``sy x sx`` cell. A cell larger than the grid means no dst,
            and an identity plan at no cost.
        r: src tokens to merge per batch item; capped at the number of src tokens; ``r <= 0`` gives identities.
        no_rand: take the top-left token of each cell as dst instead of a random one.
        generator: int seed or numpy Generator that keys the random dst choice (Paddle's global RNG is never used);
            ``None`` draws fresh OS entropy. The partition is shared by the whole batch.
        partition: a precomputed ``[N]`` row of :func:`~ppdiffusers_tome.ops.partition.partition_table`
            (overrides ``no_rand``/``generator``); this is how the model glue passes partitions drawn on the device.
        kind: the kernel family, a :class:`~ppdiffusers_tome.ops.runtime.Kernels` or its name (``"cpu"``,
            ``"gpu"``); default from ``metric``'s place.
        deterministic: on GPU kernels, merge without float atomics (:class:`GroupMergePlan`).

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
    batch, num_tokens = int(metric.shape[0]), int(metric.shape[1])
    if h * w != num_tokens:
        raise ValueError(f"h * w must equal the token count: {h} * {w} != {num_tokens}")
    if sx < 1 or sy < 1:
        raise ValueError(f"sx and sy must be >= 1, got sx={sx}, sy={sy}")
    num_dst = cell_count(h, w, sx, sy)
    r = min(int(r), num_tokens - num_dst)
    if num_dst == 0 or r <= 0:
        return MergePlan(num_tokens, batch)
    if partition is None:
        if no_rand:
            partition = layout(int(h), int(w), int(sx), int(sy)).tensors().top_left
        else:
            step = paddle.full([], 0, dtype="int64")
            partition = partition_table(h, w, sx, sy, step, generator_seed(generator), 1)[0]
    return MergePlan.from_matching(metric, partition, num_tokens - num_dst, r, kind, deterministic)

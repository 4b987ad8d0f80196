"""Local matching with a dense plan (ppdiffusers_tome/merge.py, issue #17): window shapes, the per-window random
partition, the plan against a float64 numpy reference on both kernels, and what the dense GPU form costs."""

import collections

import numpy as np
import paddle
import pytest

import ppdiffusers_tome.merge as merge_module
from ppdiffusers_tome.ops import feature_order
from ppdiffusers_tome.tools.measure import count_ops
from ppdiffusers_tome.merge import LocalMergePlan, step_key, window_partition_table, window_sides
from tests.half_on_cpu import half_kernels
from tests.numpy_reference import (
    reference_feature_levels,
    reference_local,
    reference_local_feature,
    reference_windows,
    sort_rows,
)

F32_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "side, window, stride, expected",
    [(64, 16, 2, 16), (96, 16, 2, 16), (72, 16, 2, 18), (65, 16, 2, 13), (67, 16, 2, 67), (32, 16, 2, 16),
     (8, 16, 2, 8), (12, 5, 3, 6), (9, 2, 2, 3)],
)
def test_window_sides_tile_the_grid_with_the_divisor_nearest_the_request(side, window, stride, expected):
    wy, wx = window_sides(side, side, window, stride, stride)
    assert wy == wx == expected and side % wy == 0 and wy >= stride


def test_window_partition_has_one_dst_per_cell_of_every_window_and_differs_by_window_block_and_step():
    h, w, wy, wx = 12, 16, 6, 8  # 4 windows of 6 x 8: 12 cells each
    table = window_partition_table(h, w, wy, wx, 2, 2, step_key(999), seed=0, blocks=3).numpy()
    assert table.shape == (3, 4, 48)
    for block in table:
        for row in block:
            assert sorted(row.tolist()) == list(range(48))
            dst = np.sort(row[-12:])
            cell = (dst // wx // 2) * (wx // 2) + (dst % wx) // 2
            assert sorted(cell.tolist()) == list(range(12))  # one dst per cell
            assert list(row[:-12]) == sorted(row[:-12])  # src in position order
    assert len({tuple(row) for row in table[0]}) > 1  # windows draw their own dst
    assert not np.array_equal(table[0], table[1])  # so do blocks
    other = window_partition_table(h, w, wy, wx, 2, 2, step_key(500), seed=0, blocks=3).numpy()
    assert not np.array_equal(table, other)
    top_left = window_partition_table(h, w, wy, wx, 2, 2, None, seed=0, blocks=1).numpy()[0, 0]
    assert sorted(top_left[-12:].tolist()) == [ty * wx + tx for ty in range(0, 6, 2) for tx in range(0, 8, 2)]


def test_window_partition_slots_are_uniform():
    counts = np.zeros(4)
    for t in range(0, 1000, 50):
        table = window_partition_table(16, 16, 8, 8, 2, 2, step_key(t), seed=1, blocks=2).numpy()
        dst = table[..., -16:].reshape(-1)
        counts += np.bincount((dst // 8 % 2) * 2 + dst % 2, minlength=4)
    expected = counts.sum() / 4
    assert ((counts - expected) ** 2 / expected).sum() < 16.3  # chi-square, 3 dof, p = 0.001


def tie_free_local(seed, batch, h, w, wy, wx, channels, partition, num_src, r_w, reference=reference_local, shift=0.0):
    """Tokens ``x`` and a metric whose decisions under ``reference`` (the last of its results is the smallest
    deciding margin) are all clear of float32 rounding; ``shift`` moves the metric's mean off zero."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, h * w, 5)).astype(np.float32)
    for _ in range(50):
        metric = (rng.standard_normal((batch, h * w, channels)) + shift).astype(np.float32)
        margin = reference(metric, x, h, w, wy, wx, partition, num_src, r_w)[-1]
        if margin > 2e-6:
            return metric, x
    raise AssertionError("could not draw a tie-free metric")


CASES = [
    # batch, h, w, window, r_w, random
    (2, 8, 8, 4, 6, True),
    (1, 12, 16, 8, 20, True),
    (2, 13, 10, 4, 9, False),  # 13 is prime: one window per column of height 13, odd sides leave src-only rows
    (3, 6, 9, 3, 2, True),
    (2, 16, 16, 16, 96, True),  # one window: the global plan written densely
    (2, 16, 16, 4, 5, True),  # 16 windows: feature order cuts along four keys (2 x 2 x 2 x 2)
    (1, 24, 24, 4, 5, False),  # 36 windows: 2 x 2 x 3 x 3
]


def case_partition(h, w, window, random):
    """The window sides, partition table (as a tensor and its first row in numpy) and src per window of a case."""
    wy, wx = window_sides(h, w, window)
    table = window_partition_table(h, w, wy, wx, 2, 2, step_key(321) if random else None, seed=3, blocks=1)
    return wy, wx, table, table[0].numpy(), wy * wx - (wy // 2) * (wx // 2)


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
@pytest.mark.parametrize("batch,h,w,window,r_w,random", CASES)
def test_local_plan_matches_the_numpy_reference(kind, batch, h, w, window, r_w, random):
    wy, wx, table, partition, num_src = case_partition(h, w, window, random)
    metric, x = tie_free_local(1, batch, h, w, wy, wx, 12, partition, num_src, r_w)
    merged_ref, round_trip_ref, _ = reference_local(metric, x, h, w, wy, wx, partition, num_src, r_w)
    plan = LocalMergePlan.from_matching(paddle.to_tensor(metric), (h, w, wy, wx, 2, 2), table[0], r_w, kind=kind)
    windows = len(reference_windows(h, w, wy, wx))
    assert plan.r == windows * r_w and plan.merged_tokens == h * w - windows * r_w
    merged = plan.merge(paddle.to_tensor(x))
    np.testing.assert_allclose(merged.numpy(), merged_ref, **F32_TOL)
    np.testing.assert_allclose(plan.unmerge(merged).numpy(), round_trip_ref, **F32_TOL)


def test_dense_gpu_form_is_bit_identical_run_to_run_and_equals_the_cpu_form(monkeypatch):
    x = paddle.randn([2, 256, 16])
    table = window_partition_table(16, 16, 8, 8, 2, 2, step_key(7), seed=0, blocks=1)
    gpu = LocalMergePlan.from_matching(x, (16, 16, 8, 8, 2, 2), table[0], 24, kind="gpu")
    cpu = LocalMergePlan.from_matching(x, (16, 16, 8, 8, 2, 2), table[0], 24, kind="cpu")
    first = gpu.unmerge(gpu.merge(x)).numpy()
    np.testing.assert_array_equal(first, gpu.unmerge(gpu.merge(x)).numpy())
    np.testing.assert_allclose(first, cpu.unmerge(cpu.merge(x)).numpy(), **F32_TOL)


def test_dense_merge_and_unmerge_take_at_most_eight_eager_ops():
    # issue #17 item 2: one layout change and one batched matmul on each side
    x = paddle.randn([2, 1024, 64])
    table = window_partition_table(32, 32, 16, 16, 2, 2, step_key(7), seed=0, blocks=1)
    plan = LocalMergePlan.from_matching(x, (32, 32, 16, 16, 2, 2), table[0], 128, kind="gpu")
    plan.unmerge(plan.merge(x))  # the matrices in x's dtype are made once
    counted = count_ops(lambda: plan.unmerge(plan.merge(x)))
    assert counted.total <= 8, counted.by_name
    assert counted.by_name.get("matmul") == 2 and counted.by_name.get("gather") == 2


@pytest.mark.parametrize("order", ["grid", "feature"])
@pytest.mark.parametrize("half, agreement", [("float16", 0.98), ("bfloat16", 0.9)])
def test_dense_plan_keeps_half_tokens_in_half_precision(half, agreement, order, monkeypatch):
    x = paddle.to_tensor(np.random.default_rng(4).standard_normal((2, 256, 32)).astype("float32"))
    x_half = x.astype(half)
    table = window_partition_table(16, 16, 8, 8, 2, 2, step_key(7), seed=0, blocks=1)
    operands = collections.Counter()
    with half_kernels(monkeypatch):
        wrapped = paddle.matmul
        small = 2 * 32 * 32  # B*C*C: feature order's second-moment matrix and its powers, kept in float32

        def record(a, b, **k):
            operands.update([(str(a.dtype), str(b.dtype), max(a.size, b.size) <= small)])
            return wrapped(a, b, **k)
        monkeypatch.setattr(paddle, "matmul", record)
        plan = LocalMergePlan.from_matching(x_half, (16, 16, 8, 8, 2, 2), table[0], 24, kind="gpu", order=order)
        merged = plan.merge(x_half)
        out = plan.unmerge(merged)
    # every product over the tokens on half operands: similarity, merge and unmerge; feature order adds the mean
    # token, the second moment and the keys. Its [B, C, C] moment is projected (3 products), squared
    # _MOMENT_SQUARINGS times and applied to the start axis in float32 (high powers of values below 1 underflow
    # float16)
    tokens = {(f"paddle.{half}", f"paddle.{half}", False): 6 if order == "feature" else 3}
    small_products = 4 + feature_order.DEFAULT_SQUARINGS
    assert dict(operands) == ({**tokens, ("paddle.float32", "paddle.float32", True): small_products}
                              if order == "feature" else tokens)
    assert merged.dtype == x_half.dtype and out.dtype == x_half.dtype
    reference = LocalMergePlan.from_matching(x_half.astype("float32"), (16, 16, 8, 8, 2, 2), table[0], 24, kind="gpu",
                                             order=order)
    expected = reference.unmerge(reference.merge(x_half.astype("float32"))).numpy()
    tol = 3e-2 if half == "bfloat16" else 4e-3
    # equal (to half rounding) wherever the half-precision matching decided as float32 did: nearly everywhere (the
    # sort of feature order adds decisions that half precision can flip: 0.95-1.0 measured in float16)
    if order == "feature":
        agreement -= 0.05 if half == "float16" else 0.0
    assert np.isclose(out.astype("float32").numpy(), expected, rtol=tol, atol=tol).mean() > agreement


@pytest.mark.parametrize("order", ["grid", "feature"])
@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_local_matching_needs_a_small_fraction_of_global_temporaries(kind, order, monkeypatch, kernels):
    # issue #17: similarity work and temporaries at [2, 16384, 320] at least 10x below global matching's. Both plans
    # hold one copy of the tokens (40 MiB here: global as unit rows, local in window order); beyond it, global holds
    # the [B, Ns, Nd] similarity (384 MiB) and local a [B*W, Ns_w, Nd_w] one (6 MiB)
    kernels(kind)
    batch, tokens, channels = 2, 16384, 320
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((batch, tokens, channels)).astype("float32"))
    core = paddle.base.core

    def peak_of(run):
        run()
        before = core.host_memory_stat_current_value("Allocated", 0)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        kept = run()  # noqa: F841 - the plan stays alive while the peak is read
        return core.host_memory_stat_peak_value("Allocated", 0) - before

    table = window_partition_table(128, 128, 16, 16, 2, 2, step_key(3), seed=0, blocks=1)
    local_plan = lambda: LocalMergePlan.from_matching(x, (128, 128, 16, 16, 2, 2), table[0], 128, order=order)  # noqa: E731
    global_plan = lambda: merge_module.bipartite_soft_matching_random2d(x, 128, 128, 2, 2, 8192, generator=0)  # noqa: E731
    local_peak, global_peak = peak_of(local_plan), peak_of(global_plan)
    token_copy = batch * tokens * channels * 4
    assert global_peak >= batch * 12288 * 4096 * 4  # the global similarity was there
    assert 10 * (local_peak - token_copy) <= global_peak - token_copy, (local_peak / 2**20, global_peak / 2**20)
    assert 10 * (batch * 64 * 192 * 64) <= batch * 12288 * 4096  # similarity entries: the matching work (64x)
    plan = local_plan()
    applied = peak_of(lambda: plan.unmerge(plan.merge(x)))
    assert applied <= 3 * token_copy  # merge + unmerge: their outputs and the window-ordered input


# match_order="feature": windows cut along the tokens' features ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["cpu", "gpu"])
@pytest.mark.parametrize("batch,h,w,window,r_w,random", CASES)
def test_feature_order_plan_matches_the_numpy_reference(kind, batch, h, w, window, r_w, random):
    wy, wx, table, partition, num_src = case_partition(h, w, window, random)
    metric, x = tie_free_local(2, batch, h, w, wy, wx, 12, partition, num_src, r_w, reference_local_feature,
                               shift=0.5)  # a mean to sort along
    round_trip_ref, _ = reference_local_feature(metric, x, h, w, wy, wx, partition, num_src, r_w)
    plan = LocalMergePlan.from_matching(paddle.to_tensor(metric), (h, w, wy, wx, 2, 2), table[0], r_w, kind=kind,
                                        order="feature")
    windows = len(reference_windows(h, w, wy, wx))
    assert plan.r == windows * r_w and plan.order == "feature" and "order='feature'" in repr(plan)
    merged = plan.merge(paddle.to_tensor(x))
    assert merged.shape == [batch, h * w - windows * r_w, 5]
    np.testing.assert_allclose(plan.unmerge(merged).numpy(), round_trip_ref, **F32_TOL)
    # the merged rows are exactly the distinct rows of the round trip (kept src and group means)
    distinct = np.stack([np.unique(item.round(5), axis=0) for item in round_trip_ref])
    np.testing.assert_allclose(sort_rows(merged.numpy().round(5)), distinct, atol=2e-5)


def test_feature_levels_are_the_window_counts_prime_factors_in_at_most_four_levels():
    for windows in range(1, 300):
        levels = merge_module.feature_levels(windows)
        assert levels == reference_feature_levels(windows) and levels == sorted(levels)
        assert int(np.prod(levels)) == windows and len(levels) <= merge_module.MAX_FEATURE_LEVELS


def test_principal_axes_recover_planted_directions_off_the_mean():
    # unit-ish tokens around a mean direction, spread along three planted orthogonal directions with well separated
    # strengths: the axes must be those directions, strongest first, orthonormal and orthogonal to the mean
    rng = np.random.default_rng(2)
    channels, tokens = 24, 3000
    basis = np.linalg.qr(rng.standard_normal((channels, 4)))[0].T  # mean direction, then three planted ones
    spread = rng.standard_normal((2, tokens, 3)) * np.array([1.2, 0.7, 0.35])
    metric = 2.0 * basis[0] + spread @ basis[1:] + 0.02 * rng.standard_normal((2, tokens, channels))
    x = paddle.to_tensor(metric.astype(np.float32))
    rnorm = paddle.to_tensor((1.0 / np.linalg.norm(metric, axis=-1, keepdims=True)).astype(np.float32))
    unit = metric / np.linalg.norm(metric, axis=-1, keepdims=True)
    along = unit.mean(axis=1, keepdims=True)
    along /= np.linalg.norm(along, axis=-1, keepdims=True)
    axes = feature_order.principal_axes(x, rnorm, paddle.to_tensor(along.astype(np.float32)), 3).numpy()
    assert axes.shape == (2, 3, channels)
    for b in range(2):
        np.testing.assert_allclose(axes[b] @ axes[b].T, np.eye(3), atol=1e-5)
        assert np.abs(axes[b] @ along[b, 0]).max() < 1e-4
        # float64 reference: the eigenvectors of the second moment of the unit tokens projected off the mean
        project = np.eye(channels) - np.outer(along[b, 0], along[b, 0])
        vectors = np.linalg.eigh(project @ (unit[b].T @ unit[b]) @ project)[1][:, ::-1][:, :3].T
        assert (np.abs((axes[b] * vectors).sum(axis=1)) > 0.999).all()


@pytest.mark.parametrize("channels, tokens", [(320, 4096), (1280, 16384)])
def test_principal_axes_survive_a_flat_spectrum_at_wide_channels(channels, tokens):
    # isotropic tokens: the top eigenvalue of the moment is a small fraction of its Frobenius norm (about C**-0.5),
    # and its 16th power times an unscaled start vector would be a vector whose squared entries fall below float32's
    # normal range at 1280 channels (the axes came out about 1.1 long); the axes must also capture nearly the top
    # eigenvalues, which are close together here
    rng = np.random.default_rng(7)
    metric = rng.standard_normal((1, tokens, channels)).astype(np.float32)
    unit = metric / np.linalg.norm(metric, axis=-1, keepdims=True)
    along = unit.mean(axis=1, keepdims=True)
    along /= np.linalg.norm(along, axis=-1, keepdims=True)
    rnorm = 1.0 / np.linalg.norm(metric, axis=-1, keepdims=True)
    axes = feature_order.principal_axes(*(paddle.to_tensor(a) for a in (metric, rnorm, along)), 3).numpy()[0]
    np.testing.assert_allclose(axes @ axes.T, np.eye(3), atol=1e-4)
    project = np.eye(channels) - along[0].T.astype(np.float64) @ along[0]
    moment = project @ (unit[0].T.astype(np.float64) @ unit[0]) @ project
    top = np.linalg.eigvalsh(moment)[::-1][:3]
    captured = np.einsum("ac,cd,ad->a", axes, moment, axes)
    assert (captured > 0.9 * top).all(), (captured / top)


def test_feature_plan_operator_count_stays_within_budget():
    # a plan in feature order pays one sort per level and a small eigen-problem per axis: measured 117 ops with two
    # levels (4 windows) and 171 with four (16 windows), against 40 for a grid plan
    merge_module.clear_cache()
    for side, budget in ((32, 125), (64, 175)):
        x = paddle.randn([2, side * side, 32])
        table = window_partition_table(side, side, 16, 16, 2, 2, step_key(3), seed=0, blocks=1)
        plan = lambda: LocalMergePlan.from_matching(x, (side, side, 16, 16, 2, 2), table[0], 64, kind="gpu",  # noqa: E731
                                                    order="feature")
        plan()  # tables and constants are built on the first call
        assert count_ops(plan).total <= budget, (side, count_ops(plan).by_name)


def test_feature_order_puts_tokens_of_one_direction_in_one_window_wherever_they_are():
    # direction 1 on one 4 x 4 patch in each corner, direction 0 elsewhere: every grid window holds both, while
    # each feature window holds one direction, gathered from several grid windows; groups never mix the two
    h = w = 16
    rng = np.random.default_rng(5)
    py, px = np.arange(h)[:, None] // 4, np.arange(w)[None, :] // 4
    patch = (np.isin(py, (0, 3)) & np.isin(px, (0, 3))).astype(int).reshape(-1)  # [h*w] 0/1
    directions = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    metric = directions[patch][None] + 0.01 * rng.standard_normal((1, h * w, 3))
    metric = paddle.to_tensor(metric.astype(np.float32))
    table = window_partition_table(h, w, 8, 8, 2, 2, step_key(11), seed=0, blocks=1)
    grid_window = (np.arange(h * w) // w // 8) * 2 + (np.arange(h * w) % w) // 8
    plan = LocalMergePlan.from_matching(metric, (h, w, 8, 8, 2, 2), table[0], 40, kind="gpu", order="feature")
    positions = plan.window_index.numpy()[..., 1]  # [W, T] grid positions of each window's tokens
    for tokens in positions:
        assert len(set(patch[tokens])) == 1 and len(set(grid_window[tokens])) > 1
    assert all(len(set(patch[reference])) == 2 for reference in reference_windows(h, w, 8, 8))
    for kind in ("cpu", "gpu"):
        plan = LocalMergePlan.from_matching(metric, (h, w, 8, 8, 2, 2), table[0], 40, kind=kind, order="feature")
        side = np.abs(plan.unmerge(plan.merge(metric)).numpy()[0] @ directions.T)
        # each token's round trip stays on its own direction: a mixed group would pull it towards the other one
        assert (side.argmax(axis=1) == patch).all() and side.min(axis=1).max() < 0.06  # noise only


@pytest.mark.parametrize("order", ["grid", "feature"])
def test_dense_merge_and_unmerge_take_at_most_eight_eager_ops_in_either_order(order):
    x = paddle.randn([2, 1024, 64])
    table = window_partition_table(32, 32, 16, 16, 2, 2, step_key(7), seed=0, blocks=1)
    plan = LocalMergePlan.from_matching(x, (32, 32, 16, 16, 2, 2), table[0], 128, kind="gpu", order=order)
    plan.unmerge(plan.merge(x))
    counted = count_ops(lambda: plan.unmerge(plan.merge(x)))
    assert counted.total <= 8 and counted.by_name.get("matmul") == 2, counted.by_name
    gathers = counted.by_name.get("gather_nd" if order == "feature" else "gather")
    assert gathers == 2, counted.by_name


def test_feature_order_dense_form_is_bit_identical_run_to_run_and_equals_the_cpu_form():
    x = paddle.randn([3, 256, 16])
    table = window_partition_table(16, 16, 8, 8, 2, 2, step_key(7), seed=0, blocks=1)
    gpu = LocalMergePlan.from_matching(x, (16, 16, 8, 8, 2, 2), table[0], 24, kind="gpu", order="feature")
    cpu = LocalMergePlan.from_matching(x, (16, 16, 8, 8, 2, 2), table[0], 24, kind="cpu", order="feature")
    first = gpu.unmerge(gpu.merge(x)).numpy()
    np.testing.assert_array_equal(first, gpu.unmerge(gpu.merge(x)).numpy())
    np.testing.assert_allclose(first, cpu.unmerge(cpu.merge(x)).numpy(), **F32_TOL)


def test_feature_order_survives_zero_and_non_finite_tokens():
    x = paddle.randn([2, 256, 8])
    x[0, 3] = 0.0
    x[1, 7] = float("nan")
    table = window_partition_table(16, 16, 8, 8, 2, 2, step_key(7), seed=0, blocks=1)
    for kind in ("cpu", "gpu"):
        plan = LocalMergePlan.from_matching(x, (16, 16, 8, 8, 2, 2), table[0], 24, kind=kind, order="feature")
        out = plan.unmerge(plan.merge(x)).numpy()
        assert np.isfinite(out[0]).all()  # a zero token is just another token
        assert out.shape == (2, 256, 8)


def test_order_must_be_grid_or_feature():
    x = paddle.randn([1, 64, 4])
    table = window_partition_table(8, 8, 4, 4, 2, 2, None, seed=0, blocks=1)
    with pytest.raises(ValueError, match="order must be 'grid' or 'feature'"):
        LocalMergePlan.from_matching(x, (8, 8, 4, 4, 2, 2), table[0], 4, order="space")

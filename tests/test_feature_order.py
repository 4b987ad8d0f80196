"""Feature order (match_order="feature"): windows cut along the tokens' features like the cells of a k-d tree,\nagainst a numpy reference; its levels, principal axes, operator budget and robustness."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome.merge as merge_module
from ppdiffusers_tome.merge import LocalMergePlan, step_key, window_partition_table
from ppdiffusers_tome.ops import feature_order
from ppdiffusers_tome.tools.measure import count_ops
from tests.cases import LOCAL_CASES, case_partition, tie_free_local
from tests.numpy_reference import (
    reference_feature_levels,
    reference_local_feature,
    reference_windows,
    sort_rows,
)

F32_TOL = dict(rtol=1e-5, atol=1e-5)


# match_order="feature": windows cut along the tokens' features ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["cpu", "gpu"])
@pytest.mark.parametrize("batch,h,w,window,r_w,random", LOCAL_CASES)
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

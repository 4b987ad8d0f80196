"""Feature order (match_order="feature"): windows cut along the tokens' features (one step of spherical k-means from
tiles of the grid, clusters ordered along the mean token), against a numpy reference; its operator budget, what it
gathers into one window, and robustness."""

import numpy as np
import paddle
import pytest

from ppdiffusers_tome.ops import LocalMergePlan, feature_partition_table, step_key, window_partition_table
from ppdiffusers_tome.tools.measure import count_ops
from tests.cases import LOCAL_CASES, case_partition, tie_free_local
from tests.numpy_reference import (
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


@pytest.mark.parametrize("batch", [1, 2])
def test_a_feature_plan_costs_at_most_60_ops_at_16_windows_and_4_more_for_one_image(batch):
    # a grid plan is 35 ops; feature order adds the clusters (two small products, an argmax, two tiny sorts), one
    # sort of the tokens and the two gather_nd tables of its layout; with one image the two cluster sorts each sort a
    # spare row along (a pad and a slice each: a GPU sort of a single row synchronises with the host)
    x = paddle.randn([batch, 64 * 64, 32])
    tables = {"grid": window_partition_table(64, 64, 16, 16, 2, 2, step_key(3), seed=0, blocks=1),
              "feature": feature_partition_table(64, 64, 16, 16, 2, 2, step_key(3), seed=0, blocks=1)}
    for order, budget in (("grid", 36), ("feature", 60 if batch > 1 else 64)):
        plan = lambda: LocalMergePlan.from_matching(x, (64, 64, 16, 16, 2, 2), tables[order][0], 128,  # noqa: E731
                                                    kind="gpu", order=order)
        assert plan().windows.count == 16  # (tables and constants are built on the first call)
        counted = count_ops(plan)
        assert counted.total <= budget, (order, counted.total, counted.by_name)


@pytest.mark.parametrize("use_rand", [True, False])
def test_the_feature_partition_table_lists_the_window_partitions_src_then_dst(use_rand):
    h, w, wy, wx = 12, 16, 4, 8
    step = step_key(77) if use_rand else None
    local = window_partition_table(h, w, wy, wx, 2, 2, step, seed=5, blocks=3).numpy()  # [rows, W, T]
    ranked = feature_partition_table(h, w, wy, wx, 2, 2, step, seed=5, blocks=3).numpy()  # [rows, N]
    windows = reference_windows(h, w, wy, wx)  # grid positions of each window's tokens, row-major
    num_src = wy * wx - (wy // 2) * (wx // 2)
    for row in range(3):
        src = [windows[k][i] for k in range(len(windows)) for i in local[row, k, :num_src]]
        dst = [windows[k][i] for k in range(len(windows)) for i in local[row, k, num_src:]]
        assert ranked[row].tolist() == src + dst
    x = paddle.to_tensor(np.random.default_rng(3).standard_normal((2, h * w, 6)).astype("float32"))
    for kind in ("cpu", "gpu"):  # either form of the partition plans the same merge
        plans = [LocalMergePlan.from_matching(x, (h, w, wy, wx, 2, 2), table, 5, kind=kind, order="feature")
                 for table in (paddle.to_tensor(local[1]), paddle.to_tensor(ranked[1]))]
        outs = [plan.unmerge(plan.merge(x)).numpy() for plan in plans]
        np.testing.assert_array_equal(outs[0], outs[1])
        assert not np.allclose(outs[0], x.numpy())


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

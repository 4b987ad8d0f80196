"""Global bipartite soft matching and its plan against a float64 numpy reference, on both kernel families (the GPU
family run on the CPU): matching, merge, unmerge, r, ties, dtypes, shapes, non-finite and extreme tokens, and the
GPU family's own promises (no single-row sort, half precision kept)."""

import math

import numpy as np
import paddle
import pytest

import ppdiffusers_tome.ops as merge_module
from ppdiffusers_tome.ops import (
    MergePlan,
    bipartite_soft_matching_random2d,
    compute_dtype,
    find_downsample,
    grid_partition,
)
from ppdiffusers_tome.ops.feature_order import feature_partition_table
from tests.cases import F32_TOL, GLOBAL_CASES, partition_of, tie_free_metric
from tests.numpy_reference import (
    reference_merge,
    reference_partition_top_left,
    reference_plan,
    reference_round_trip,
    sort_rows,
)


@pytest.mark.parametrize("batch,h,w,sx,sy,r,no_rand", GLOBAL_CASES)
def test_merge_and_round_trip_match_numpy_reference(batch, h, w, sx, sy, r, no_rand):
    src, dst = grid_partition(h, w, sx, sy, no_rand=no_rand, generator=7)
    metric = tie_free_metric(1, batch, h, w, 12, src, dst, r)
    x = np.random.default_rng(2).standard_normal((batch, h * w, 5)).astype(np.float32)

    plan = bipartite_soft_matching_random2d(paddle.to_tensor(metric), w, h, sx, sy, r, no_rand=no_rand, generator=7)
    got_src, got_dst = partition_of(plan)
    if no_rand:
        ref_src, ref_dst = reference_partition_top_left(h, w, sx, sy)
        np.testing.assert_array_equal(got_src, ref_src)
        np.testing.assert_array_equal(got_dst, ref_dst)
    ref = reference_plan(metric, got_src, got_dst, r)

    merge, unmerge = plan
    merged = merge(paddle.to_tensor(x)).numpy()
    assert merged.shape == (batch, h * w - ref.r, 5)
    np.testing.assert_allclose(sort_rows(merged), sort_rows(reference_merge(x, ref)), **F32_TOL)
    round_trip = unmerge(merge(paddle.to_tensor(x))).numpy()
    np.testing.assert_allclose(round_trip, reference_round_trip(x, ref), **F32_TOL)


def test_r_is_capped_at_the_number_of_src_tokens():
    h, w = 6, 6
    metric = paddle.to_tensor(np.random.default_rng(0).standard_normal((2, 36, 8)).astype(np.float32))
    plan = bipartite_soft_matching_random2d(metric, w, h, 2, 2, r=1000, no_rand=True)
    assert plan.r == 27  # 36 tokens, 9 dst
    merge, unmerge = plan
    assert merge(metric).shape == [2, 9, 8]
    assert unmerge(merge(metric)).shape == [2, 36, 8]


@pytest.mark.parametrize("r", [0, -3])
def test_non_positive_r_gives_identities(r):
    x = paddle.randn([2, 16, 4])
    plan = bipartite_soft_matching_random2d(x, 4, 4, 2, 2, r)
    merge, unmerge = plan
    assert plan.is_identity and plan.r == 0
    assert merge(x) is x and unmerge(x) is x


def test_grid_without_any_full_cell_is_identity():
    x = paddle.randn([1, 7, 4])  # a 1 x 7 grid has no 2 x 2 cell, so no dst
    merge, unmerge = bipartite_soft_matching_random2d(x, 7, 1, 2, 2, 3)
    assert merge(x) is x and unmerge(x) is x


def test_all_zero_tokens_give_finite_outputs():
    metric = np.random.default_rng(0).standard_normal((2, 64, 8)).astype(np.float32)
    metric[0, ::3] = 0.0
    metric[1] = 0.0
    x = np.random.default_rng(1).standard_normal((2, 64, 8)).astype(np.float32)
    merge, unmerge = bipartite_soft_matching_random2d(paddle.to_tensor(metric), 8, 8, 2, 2, 40, generator=0)
    out = unmerge(merge(paddle.to_tensor(x))).numpy()
    assert np.isfinite(out).all()
    assert np.isfinite(merge(paddle.to_tensor(metric)).numpy()).all()


def test_ties_are_handled_sanely():
    # every token points the same way: all similarities tie; the plan must still merge r tokens, each into a
    # dst, and averaging identical tokens must give them back (to float32 rounding: the mean is dst/(1+k) + ...)
    direction = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    scales = np.random.default_rng(1).uniform(0.5, 2.0, size=(2, 64, 1)).astype(np.float32)
    metric = paddle.to_tensor(scales * direction)
    plan = bipartite_soft_matching_random2d(metric, 8, 8, 2, 2, 40, generator=0)
    merge, unmerge = plan
    assert merge(metric).shape == [2, 24, 8]
    dst = set(plan.dst_pos.numpy().tolist())
    assert set(plan.merged_into.numpy().reshape(-1).tolist()) <= dst
    assert len(set(plan.merged_pos.numpy()[0].tolist())) == 40 and not set(plan.merged_pos.numpy()[0].tolist()) & dst
    same = paddle.to_tensor(np.tile(direction, (2, 64, 1)))
    np.testing.assert_allclose(unmerge(merge(same)).numpy(), same.numpy(), rtol=42 * 2.0**-23, atol=0)  # k+1 roundings


def test_each_merged_token_joins_its_most_similar_dst():
    metric = np.random.default_rng(4).standard_normal((2, 100, 6)).astype(np.float32)
    plan = bipartite_soft_matching_random2d(paddle.to_tensor(metric), 10, 10, 2, 2, 50, generator=1)
    unit = metric / np.linalg.norm(metric, axis=-1, keepdims=True)
    dst = plan.dst_pos.numpy()
    for b in range(2):
        for pos, into in zip(plan.merged_pos.numpy()[b], plan.merged_into.numpy()[b]):
            sims = unit[b, dst] @ unit[b, pos]
            assert unit[b, into] @ unit[b, pos] >= sims.max() - 1e-5


def test_batch_items_are_planned_independently():
    metric = paddle.randn([3, 64, 8])
    x = paddle.randn([3, 64, 5])
    full = bipartite_soft_matching_random2d(metric, 8, 8, 2, 2, 30, generator=9)
    alone = bipartite_soft_matching_random2d(metric[1:2], 8, 8, 2, 2, 30, generator=9)
    np.testing.assert_allclose(
        full.unmerge(full.merge(x)).numpy()[1], alone.unmerge(alone.merge(x[1:2])).numpy()[0], **F32_TOL
    )


def test_identical_tokens_merge_to_themselves_within_two_ulp():
    x = paddle.to_tensor(np.full((2, 64, 8), 0.3, dtype=np.float32))
    metric = paddle.randn([2, 64, 8])
    merge, unmerge = bipartite_soft_matching_random2d(metric, 8, 8, 2, 2, 48, generator=0)
    np.testing.assert_allclose(merge(x).numpy(), np.full((2, 16, 8), 0.3, dtype=np.float32), rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(unmerge(merge(x)).numpy(), x.numpy(), rtol=2.5e-7, atol=0)


def test_sum_mode_adds_instead_of_averaging():
    metric = paddle.randn([1, 16, 4])
    x = paddle.to_tensor(np.random.default_rng(0).uniform(1, 2, (1, 16, 3)).astype(np.float32))
    merge, _ = bipartite_soft_matching_random2d(metric, 4, 4, 2, 2, 8, no_rand=True)
    assert math.isclose(float(merge(x, mode="sum").numpy().sum()), float(x.numpy().sum()), rel_tol=1e-5)
    with pytest.raises(ValueError, match="mode"):
        merge(x, mode="max")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_inputs_keep_their_dtype_and_match_float32(dtype):
    metric = paddle.randn([2, 64, 8])
    x = paddle.randn([2, 64, 8])
    x_half = x.astype(dtype)
    plan_half = bipartite_soft_matching_random2d(metric.astype(dtype), 8, 8, 2, 2, 32, generator=2)
    plan_ref = bipartite_soft_matching_random2d(metric.astype(dtype).astype("float32"), 8, 8, 2, 2, 32, generator=2)
    merged = plan_half.merge(x_half)
    assert merged.dtype == x_half.dtype
    assert plan_half.unmerge(merged).dtype == x_half.dtype
    expected = plan_ref.unmerge(plan_ref.merge(x_half.astype("float32"))).numpy()
    tol = 1e-2 if dtype == "bfloat16" else 1e-3
    np.testing.assert_allclose(plan_half.unmerge(merged).astype("float32").numpy(), expected, rtol=tol, atol=tol)


def test_compute_dtype_promotes_only_half_types():
    assert compute_dtype(paddle.float16) == "float32"
    assert compute_dtype(paddle.bfloat16) == "float32"
    assert compute_dtype(paddle.float32) == "float32"
    assert compute_dtype(paddle.float64) == "float64"


def test_float64_inputs_stay_float64():
    metric = paddle.randn([1, 16, 4], dtype="float64")
    merge, unmerge = bipartite_soft_matching_random2d(metric, 4, 4, 2, 2, 6, no_rand=True)
    assert merge(metric).dtype == paddle.float64 and unmerge(merge(metric)).dtype == paddle.float64


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_float64_merge_is_float64_accurate(kind):
    # float64 tokens get float64 weights 1/(1+k): float32 weights would make a float64 mean only float32-accurate
    src, dst = grid_partition(8, 8, 2, 2, no_rand=True)
    metric = tie_free_metric(5, 2, 8, 8, 12, src, dst, 40).astype(np.float64)
    x = np.random.default_rng(6).standard_normal((2, 64, 5))
    plan = bipartite_soft_matching_random2d(paddle.to_tensor(metric), 8, 8, 2, 2, 40, no_rand=True, kind=kind)
    ref = reference_plan(metric, src, dst, 40)
    assert any(np.bincount(t).max() >= 2 for t in ref.target)  # some dst take several src: weights like 1/3
    merged = plan.merge(paddle.to_tensor(x)).numpy()
    np.testing.assert_allclose(sort_rows(merged), sort_rows(reference_merge(x, ref)), rtol=1e-13, atol=1e-13)


def test_shape_errors_are_clear():
    x = paddle.randn([2, 16, 4])
    with pytest.raises(ValueError, match="h \\* w"):
        bipartite_soft_matching_random2d(x, 5, 4, 2, 2, 4)
    merge, unmerge = bipartite_soft_matching_random2d(x, 4, 4, 2, 2, 4)
    with pytest.raises(ValueError, match="merge expects"):
        merge(paddle.randn([2, 15, 4]))
    with pytest.raises(ValueError, match="unmerge expects"):
        unmerge(paddle.randn([2, 16, 4]))


def test_plan_unpacks_as_merge_unmerge_pair():
    plan = bipartite_soft_matching_random2d(paddle.randn([1, 16, 4]), 4, 4, 2, 2, 4)
    assert isinstance(plan, MergePlan) and len(plan) == 2
    merge, unmerge = plan
    assert merge == plan.merge and unmerge == plan.unmerge


@pytest.mark.parametrize("h,w", [(9, 11), (13, 7), (33, 45), (64, 96)])
def test_plans_at_every_level_of_odd_latents_match_reference(h, w):
    for d in (1, 2, 4, 8):
        gh, gw = math.ceil(h / d), math.ceil(w / d)
        n = gh * gw
        assert find_downsample(h, w, n) == d
        src, dst = grid_partition(gh, gw, 2, 2, no_rand=True)
        r = int(n * 0.5)
        if len(dst) == 0:  # e.g. a 2 x 1 grid: no full cell, nothing to merge into
            x = paddle.randn([2, n, 8])
            assert bipartite_soft_matching_random2d(x, gw, gh, 2, 2, r).merge(x) is x
            continue
        metric = tie_free_metric(d, 2, gh, gw, 8, src, dst, r)
        merge, unmerge = bipartite_soft_matching_random2d(paddle.to_tensor(metric), gw, gh, 2, 2, r, no_rand=True)
        ref = reference_plan(metric, src, dst, r)
        np.testing.assert_allclose(
            unmerge(merge(paddle.to_tensor(metric))).numpy(), reference_round_trip(metric, ref), **F32_TOL
        )


# the GPU kernel family run on CPU, keyed partition, scale-free matching --------------------------
@pytest.fixture
def gpu_kernels(monkeypatch, kernels):
    """Run the GPU branch's logic (matching in the tokens' dtype, padded sort, no unmerge cast) on the CPU."""
    kernels("gpu")


@pytest.mark.parametrize("batch,h,w,sx,sy,r,no_rand", GLOBAL_CASES)
def test_gpu_kernels_match_the_numpy_reference_and_the_cpu_kernels(gpu_kernels, batch, h, w, sx, sy, r, no_rand):
    src, dst = grid_partition(h, w, sx, sy, no_rand=no_rand, generator=7)
    metric = tie_free_metric(1, batch, h, w, 12, src, dst, r)
    x = paddle.to_tensor(np.random.default_rng(2).standard_normal((batch, h * w, 5)).astype(np.float32))
    gpu = bipartite_soft_matching_random2d(paddle.to_tensor(metric), w, h, sx, sy, r, no_rand=no_rand, generator=7)
    cpu = bipartite_soft_matching_random2d(paddle.to_tensor(metric), w, h, sx, sy, r, no_rand=no_rand, generator=7,
                                           kind="cpu")
    assert gpu.kind == "gpu" and cpu.kind == "cpu"
    ref = reference_plan(metric, *partition_of(gpu), r)
    np.testing.assert_allclose(gpu.unmerge(gpu.merge(x)).numpy(), reference_round_trip(x.numpy(), ref), **F32_TOL)
    np.testing.assert_allclose(gpu.merge(x).numpy(), cpu.merge(x).numpy(), **F32_TOL)
    np.testing.assert_array_equal(gpu.merge(x).numpy(), gpu.merge(x).numpy())  # fixed summation order


# "no synchronising sort" (docs/gpu.md cites this test): Paddle's GPU argsort of a
# single row takes a Thrust path that syncs with the host, so the GPU branch never sorts fewer than two rows
@pytest.mark.parametrize("plan_kind", ["global", "deterministic", "local", "feature"])
def test_gpu_kernels_never_sort_a_single_row(gpu_kernels, monkeypatch, plan_kind):
    rows = []
    original = paddle.argsort

    def argsort(x, axis=-1, *args, **kwargs):
        rows.append(int(np.prod(x.shape)) // x.shape[axis])  # the rows sorted side by side
        return original(x, axis, *args, **kwargs)

    monkeypatch.setattr(paddle, "argsort", argsort)
    metric = paddle.randn([1, 64, 8])  # batch 1: one image without guidance, or a batch-1 ControlNet in guess mode
    if plan_kind == "local":
        table = merge_module.window_partition_table(8, 8, 8, 8, 2, 2, merge_module.step_key(500), seed=0, blocks=1)  # one window: one row
        plan = merge_module.LocalMergePlan.from_matching(metric, (8, 8, 8, 8, 2, 2), table[0], 8)
    elif plan_kind == "feature":  # (it also ranks the clusters of the one image: two more sorts)
        table = feature_partition_table(8, 8, 8, 8, 2, 2, merge_module.step_key(500), seed=0, blocks=1)
        plan = merge_module.LocalMergePlan.from_matching(metric, (8, 8, 8, 8, 2, 2), table[0], 8, order="feature")
    else:
        plan = bipartite_soft_matching_random2d(metric, 8, 8, 2, 2, 32, generator=0,
                                                deterministic=plan_kind == "deterministic")
        plan.merge(paddle.randn([1, 64, 4]))
    assert plan.kind == "gpu" and rows and min(rows) >= 2, rows
    rows.clear()
    bipartite_soft_matching_random2d(metric, 8, 8, 2, 2, 32, generator=0, kind="cpu")
    assert 1 in rows  # the CPU branch sorts the one row of its matching (so the check above can fail)


def test_gpu_kernels_unmerge_half_dtypes_without_a_float32_round_trip(gpu_kernels, monkeypatch):
    # (the CPU build has a bfloat16 gather but no float16 one, so bfloat16 stands in for both half types)
    plan = bipartite_soft_matching_random2d(paddle.randn([2, 64, 8]), 8, 8, 2, 2, 32, generator=0)
    y = paddle.randn([2, 32, 8]).astype("bfloat16")
    casts = []
    original = paddle.Tensor.astype
    monkeypatch.setattr(paddle.Tensor, "astype", lambda self, dtype: casts.append(dtype) or original(self, dtype))
    out = plan.unmerge(y)
    assert plan.kind == "gpu" and out.dtype == y.dtype and "float32" not in casts
    cpu = bipartite_soft_matching_random2d(paddle.randn([2, 64, 8]), 8, 8, 2, 2, 32, generator=0, kind="cpu")
    cpu.unmerge_rows = plan.unmerge_rows  # the GPU plan's tables, applied by the CPU kernels
    np.testing.assert_array_equal(out.astype("float32").numpy(), cpu.unmerge(y).astype("float32").numpy())


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e19, 1e30])
def test_matching_is_scale_free(scale):
    src, dst = grid_partition(8, 8, 2, 2, no_rand=True)
    metric = tie_free_metric(3, 2, 8, 8, 16, src, dst, 30)
    base = bipartite_soft_matching_random2d(paddle.to_tensor(metric), 8, 8, 2, 2, 30, no_rand=True)
    scaled = bipartite_soft_matching_random2d(paddle.to_tensor(metric * np.float32(scale)), 8, 8, 2, 2, 30, no_rand=True)
    np.testing.assert_array_equal(scaled.merged_pos.numpy(), base.merged_pos.numpy())
    np.testing.assert_array_equal(scaled.merged_into.numpy(), base.merged_into.numpy())


def test_mean_of_huge_opposite_values_stays_finite():
    x = np.random.default_rng(0).uniform(-1, 1, (1, 64, 4)).astype(np.float32)
    x = np.sign(x).astype(np.float32) * np.float32(3e38)  # sums of two would overflow float32
    merge, unmerge = bipartite_soft_matching_random2d(paddle.randn([1, 64, 8]), 8, 8, 2, 2, 40, generator=0)
    out = unmerge(merge(paddle.to_tensor(x))).numpy()
    assert np.isfinite(out).all() and np.abs(out).max() <= 3e38 * (1 + 1e-6)


def test_non_finite_tokens_match_as_zero_vectors_and_never_poison_clean_ones():
    # every clean token shares a positive direction, so its best similarity is > 0, while a NaN/inf token counts as
    # a zero vector (similarity 0): it is neither merged nor chosen as the dst of a clean token
    rng = np.random.default_rng(1)
    metric = (rng.standard_normal((1, 64, 8)) * 0.1 + 1.0).astype(np.float32)
    src, dst = grid_partition(8, 8, 2, 2, no_rand=True)
    bad = [int(src[3]), int(src[10]), int(dst[5])]
    metric[0, bad[0]] = np.nan
    metric[0, bad[1], 2] = np.inf
    metric[0, bad[2]] = np.nan
    plan = bipartite_soft_matching_random2d(paddle.to_tensor(metric), 8, 8, 2, 2, 45, no_rand=True)
    merged, into = set(plan.merged_pos.numpy()[0].tolist()), set(plan.merged_into.numpy()[0].tolist())
    assert not merged & set(bad) and not into & set(bad)
    out = plan.unmerge(plan.merge(paddle.to_tensor(metric))).numpy()
    clean = [p for p in range(64) if p not in bad]
    assert np.isfinite(out[0, clean]).all()

"""The pure merge core (ppdiffusers_tome/merge.py) against the float64 numpy reference in numpy_reference.py."""

import math

import numpy as np
import paddle
import pytest

import ppdiffusers_tome.merge as merge_module
from ppdiffusers_tome.ops import cache as cache_module, partition as partition_module
from ppdiffusers_tome.merge import (
    DownsamplePlan,
    downsample_tokens,
    MergePlan,
    bipartite_soft_matching_random2d,
    compute_dtype,
    find_downsample,
    grid_partition,
    max_ratio,
)
from tests.numpy_reference import (
    reference_downsample,
    min_margin,
    reference_merge,
    reference_partition_top_left,
    reference_plan,
    reference_round_trip,
    sort_rows,
)

F32_TOL = dict(rtol=1e-5, atol=1e-5)


def tie_free_metric(seed, batch, h, w, channels, src, dst, r):
    """Random metric whose matching decisions are separated by more than float32 noise (redrawn otherwise)."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        metric = rng.standard_normal((batch, h * w, channels)).astype(np.float32)
        if min_margin(metric, src, dst, r) > 2e-6:  # float32 cosine error is ~1e-7
            return metric
    raise AssertionError("could not draw a tie-free metric")


def partition_of(plan):
    return plan.src_pos.numpy(), plan.dst_pos.numpy()


CASES = [
    # batch, h, w, sx, sy, r, no_rand
    (2, 8, 8, 2, 2, 32, True),
    (1, 9, 11, 2, 2, 40, True),
    (3, 7, 5, 2, 2, 10, False),
    (2, 6, 9, 3, 2, 25, False),
    (2, 16, 12, 2, 2, 96, False),
    (2, 5, 13, 1, 2, 20, True),
    (1, 4, 4, 2, 2, 1, False),
]


@pytest.mark.parametrize("batch,h,w,sx,sy,r,no_rand", CASES)
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


def test_random_partition_has_one_dst_per_cell_and_leftovers_are_src():
    h, w, sx, sy = 7, 9, 2, 3
    seen_slots = set()
    for seed in range(30):
        src, dst = grid_partition(h, w, sx, sy, no_rand=False, generator=seed)
        assert sorted(np.concatenate([src, dst]).tolist()) == list(range(h * w))
        rows, cols = dst // w, dst % w
        cells = list(zip((rows // sy).tolist(), (cols // sx).tolist()))
        assert len(set(cells)) == len(cells) == (h // sy) * (w // sx)
        assert rows.max() < (h // sy) * sy and cols.max() < (w // sx) * sx  # leftover rows/columns hold no dst
        seen_slots.update(zip((rows % sy).tolist(), (cols % sx).tolist()))
    assert seen_slots == {(dy, dx) for dy in range(sy) for dx in range(sx)}


def test_random_partition_is_reproducible_from_its_generator():
    a = grid_partition(8, 8, 2, 2, no_rand=False, generator=np.random.default_rng(5))
    b = grid_partition(8, 8, 2, 2, no_rand=False, generator=5)
    c = grid_partition(8, 8, 2, 2, no_rand=False, generator=6)
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


def test_random_plan_does_not_touch_paddles_global_rng():
    x = paddle.randn([2, 64, 8])
    paddle.seed(123)
    expected = paddle.randn([4]).numpy()
    paddle.seed(123)
    bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, no_rand=False)
    bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, no_rand=False, generator=3)
    np.testing.assert_array_equal(paddle.randn([4]).numpy(), expected)


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
    # issue #18 item 10: the weights 1/(1+k) were float32, so a float64 mean was only float32-accurate (7e-8)
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


def test_max_ratio():
    assert max_ratio(2, 2) == 0.75 and max_ratio(1, 1) == 0.0 and math.isclose(max_ratio(3, 2), 5 / 6)


def _tomesd_downsample(h, w, n):
    return int(math.ceil(math.sqrt(h * w // n)))


def test_find_downsample_is_right_for_every_sd_size_and_level():
    tomesd_wrong = 0
    for px_h in range(256, 1025, 8):
        for px_w in range(256, 1025, 8):
            h, w = px_h // 8, px_w // 8
            for d in (1, 2, 4, 8):
                n = math.ceil(h / d) * math.ceil(w / d)
                assert find_downsample(h, w, n) == d, (h, w, d)
                if d == 8 and _tomesd_downsample(h, w, n) != d:
                    tomesd_wrong += 1
    assert tomesd_wrong > 0  # the reason this function exists


def test_find_downsample_for_odd_latent_and_unknown_counts():
    assert find_downsample(9, 11, 4) == 8
    assert _tomesd_downsample(9, 11, 4) == 5  # tomesd picks a 2 x 3 grid for 4 tokens and crashes
    assert find_downsample(9, 11, 99) == 1
    assert find_downsample(9, 11, 30) == 2
    assert find_downsample(64, 64, 77) is None


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


# ToDo's key/value downsampling -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["nearest", "average"])
@pytest.mark.parametrize("h, w, factor", [(8, 8, 2), (16, 12, 4), (9, 11, 2), (7, 5, 3), (4, 4, 8)])
def test_downsample_tokens_matches_numpy_reference(mode, h, w, factor):
    x = np.random.default_rng(h * w + factor).standard_normal((2, h * w, 5)).astype("float32")
    got = downsample_tokens(paddle.to_tensor(x), h, w, factor, mode)
    expected = reference_downsample(x, h, w, factor, mode)
    assert list(got.shape) == list(expected.shape)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["nearest", "average"])
def test_downsample_tokens_keeps_half_dtypes(dtype, mode):
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((1, 36, 4)).astype("float32"))
    half = downsample_tokens(x.astype(dtype), 6, 6, 2, mode)
    full = downsample_tokens(x.astype(dtype).astype("float32"), 6, 6, 2, mode)
    assert half.dtype == x.astype(dtype).dtype
    tol = 1e-2 if dtype == "bfloat16" else 1e-3
    np.testing.assert_allclose(half.astype("float32").numpy(), full.numpy(), rtol=tol, atol=tol)


def test_downsample_plan_counts_its_keys_and_rejects_bad_input():
    plan = DownsamplePlan(num_tokens=99, batch_size=1, grid_h=9, grid_w=11, factor=2, mode="average")
    assert plan.kv_tokens == 5 * 6 and not plan.is_identity
    assert list(plan.keys_values(paddle.randn([1, 99, 3])).shape) == [1, 30, 3]
    with pytest.raises(ValueError, match="mode must be one of"):
        DownsamplePlan(4, 1, 2, 2, 2, mode="bilinear")
    with pytest.raises(ValueError, match=r"x must be \[batch, h\*w=16, channels\]"):
        downsample_tokens(paddle.randn([1, 15, 3]), 4, 4, 2)
    x = paddle.randn([1, 16, 3])
    assert downsample_tokens(x, 4, 4, 1) is x


# the device path (issue #10): GPU kernels run on CPU, keyed partition, scale-free matching --------------------------
@pytest.fixture
def gpu_kernels(monkeypatch, kernels):
    """Run the GPU branch's logic (matching in the tokens' dtype, padded sort, no unmerge cast) on the CPU."""
    kernels("gpu")


@pytest.mark.parametrize("batch,h,w,sx,sy,r,no_rand", CASES)
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


# issue #21 item 7: the README and merge.py cite this test for "no synchronising sort": Paddle's GPU argsort of a
# single row takes a Thrust path that syncs with the host, so the GPU branch never sorts fewer than two rows
@pytest.mark.parametrize("plan_kind", ["global", "deterministic", "local"])
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


def test_partition_table_draws_each_slot_uniformly_and_independently():
    # 4 slots per cell; 40 timesteps x 4 blocks x 256 cells = 40960 draws: chi-square with 3 dof, and the
    # transitions between neighbouring cells (15 dof) must look independent too
    slots, pairs = np.zeros(4), np.zeros((4, 4))
    for t in range(0, 1000, 25):
        table = merge_module.partition_table(32, 32, 2, 2, merge_module.step_key(paddle.to_tensor([t])), 0, 4).numpy()
        for row in table:
            dst = np.sort(row[-256:])
            cell = (dst // 32 // 2) * 16 + (dst % 32) // 2
            slot = (dst // 32 % 2) * 2 + dst % 2
            order = np.argsort(cell)
            assert np.array_equal(cell[order], np.arange(256))  # one dst per cell
            s = slot[order]
            slots += np.bincount(s, minlength=4)
            np.add.at(pairs, (s[:-1], s[1:]), 1)
    expected = slots.sum() / 4
    assert ((slots - expected) ** 2 / expected).sum() < 16.3  # p = 0.001 for 3 dof
    expected_pairs = pairs.sum() / 16
    assert ((pairs - expected_pairs) ** 2 / expected_pairs).sum() < 37.7  # p = 0.001 for 15 dof


def test_partition_table_rows_differ_by_block_timestep_seed_and_grid():
    key = merge_module.step_key
    a = merge_module.partition_table(16, 16, 2, 2, key(paddle.to_tensor(999)), 0, 3).numpy()
    assert len({tuple(row) for row in a}) == 3  # blocks
    assert not np.array_equal(a, merge_module.partition_table(16, 16, 2, 2, key(paddle.to_tensor(981)), 0, 3).numpy())
    assert not np.array_equal(a, merge_module.partition_table(16, 16, 2, 2, key(paddle.to_tensor(999)), 1, 3).numpy())
    np.testing.assert_array_equal(a, merge_module.partition_table(16, 16, 2, 2, key(999), 0, 3).numpy())


def test_seed_salts_use_every_bit_and_keep_the_old_salts_below_2_to_the_29():
    salt = partition_module._seed_salt
    assert salt(0) == 0 and salt(5) == (5 * partition_module._W_SEED) & partition_module.MASK31  # partitions of 0.4.0 kept
    seeds = [0, 2**29, 2**30, 3 * 2**29, 2**31, 2**32, 2**62, 2**64 - 1]
    assert len({salt(s) for s in seeds}) == len(seeds)
    low = np.random.default_rng(0).choice(2**31, 20000, replace=False)
    assert len({salt(int(s)) for s in low}) == len(low)  # one-to-one on [0, 2**31)
    step = merge_module.step_key(999)
    tables = [merge_module.partition_table(16, 16, 2, 2, step, s, 2).numpy() for s in (0, 2**29, 2**31)]
    assert not np.array_equal(tables[0], tables[1]) and not np.array_equal(tables[0], tables[2])


def test_step_key_is_the_same_for_a_batch_of_one_timestep_in_any_form():
    key = lambda t: int(merge_module.step_key(t))  # noqa: E731
    assert key(paddle.to_tensor(999)) == key(paddle.to_tensor([999, 999])) == key(999) == key(999.0)
    assert key(paddle.to_tensor([999.0], dtype="float32")) == key(paddle.to_tensor([999]))
    assert key(paddle.to_tensor([999, 500])) == key(999)  # the noisiest item decides
    assert key(paddle.to_tensor(999.5)) != key(999)


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


# the device cache: threads, a bound in bytes, clearing (issue 18, items 5 and 6) ------------------------------------
def test_the_device_cache_is_safe_for_threads_planning_at_many_shapes(monkeypatch):
    import threading
    import time
    from collections import OrderedDict

    class Yielding(OrderedDict):
        """The cache's table, letting other threads run between a lookup and its use (as a thread switch can)."""

        def __contains__(self, key):
            found = super().__contains__(key)
            time.sleep(0)
            return found

        def move_to_end(self, *args, **kwargs):
            time.sleep(0)
            return super().move_to_end(*args, **kwargs)

    merge_module.clear_cache()
    monkeypatch.setattr(cache_module.CACHE, "size", 4)  # evictions all the time
    monkeypatch.setattr(cache_module.CACHE, "items", Yielding())
    errors, start = [], threading.Barrier(4)
    shapes = [(h, w) for h in (4, 6, 8) for w in (4, 6, 8)]

    def hammer(k):
        start.wait()
        try:
            rng = np.random.default_rng(k)
            for i in range(40):  # plans at many shapes, as four services with different image sizes make them
                h, w = shapes[(i + k) % len(shapes)]
                x = paddle.to_tensor(rng.standard_normal((1 + i % 2, h * w, 8)).astype("float32"))
                plan = bipartite_soft_matching_random2d(x, w, h, 2, 2, h * w // 4, no_rand=True)
                assert plan.merge(x).shape == [x.shape[0], h * w - h * w // 4, 8]
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[:3]
    assert len(cache_module.CACHE.items) <= 4
    assert cache_module.CACHE.bytes == sum(cache_module._nbytes(v) for v in cache_module.CACHE.items.values())
    merge_module.clear_cache()  # (the test's table goes)


def test_the_device_cache_is_bounded_in_bytes_and_can_be_cleared(monkeypatch):
    import ppdiffusers_tome

    ppdiffusers_tome.clear_cache()
    assert ppdiffusers_tome.cache_info()["entries"] == 0 and ppdiffusers_tome.cache_info()["bytes"] == 0
    limit = 2**20
    monkeypatch.setattr(cache_module.CACHE, "max_bytes", limit)
    rng = np.random.default_rng(0)
    expected = {}
    for batch in range(1, 17):  # activation-sized buffers of a growing batch: [B, 256, 320] float32, B * 160 KiB
        x = paddle.to_tensor(rng.standard_normal((batch, 256, 320)).astype("float32"))
        plan = bipartite_soft_matching_random2d(x, 16, 16, 2, 2, 128, no_rand=True)
        expected[batch] = (x, plan, plan.merge(x).numpy())
        info = ppdiffusers_tome.cache_info()
        assert info["bytes"] <= limit and info["max_bytes"] == limit, info
    assert info["entries"] > 0
    sizes = [cache_module._nbytes(value) for value in cache_module.CACHE.items.values()]
    assert sum(sizes) == info["bytes"] and max(sizes) <= limit
    freed = ppdiffusers_tome.clear_cache()
    assert freed == info["bytes"] > 0
    assert ppdiffusers_tome.cache_info()["entries"] == 0 and ppdiffusers_tome.cache_info()["bytes"] == 0
    for x, plan, merged in expected.values():  # plans made before the clear still merge, and the same
        np.testing.assert_array_equal(plan.merge(x).numpy(), merged)
    assert merge_module.DEFAULT_CACHE_BYTES == cache_module.DeviceCache().max_bytes == 64 * 2**20

"""Local matching (match_window): window sides, the per-window random partition, the plan against a float64 numpy
reference, the dense GPU form (bit-identical, few operators, half precision kept) and its small temporaries."""

import collections
import contextlib

import numpy as np
import paddle
import pytest

import ppdiffusers_tome.ops as merge_module
from ppdiffusers_tome.ops import LocalMergePlan, step_key, window_partition_table, window_sides
from ppdiffusers_tome.testing import gpu_kernels
from ppdiffusers_tome.tools.measure import count_ops
from tests.cases import LOCAL_CASES, case_partition, tie_free_local
from tests.half_on_cpu import half_kernels
from tests.numpy_reference import (
    reference_local,
    reference_windows,
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


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
@pytest.mark.parametrize("batch,h,w,window,r_w,random", LOCAL_CASES)
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
    # one layout change and one batched matmul on each side
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

        def record(a, b, **k):
            operands.update([(str(a.dtype), str(b.dtype))])
            return wrapped(a, b, **k)
        monkeypatch.setattr(paddle, "matmul", record)
        plan = LocalMergePlan.from_matching(x_half, (16, 16, 8, 8, 2, 2), table[0], 24, kind="gpu", order=order)
        merged = plan.merge(x_half)
        out = plan.unmerge(merged)
    # every product on half operands: similarity, merge and unmerge; feature order adds its two products against
    # the centroids (the mean token's and every token's)
    assert dict(operands) == {(f"paddle.{half}", f"paddle.{half}"): 5 if order == "feature" else 3}
    assert merged.dtype == x_half.dtype and out.dtype == x_half.dtype
    reference = LocalMergePlan.from_matching(x_half.astype("float32"), (16, 16, 8, 8, 2, 2), table[0], 24, kind="gpu",
                                             order=order)
    expected = reference.unmerge(reference.merge(x_half.astype("float32"))).numpy()
    tol = 3e-2 if half == "bfloat16" else 4e-3
    # equal (to half rounding) wherever the half-precision matching decided as float32 did: nearly everywhere. In
    # feature order a token whose cluster flips in half precision moves the window cuts after it, so fewer outputs
    # agree (0.88-1.0 measured over 10 inputs), but the merge loses no more of the tokens than float32's does
    agreement = agreement if order == "grid" else 0.8
    produced = out.astype("float32").numpy()
    assert np.isclose(produced, expected, rtol=tol, atol=tol).mean() > agreement
    tokens = x_half.astype("float32").numpy()
    assert np.linalg.norm(produced - tokens) <= 1.02 * np.linalg.norm(expected - tokens)


def peak_of(run):
    """The peak of host memory allocated while ``run`` runs, above what was allocated before. ``run`` runs twice
    and the second run is measured (the first fills the constant tables); its result stays alive while the peak is
    read."""
    core = paddle.base.core
    run()
    before = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    kept = run()  # noqa: F841 - the plan stays alive while the peak is read
    return core.host_memory_stat_peak_value("Allocated", 0) - before


WIDE = (2, 16384, 320)  # SD's 1x level at 1024 px, batch 2


def wide_tokens():
    return paddle.to_tensor(np.random.default_rng(0).standard_normal(WIDE).astype("float32"))


@pytest.fixture(scope="module")
def global_matching_peak():
    """``peak(kind)``: the peak of global matching on :func:`wide_tokens` with ``kind`` kernels. Global matching has
    no window order, so the grid and the feature-order tests compare with the same plan: it is measured once per
    kind, by whichever test asks first."""
    peaks = {}

    def peak(kind):
        if kind not in peaks:
            x = wide_tokens()
            with gpu_kernels() if kind == "gpu" else contextlib.nullcontext():
                peaks[kind] = peak_of(
                    lambda: merge_module.bipartite_soft_matching_random2d(x, 128, 128, 2, 2, 8192, generator=0))
        return peaks[kind]

    return peak


@pytest.mark.parametrize("order", ["grid", "feature"])
@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_local_matching_needs_a_small_fraction_of_global_temporaries(kind, order, kernels, global_matching_peak):
    # similarity work and temporaries at [2, 16384, 320] at least 10x below global matching's. Both plans
    # hold one copy of the tokens (40 MiB here: global as unit rows, local in window order); beyond it, global holds
    # the [B, Ns, Nd] similarity (384 MiB) and local a [B*W, Ns_w, Nd_w] one (6 MiB)
    kernels(kind)
    batch, tokens, channels = WIDE
    x = wide_tokens()
    table = window_partition_table(128, 128, 16, 16, 2, 2, step_key(3), seed=0, blocks=1)
    local_plan = lambda: LocalMergePlan.from_matching(x, (128, 128, 16, 16, 2, 2), table[0], 128, order=order)  # noqa: E731
    local_peak, global_peak = peak_of(local_plan), global_matching_peak(kind)
    token_copy = batch * tokens * channels * 4
    assert global_peak >= batch * 12288 * 4096 * 4  # the global similarity was there
    assert 10 * (local_peak - token_copy) <= global_peak - token_copy, (local_peak / 2**20, global_peak / 2**20)
    assert 10 * (batch * 64 * 192 * 64) <= batch * 12288 * 4096  # similarity entries: the matching work (64x)
    plan = local_plan()
    applied = peak_of(lambda: plan.unmerge(plan.merge(x)))
    assert applied <= 3 * token_copy  # merge + unmerge: their outputs and the window-ordered input


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_dense_local_plan_holds_its_two_matrices_in_the_tokens_dtype_and_nothing_else(dtype, kernels, monkeypatch):
    """At [16, 16384, 32] with 16 x 16 windows and ratio 0.5 a dense local plan keeps two matrices of
    B * W * T * Mw entries each (W = 64 windows per image, T = 256 tokens, Mw = 128 rows): 2 * 16 * 64 * 256 * 128
    entries, 256 MiB in float32 and 128 MiB in float16 (no float32 copy next to the half one). The channels do not
    enter the matrices; with 32 of them any copy of the tokens the plan kept would still be 16 MiB or more, far above
    the 1 MiB allowed (SD's 320 only make the matching ten times slower)."""
    kernels("gpu")
    batch, tokens, channels = 16, 16384, 32
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((batch, tokens, channels)).astype("float32"))
    x = x.astype(dtype)
    table = window_partition_table(128, 128, 16, 16, 2, 2, step_key(3), seed=0, blocks=1)
    core = paddle.base.core
    with half_kernels(monkeypatch):
        LocalMergePlan.from_matching(x, (128, 128, 16, 16, 2, 2), table[0], 128)  # (constant tables cached here)
        before = core.host_memory_stat_current_value("Allocated", 0)
        plan = LocalMergePlan.from_matching(x, (128, 128, 16, 16, 2, 2), table[0], 128)
        held = core.host_memory_stat_current_value("Allocated", 0) - before
    matrices = 2 * batch * 64 * 256 * 128 * (4 if dtype == "float32" else 2)
    assert str(plan.merge_matrix.dtype).endswith(dtype) and str(plan.unmerge_matrix.dtype).endswith(dtype)
    assert matrices <= held <= matrices + 2**20, (held / 2**20, matrices / 2**20)

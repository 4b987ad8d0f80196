"""The deterministic merge of the GPU kernels (``deterministic=True``), run on the CPU inside
``ppdiffusers_tome.testing.gpu_kernels()``: it computes ToMe's merge (checked against the float64 numpy reference), uses
no kernel that adds floats through atomics on a GPU (``index_add``, scatter-add and relatives), keeps within the
temporaries bound of the default path, and exports with a dynamic batch."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.ops import GroupMergePlan, bipartite_soft_matching_random2d, grid_partition
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tools.measure import count_forward_ops, count_ops, ops_added_per_block
from tests.cases import F32_TOL, GLOBAL_CASES, partition_of, tie_free_metric
from tests.numpy_reference import reference_merge, reference_plan, reference_round_trip
from tests.ops.test_gpu_kernels import unet_call

# kernels that add floats in an order a GPU does not fix (atomics): none may run in a deterministic merge
ATOMIC_ADDS = ("index_add", "scatter", "scatter_nd_add", "put_along_axis", "index_put", "segment_pool")


@pytest.fixture
def gpu_kernels(monkeypatch, kernels):
    kernels("gpu")


def plans(metric, h, w, sx, sy, r, no_rand=False):
    def build(deterministic):
        return bipartite_soft_matching_random2d(paddle.to_tensor(metric), w, h, sx, sy, r, no_rand=no_rand,
                                                generator=7, deterministic=deterministic)

    return build(False), build(True)


@pytest.mark.parametrize("batch,h,w,sx,sy,r,no_rand", GLOBAL_CASES + [(2, 8, 8, 2, 2, 48, False), (1, 6, 6, 3, 3, 32, True)])
def test_deterministic_merge_matches_the_numpy_reference(gpu_kernels, batch, h, w, sx, sy, r, no_rand):
    # the extra cases merge every src (no kept src: the merged rows are all dst) and have groups of up to 8 src
    src, dst = grid_partition(h, w, sx, sy, no_rand=no_rand, generator=7)
    metric = tie_free_metric(3, batch, h, w, 12, src, dst, r)
    x = paddle.to_tensor(np.random.default_rng(4).standard_normal((batch, h * w, 5)).astype(np.float32) + 0.5)
    default, plan = plans(metric, h, w, sx, sy, r, no_rand)
    assert plan.kind == "gpu" and isinstance(plan, GroupMergePlan) and not isinstance(default, GroupMergePlan)
    ref = reference_plan(metric, *partition_of(plan), r)
    np.testing.assert_allclose(plan.merge(x).numpy(), reference_merge(x.numpy(), ref), **F32_TOL)
    np.testing.assert_allclose(plan.unmerge(plan.merge(x)).numpy(), reference_round_trip(x.numpy(), ref), **F32_TOL)
    np.testing.assert_allclose(plan.merge(x, mode="sum").numpy(), default.merge(x, mode="sum").numpy(), rtol=1e-5,
                               atol=1e-5)


def test_deterministic_merge_keeps_float64_accuracy_and_half_dtypes(gpu_kernels):
    h = w = 16
    rng = np.random.default_rng(5)
    metric = rng.standard_normal((2, h * w, 8))
    x = rng.standard_normal((2, h * w, 6)) * 100.0
    _, plan = plans(metric.astype(np.float32), h, w, 2, 2, 120)
    ref = reference_merge(x, reference_plan(metric.astype(np.float32), *partition_of(plan), 120))
    out = plan.merge(paddle.to_tensor(x))
    assert out.dtype == paddle.float64
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-11)  # float32 arithmetic would be off by ~1e-5
    half = plan.merge(paddle.to_tensor(x.astype(np.float32)).astype("bfloat16"))
    assert half.dtype == paddle.bfloat16
    np.testing.assert_allclose(half.astype("float32").numpy(), ref, rtol=2 ** -7, atol=1.0)  # bfloat16 rounding


def test_deterministic_merge_runs_no_atomic_add(gpu_kernels):
    x = paddle.randn([2, 1024, 64])
    metric = x.numpy()
    default, plan = plans(metric, 32, 32, 2, 2, 512)
    plan.merge(x)  # warm
    default_ops = count_ops(lambda: default.unmerge(default.merge(x)))
    ops = count_ops(lambda: plan.unmerge(plan.merge(x)))
    assert "index_add_" in default_ops.by_name  # what the default merge uses (atomics on a GPU) is what we look for
    used = {name for name in ops.by_name if any(name.startswith(kind) for kind in ATOMIC_ADDS)}
    assert not used, f"the deterministic merge ran {used}: {dict(ops.by_name)}"
    assert "cumsum" in ops.by_name and ops.total <= 20, dict(ops.by_name)


def test_deterministic_merge_temporaries_stay_within_the_default_bound(gpu_kernels):
    batch, tokens, channels, side = 2, 16384, 64, 128
    num_dst = tokens // 4
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((batch, tokens, channels)).astype("float32"))

    def once():
        plan = bipartite_soft_matching_random2d(x, side, side, 2, 2, tokens // 2, generator=0, deterministic=True)
        return plan.unmerge(plan.merge(x))

    once()
    core = paddle.base.core
    before = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    out = once()
    peak = core.host_memory_stat_peak_value("Allocated", 0) - before
    similarity = batch * (tokens - num_dst) * num_dst * 4
    bound = 1.05 * similarity + 3 * batch * tokens * channels * 4
    assert out.shape == x.shape and peak > similarity
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB"


def test_deterministic_option_reaches_the_blocks_and_changes_only_the_order_of_sums(gpu_kernels):
    unet = tiny_unet()
    run = unet_call(unet, 2, 32, "[B]")
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, policy="tomesd")  # (1024 tokens: the default policy would skip)
    try:
        default = run().numpy()
        default_ops = count_forward_ops(run, unet)
        ppdiffusers_tome.apply_tome(unet, ratio=0.5, deterministic=True, policy="tomesd")
        assert ppdiffusers_tome.tome_config(unet).deterministic is True
        deterministic = run().numpy()
        counted = count_forward_ops(run, unet)
    finally:
        ppdiffusers_tome.remove_tome(unet)
    vanilla = count_forward_ops(run, unet)
    assert "index_add_" in default_ops.by_name and counted.by_name.get("cumsum", 0) >= counted.merging_blocks == 3
    np.testing.assert_allclose(deterministic, default, rtol=1e-4, atol=1e-4)
    per_block = ops_added_per_block(vanilla.total, counted.total, counted.merging_blocks)
    assert per_block <= 75, f"{per_block:.1f} ops per merging block with deterministic=True"


def test_deterministic_gpu_branch_exports_with_a_dynamic_batch(gpu_kernels, tmp_path):
    from tests.tome.test_static_graph import DYNAMIC_SPEC, NoisePredictor, small_unet

    unet = small_unet()
    unet.apply_tome(ratio=0.5, deterministic=True, min_work=0)  # (a dynamic batch: decided for batch 2)
    model = NoisePredictor(unet)
    model.eval()
    static = paddle.jit.to_static(model, input_spec=DYNAMIC_SPEC, full_graph=True)
    path = str(tmp_path / "unet")
    paddle.jit.save(static, path)
    loaded = paddle.jit.load(path)
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        sample = paddle.to_tensor(rng.standard_normal((batch, 4, 16, 16)).astype("float32"))
        context = paddle.to_tensor(rng.standard_normal((batch, 5, 32)).astype("float32"))
        timestep = paddle.full([batch], 700, dtype="int64")
        with paddle.no_grad():
            eager = model(sample, timestep, context).numpy()
        np.testing.assert_allclose(loaded(sample, timestep, context).numpy(), eager, rtol=1e-5, atol=1e-5)


def test_deterministic_must_be_a_bool():
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        ppdiffusers_tome.ToMeConfig(deterministic=1)

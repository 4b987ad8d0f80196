"""The GPU kernel family measured on the CPU: a forward patched with ``apply_tome()``'s defaults makes no
host<->device transfer beyond what the vanilla UNet makes (each one would be a device sync on a GPU); the GPU branch
adds few eager operators per merging block, holds no temporary beyond the similarity and a few token-sized tensors,
and keeps half-precision tokens in half precision, with the same decisions as float32 on real activations.
Transfers and operators are counted with the instruments of ppdiffusers_tome/tools/measure.py; the GPU kernels run on
the CPU inside ``ppdiffusers_tome.testing.gpu_kernels()``, half precision through tests/half_on_cpu.py.
"""

import collections

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
import ppdiffusers_tome.ops as merge_module
from ppdiffusers_tome.presets import preset_pipeline
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.patch import find_blocks
from ppdiffusers_tome.tools.measure import TransferCounter, count_forward_ops, count_ops, ops_added_per_block
from tests.half_on_cpu import half_kernels

# Eager operators per merging block, plan + merge + unmerge and the block's share of the per-call partition table,
# with tomesd's plan in every block (policy="tomesd"). On a GPU each one is a kernel launch of ~24-29 us of host time
# (docs/gpu.md), more than merging saves per block at 512^2 with one image: that is why the default policy skips
# such blocks (0 operators) and pools keys and values where merging pays (3). tomesd's plan stays within 46: 0.9.0's
# 42.3, plus two gathers of a merge that needs no zero buffer (the buffer was rebuilt at every merge at large sizes)
# and the best score's gather at the argmax (a second pass over the similarity before). The CPU branch spends more
# operators to make fewer passes over the tokens (on a CPU an operator costs microseconds and a pass over
# [2, 4096, 320] about a millisecond); its own budget stops it creeping.
OPS_PER_BLOCK_BUDGET = {"gpu": 46, "cpu": 67}
PLAN_OPS_BUDGET, APPLY_OPS_BUDGET = 33, 9  # GPU branch, counted on the merge core alone
FEATURE_SHARED_BUDGET = 58  # match_order="feature" with share_plan="level", GPU branch
POOLING_BUDGET = 3  # the policy's K/V pooling: a reshape, a strided slice, a reshape


def unet_call(unet, batch, latent, timestep_kind, seed=0):
    """A no-grad UNet forward as a pipeline makes it: random latents and text states, timestep 500 as a 0-d tensor
    (what iterating ``scheduler.timesteps`` gives) or as a ``[B]`` tensor."""
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((batch, 4, latent, latent)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((batch, 7, unet.config.cross_attention_dim)).astype("float32"))
    timestep = paddle.to_tensor(500, dtype="int64") if timestep_kind == "0-d" else paddle.to_tensor([500] * batch, dtype="int64")
    assert timestep.shape == ([] if timestep_kind == "0-d" else [batch])

    def run():
        with paddle.no_grad():
            return unet(sample, timestep, context).sample

    return run


def transfers_of(run):
    run()  # warm-up: one-off work of a first call is not the steady state
    with TransferCounter() as transfers:
        out = run()
    return transfers, out


@pytest.mark.parametrize("kind", ["gpu", "cpu"])  # both branches' kernels (merge.py's docstring cites the GPU one)
@pytest.mark.parametrize("options", [{}, dict(policy="tomesd"), dict(min_work=0),
                                     dict(match_window=8, share_plan="level", min_work=0),
                                     dict(match_window=8, match_order="feature", share_plan="level", min_work=0)],
                         ids=["defaults", "tomesd", "pooled", "local-shared", "feature-shared"])
@pytest.mark.parametrize("timestep_kind", ["0-d", "[B]"])
@pytest.mark.parametrize("batch", [1, 2])
def test_patched_forward_adds_no_host_device_transfer(batch, timestep_kind, options, kind, monkeypatch, kernels):
    kernels(kind)
    unet = tiny_unet()
    run = unet_call(unet, batch, 16, timestep_kind)
    vanilla, vanilla_out = transfers_of(run)
    ppdiffusers_tome.apply_tome(unet, **options)
    try:
        patched, patched_out = transfers_of(run)
        stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    finally:
        ppdiffusers_tome.remove_tome(unet)
    if kind == "gpu" and not options:  # 256 tokens: far below min_work, every block skipped, exactly vanilla
        assert stats["merges"] == 0 and stats["blocks_skipped"] > 0
        np.testing.assert_array_equal(patched_out.numpy(), vanilla_out.numpy())
    else:
        assert stats["merges"] > 0 and np.abs(patched_out.numpy() - vanilla_out.numpy()).max() > 0  # ToMe really ran
    added = collections.Counter(patched.by_site()) - collections.Counter(vanilla.by_site())
    assert not added, (
        f"ToMe added {patched.total - vanilla.total} host<->device transfer(s) per forward (batch {batch}, timestep "
        f"{timestep_kind}); each is a device sync on a GPU:\n"
        + "\n".join(f"  {count} x {site}" for site, count in added.most_common())
    )


@pytest.mark.parametrize("kind, options, budget", [
    ("gpu", dict(policy="tomesd"), OPS_PER_BLOCK_BUDGET["gpu"]),
    ("cpu", {}, OPS_PER_BLOCK_BUDGET["cpu"]),
    ("gpu", dict(min_work=0), POOLING_BUDGET),
    ("gpu", dict(match_window=16, share_plan="level", min_work=0), OPS_PER_BLOCK_BUDGET["gpu"]),
    ("gpu", dict(match_window=16, match_order="feature", share_plan="level", min_work=0), FEATURE_SHARED_BUDGET),
], ids=["gpu-tomesd", "cpu", "gpu-pooled", "gpu-local-shared", "gpu-feature-shared"])
def test_ops_added_per_merging_block_within_budget(kind, options, budget, monkeypatch, kernels):
    kernels(kind)
    unet = tiny_unet()
    run = unet_call(unet, 2, 32, "[B]")  # 32 x 32 latent: 1024 tokens at the 1x level
    vanilla = count_forward_ops(run, unet)
    ppdiffusers_tome.apply_tome(unet, **options)
    try:
        patched = count_forward_ops(run, unet)
    finally:
        ppdiffusers_tome.remove_tome(unet)
    assert vanilla.merging_blocks == 0 and patched.merging_blocks == 3  # the tiny UNet's three 1x-level blocks
    per_block = ops_added_per_block(vanilla.total, patched.total, patched.merging_blocks)
    added = collections.Counter(patched.by_name) - collections.Counter(vanilla.by_name)
    assert per_block <= budget, (
        f"{per_block:.1f} eager ops added per merging block by the {kind} branch (budget {budget}): "
        f"{vanilla.total} -> {patched.total} over {patched.merging_blocks} blocks; added: {dict(added.most_common())}"
    )


def test_gpu_branch_plan_and_apply_op_counts(monkeypatch, kernels):
    # the two halves of a merging block's cost, counted apart: building a plan, and merging + unmerging with it
    kernels("gpu")
    x = paddle.randn([2, 1024, 64])
    partition = merge_module.partition_table(32, 32, 2, 2, merge_module.step_key(500), 0, 1)[0]
    build = lambda: merge_module.MergePlan.from_matching(x, partition, 768, 512)  # noqa: E731
    plan = build()  # warm the caches
    plan_ops = count_ops(build)
    apply_ops = count_ops(lambda: plan.unmerge(plan.merge(x)))
    assert plan_ops.total <= PLAN_OPS_BUDGET, f"plan: {plan_ops.total} ops {plan_ops.by_name}"
    assert apply_ops.total <= APPLY_OPS_BUDGET, f"merge + unmerge: {apply_ops.total} ops {apply_ops.by_name}"
    assert "matmul" in plan_ops.by_name and "index_add_" in apply_ops.by_name  # what is counted is the real work


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_temporaries_stay_within_the_similarity_and_three_token_tensors(kind, monkeypatch, kernels):
    # (the 0.3.0 GPU branch also held a float32 one-hot [B, r, Nd] (grows as B*N^2): 650 MiB here
    kernels(kind)
    batch, tokens, channels, side = 2, 16384, 64, 128
    num_dst = tokens // 4
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((batch, tokens, channels)).astype("float32"))

    def once():
        plan = merge_module.bipartite_soft_matching_random2d(x, side, side, 2, 2, tokens // 2, generator=0)
        return plan.unmerge(plan.merge(x))

    once()  # caches (index tables, constants) are not temporaries
    core = paddle.base.core
    before = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    out = once()
    peak = core.host_memory_stat_peak_value("Allocated", 0) - before
    similarity = batch * (tokens - num_dst) * num_dst * 4
    bound = 1.05 * similarity + 3 * batch * tokens * channels * 4
    assert out.shape == x.shape and peak > similarity  # the similarity itself was measured
    assert peak <= bound, f"{kind}: peak {peak / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB"


def test_similarity_dtype_follows_the_tokens_on_a_gpu_only():
    dtype = merge_module.similarity_dtype
    assert [dtype(d, "gpu") for d in ("float16", "bfloat16", "float32", "float64")] == [
        "float16", "bfloat16", "float32", "float64"]
    assert [dtype(d, "cpu") for d in ("float16", "bfloat16", "float32", "float64")] == [
        "float32", "float32", "float32", "float64"]


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_gpu_branch_keeps_half_tokens_in_half_precision(half, monkeypatch, kernels):
    kernels("gpu")
    seen = []
    original_matmul = paddle.matmul
    x = paddle.randn([2, 64, 16]).astype(half)
    with half_kernels(monkeypatch) as calls:
        wrapped = paddle.matmul
        monkeypatch.setattr(paddle, "matmul", lambda a, b, **k: seen.append((str(a.dtype), str(b.dtype))) or wrapped(a, b, **k))
        plan = merge_module.bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, generator=0)
        merged = plan.merge(x)
        out = plan.unmerge(merged)
    assert paddle.matmul is not original_matmul and seen == [(f"paddle.{half}", f"paddle.{half}")]
    assert merged.dtype == x.dtype and out.dtype == x.dtype and "_matmul" in calls


@pytest.fixture(scope="module")
def sd15_narrow_tokens():
    """The input of every 1x-level transformer block in one forward of the sd15-narrow preset at 512^2 (UNet batch 2,
    4096 tokens of 64 channels): real activations, with the structure a convolution stack gives, not white noise."""
    unet = preset_pipeline("sd15-narrow").unet
    caught, handles = [], []
    for _, block in find_blocks(unet):
        hook = lambda layer, args: caught.append(args[0].detach().clone()) if args[0].shape[1] == 4096 else None  # noqa: E731
        handles.append(block.register_forward_pre_hook(hook))
    rng = np.random.default_rng(0)
    with paddle.no_grad():
        unet(paddle.to_tensor(rng.standard_normal((2, 4, 64, 64)).astype("float32")), paddle.to_tensor(500),
             paddle.to_tensor(rng.standard_normal((2, 77, 64)).astype("float32")))
    for handle in handles:
        handle.remove()
    assert len(caught) == 5  # SD-1.5 layout: 2 down + 3 up blocks at 1x
    return caught


def test_float16_matching_decides_as_float32_on_real_activations(sd15_narrow_tokens, monkeypatch):
    # the GPU branch on float16 tokens (unit rows, similarity and its max in float16) against
    # float32, on the tokens of every 1x block of sd15-narrow at 512^2
    partition = merge_module.partition_table(64, 64, 2, 2, merge_module.step_key(500), 0, 1)[0]
    for x in sd15_narrow_tokens:
        full = merge_module.MergePlan.from_matching(x, partition, 3072, 2048, kind="gpu")
        x16 = x.astype("float16")
        with half_kernels(monkeypatch):
            half = merge_module.MergePlan.from_matching(x16, partition, 3072, 2048, kind="gpu")
            same_plan = full.unmerge(full.merge(x16)).astype("float32").numpy()
            half_out = half.unmerge(half.merge(x16)).astype("float32").numpy()
        exact = full.unmerge(full.merge(x)).numpy()
        rounding = np.abs(x16.astype("float32").numpy() - x.numpy()).mean()  # what storing the tokens costs
        for b in range(2):
            into_full = dict(zip(full.merged_pos.numpy()[b], full.merged_into.numpy()[b]))
            into_half = dict(zip(half.merged_pos.numpy()[b], half.merged_into.numpy()[b]))
            both = set(into_full) & set(into_half)
            assert len(both) >= 0.99 * 2048, f"only {len(both)} of 2048 merged src agree"
            assert np.mean([into_full[p] == into_half[p] for p in both]) >= 0.99  # ... and join the same dst
        # the merge arithmetic in float16 (float32 sums) costs what rounding the tokens costs, no more
        assert np.abs(same_plan - exact).mean() <= 1.5 * rounding
        # with the float16 decisions, the few src that differ move the mean output by well under 1% of a token
        assert np.abs(half_out - exact).mean() <= 0.01 * np.abs(x.numpy()).mean()

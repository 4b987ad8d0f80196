"""ToMe's plan options on SD3's joint blocks: what shapes the plan of a UNet block shapes the plan of an MMDiT's image
stream (strides, a fixed or a seeded random partition, ratio schedules, plan reuse across steps, a plan shared by
the blocks of a call, matching windows), checked on the plan a block actually used; and the GPU policy's choice for
plain ToMe on joint blocks (it skips the small ones and downsamples the image keys and values of the large ones
instead of merging; more in tests/tome/test_sd3_gpu_policy.py). Checked on the tiny offline SD3 transformer with the math
attention processor."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import gpu_kernels, tiny_sd3_transformer
from ppdiffusers_tome.tome.config import ToMeConfig
from ppdiffusers_tome.tome.decision import Settings, decide_block, grid_of
from ppdiffusers_tome.tome.patch import find_blocks, get_patch
from ppdiffusers_tome.tome.policy import JOINT_MIN_WORK
from tests.numpy_reference import reference_plan
from tests.tome.test_sd3_tome import LATENT_CHANNELS, MODEL, WIDTH, forward, transformer_inputs

GRID = (6, 8)  # a non-square patch grid: 48 image tokens


def block_plans(options, timesteps=(600.0,), grid=GRID, seed=0):
    """The plans the first joint block of a fresh tiny SD3 transformer patched with ``options`` uses, one per call
    at each of ``timesteps`` (the block run alone inside ``patch.in_call``), and the block's image input."""
    model = tiny_sd3_transformer()
    ppdiffusers_tome.apply_tome(model, **options)
    patch, block = get_patch(model), model.transformer_blocks[0]
    rng = np.random.default_rng(seed)
    grid_h, grid_w = grid
    hidden = rng.standard_normal((2, grid_h * grid_w, WIDTH)).astype("float32")
    text = rng.standard_normal((2, 5, WIDTH)).astype("float32")
    temb = rng.standard_normal((2, WIDTH)).astype("float32")
    sample = paddle.to_tensor(rng.standard_normal((2, LATENT_CHANNELS, 2 * grid_h, 2 * grid_w)).astype("float32"))
    plans = []
    handle = block.attn.to_q.register_forward_pre_hook(lambda layer, args: plans.append(patch.plan_in_flight(0)))
    try:
        with paddle.no_grad():
            for t in timesteps:
                with patch.in_call(sample, paddle.to_tensor([t, t])):
                    block(*(paddle.to_tensor(a) for a in (hidden, text, temb)))
    finally:
        handle.remove()
    return plans, hidden


def cell_of(position, sx, sy, grid_w=GRID[1]):
    return (position // grid_w) // sy, (position % grid_w) // sx


def assert_matching_is_the_reference(plan, hidden):
    """Each merged src joined its most similar dst by cosine similarity, the ``r`` most similar src merged."""
    src, dst = plan.src_pos.numpy(), plan.dst_pos.numpy()
    assert sorted(np.concatenate([src, dst]).tolist()) == list(range(hidden.shape[1]))
    expected = reference_plan(hidden, src, dst, plan.r)
    for b in range(hidden.shape[0]):
        got = dict(zip(plan.merged_pos.numpy()[b].tolist(), plan.merged_into.numpy()[b].tolist()))
        assert got == {int(src[s]): int(dst[t]) for s, t in zip(expected.merged[b], expected.target[b])}


# strides and the partition ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sx, sy", [(2, 2), (4, 2), (3, 3)], ids=["2x2", "4x2", "3x3-partial-cells"])
def test_a_fixed_partition_puts_one_dst_at_the_top_left_of_each_stride_cell(sx, sy):
    (plan,), hidden = block_plans(dict(ratio=0.3, sx=sx, sy=sy, use_rand=False))
    grid_h, grid_w = GRID
    top_left = [y * grid_w + x for y in range(0, grid_h - grid_h % sy, sy) for x in range(0, grid_w - grid_w % sx, sx)]
    assert sorted(plan.dst_pos.numpy().tolist()) == top_left
    assert plan.r == int(grid_h * grid_w * 0.3)
    assert_matching_is_the_reference(plan, hidden)


@pytest.mark.parametrize("sx, sy", [(2, 2), (4, 2)], ids=["2x2", "4x2"])
def test_a_random_partition_draws_one_dst_per_stride_cell_from_the_seed(sx, sy):
    timesteps = (600.0, 300.0)
    first, hidden = block_plans(dict(ratio=0.5, sx=sx, sy=sy, seed=3), timesteps)
    again, _ = block_plans(dict(ratio=0.5, sx=sx, sy=sy, seed=3), timesteps)
    other, _ = block_plans(dict(ratio=0.5, sx=sx, sy=sy, seed=4), timesteps)
    cells = (GRID[0] // sy) * (GRID[1] // sx)
    for plan in first:
        dst = plan.dst_pos.numpy().tolist()
        assert len(dst) == cells and len({cell_of(p, sx, sy) for p in dst}) == cells  # one dst in every cell
        assert_matching_is_the_reference(plan, hidden)
    draws = [[plan.dst_pos.numpy().tolist() for plan in plans] for plans in (first, again, other)]
    assert draws[0] == draws[1]  # the same seed and timestep: the same partition
    assert draws[0] != draws[2]  # another seed: another partition
    assert draws[0][0] != draws[0][1]  # another timestep: another partition
    top_left = sorted(y * GRID[1] + x for y in range(0, GRID[0], sy) for x in range(0, GRID[1], sx))
    assert sorted(draws[0][0]) != top_left


# how many tokens merge ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio, expected", [
    ((0.1, 0.6), [int(48 * 0.1), int(48 * 0.35), int(48 * 0.6)]),
    (lambda progress: 0.2 if progress < 0.5 else 0.5, [int(48 * 0.2), int(48 * 0.5), int(48 * 0.5)]),
], ids=["pair", "callable"])
def test_a_ratio_schedule_sets_how_many_image_tokens_merge_from_the_timestep(ratio, expected):
    plans, hidden = block_plans(dict(ratio=ratio), timesteps=(1000.0, 500.0, 0.0))  # progress 0, 0.5, 1
    assert [plan.r for plan in plans] == expected
    assert_matching_is_the_reference(plans[-1], hidden)


def test_recompute_every_reuses_the_partition_and_matching_across_model_calls():
    model = tiny_sd3_transformer()
    ppdiffusers_tome.apply_tome(model, ratio=0.5, recompute_every=2)
    patch, seen = get_patch(model), []
    handle = model.transformer_blocks[0].attn.to_q.register_forward_pre_hook(
        lambda layer, args: seen.append(patch.plan_in_flight(0).merged_into.numpy()))
    outputs = [forward(model, transformer_inputs(batch=2, seed=step, timestep=t))
               for step, t in enumerate((900.0, 700.0, 500.0, 300.0))]
    handle.remove()
    stats = ppdiffusers_tome.tome_stats(model)[MODEL]
    assert stats["plans_computed"] == 2 * 3 and stats["plans_reused"] == 2 * 3  # steps 0 and 2 plan, 1 and 3 reuse
    np.testing.assert_array_equal(seen[1], seen[0])
    np.testing.assert_array_equal(seen[3], seen[2])
    assert not np.array_equal(seen[2], seen[0])
    assert all(np.isfinite(out).all() for out in outputs)


def test_a_shared_plan_is_made_by_the_first_block_of_a_call_and_used_by_the_others():
    model = tiny_sd3_transformer()
    inputs = transformer_inputs(batch=2, seed=2)
    ppdiffusers_tome.apply_tome(model, ratio=0.5)
    own = forward(model, inputs)  # every block plans for itself
    ppdiffusers_tome.apply_tome(model, ratio=0.5, share_plan="level")
    patch, seen = get_patch(model), []
    for index, block in enumerate(model.transformer_blocks):
        block.attn.to_q.register_forward_pre_hook(lambda layer, args, i=index: seen.append(patch.plan_in_flight(i)))
    shared = forward(model, inputs)
    stats = ppdiffusers_tome.tome_stats(model)[MODEL]
    assert stats["plans_computed"] == 1 and stats["plans_shared"] == 2 and stats["merges"] == 3
    assert len(seen) == 3 and all(plan is seen[0] for plan in seen)
    assert np.abs(shared - own).max() > 1e-5  # the blocks' own plans differ from the first block's


@pytest.mark.parametrize("options", [dict(match_window=4), dict(match_window=4, match_order="feature")],
                         ids=["grid-windows", "feature-windows"])
def test_matching_windows_merge_their_share_of_every_window(options):
    """An 8 x 8 patch grid in four 4 x 4 windows: each merges ``int(0.5 * 16)`` of its 12 src tokens."""
    model = tiny_sd3_transformer()
    inputs = transformer_inputs(batch=2, latent_hw=(16, 16), seed=8)
    vanilla = forward(model, inputs)
    ppdiffusers_tome.apply_tome(model, ratio=0.5)
    global_matching = forward(model, inputs)
    ppdiffusers_tome.apply_tome(model, ratio=0.5, **options)
    rows = []
    handle = model.transformer_blocks[0].attn.to_q.register_forward_pre_hook(
        lambda layer, args: rows.append(args[0].shape[1]))
    windowed = forward(model, inputs)
    handle.remove()
    assert rows == [64 - 4 * 8]
    assert np.isfinite(windowed).all() and ppdiffusers_tome.tome_stats(model)[MODEL]["merges"] == 3
    assert np.abs(windowed - vanilla).max() > 1e-5 and np.abs(windowed - global_matching).max() > 1e-6


# the GPU policy -----------------------------------------------------------------------------------------------------
def test_on_gpu_kernels_the_default_policy_skips_small_sd3_blocks_and_downsamples_large_ones_instead_of_merging():
    model = tiny_sd3_transformer()
    inputs = transformer_inputs(batch=2, seed=6)
    vanilla = forward(model, inputs)
    ppdiffusers_tome.apply_tome(model, ratio=0.5)
    with gpu_kernels():
        skipped = forward(model, inputs)  # 2 x 64 tokens: batch * tokens**2 = 8192 < 2**23
    np.testing.assert_array_equal(skipped, vanilla)
    stats = ppdiffusers_tome.tome_stats(model)[MODEL]
    assert stats["blocks_skipped"] == 3 and stats["merges"] == 0 and stats["blocks_pooled"] == 0
    settings = Settings(ToMeConfig(ratio=0.5), model, find_blocks(model))
    for tokens, latent_hw, action in ((2048, (128, 64), "pool"), (4096, (128, 128), "pool"),
                                      (1024, (64, 64), "skip")):
        decision = decide_block(settings, tokens, 2, grid_of(settings, latent_hw, tokens), 1, "gpu", 0.5)
        assert decision.action == action, decision
        assert (2 * tokens ** 2 >= JOINT_MIN_WORK) == (action == "pool")
    with gpu_kernels():
        ppdiffusers_tome.apply_tome(model, ratio=0.5, min_work=0)
        pooled = forward(model, inputs)  # min_work=0: every block's image keys and values are downsampled
    assert np.abs(pooled - vanilla).max() > 1e-5
    stats = ppdiffusers_tome.tome_stats(model)[MODEL]
    assert stats["merges"] == 3 and stats["blocks_pooled"] == 3 and stats["plans_computed"] == 0

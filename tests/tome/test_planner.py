"""The planner's decisions across calls and blocks: plans reused across steps (recompute_every), ratio
schedules, plans shared per level, local plans (match_window) and min_tokens."""

import contextlib
import warnings

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.core.calls import model_calls
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.config import ToMeConfig
from ppdiffusers_tome.tome.patch import ModelPatch, find_blocks, get_patch
from tests.conftest import run
from tests.unet_calls import expected_block_output, forward, plans_seen, unet_inputs


def test_recompute_every_reuses_a_blocks_plan_for_k_steps_then_recomputes():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=2)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, recompute_every=2)
    steps = [dict(sample=sample, timestep=paddle.to_tensor([t, t]), encoder_hidden_states=context) for t in (999, 800, 600, 400, 200)]
    plans = plans_seen(unet, steps)
    assert plans[0] is plans[1] and plans[2] is plans[3] and plans[4] is not plans[2] and plans[2] is not plans[0]
    # the reused plan keeps step 0's random partition although the timestep changed
    assert not np.array_equal(plans[0].dst_pos.numpy(), plans[2].dst_pos.numpy())
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    assert (stats["plans_computed"], stats["plans_reused"]) == (3 * 3, 2 * 3)  # steps 0, 2, 4 recompute; 3 blocks


def test_recompute_at_listed_steps_and_restart_with_a_new_generation():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, recompute_every=[0, 3])
    at = lambda t: dict(sample=sample, timestep=paddle.to_tensor([t]), encoder_hidden_states=context)  # noqa: E731
    plans = plans_seen(unet, [at(t) for t in (900, 700, 500, 300, 100)])  # outside a pipeline: steps 0 to 4
    assert plans[0] is plans[1] is plans[2] and plans[3] is plans[4] and plans[3] is not plans[0]
    ppdiffusers_tome.reset_tome(unet)  # a new generation starts at step 0
    again = plans_seen(unet, [at(900), at(700)])
    assert again[0] is not plans[4] and again[1] is again[0]
    np.testing.assert_array_equal(again[0].dst_pos.numpy(), plans[0].dst_pos.numpy())  # same timestep, same draw


@contextlib.contextmanager
def denoising_loop(steps):
    """A denoising loop as a pipeline runs it: inside the pipeline's progress bar, which advances once per step
    (after the step's model calls). Yields the step numbers."""
    from ppdiffusers import DiffusionPipeline

    pipe = DiffusionPipeline()
    pipe.set_progress_bar_config(disable=True)
    with pipe.progress_bar(total=steps) as bar:

        def loop():
            for step in range(steps):
                yield step
                bar.update()

        yield loop()


def test_plan_cache_keeps_the_two_halves_of_split_guidance_apart():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=2)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, recompute_every=2)
    patch, seen = get_patch(unet), []
    handle = find_blocks(unet)[0][1].attn1.register_forward_pre_hook(
        lambda layer, args: seen.append(patch.plan_in_flight(0)))
    with denoising_loop(2) as steps, paddle.no_grad():
        for step in steps:  # the prompted, then the unprompted half: two call sites of each step
            for i in (0, 1):
                unet(sample[i : i + 1], paddle.to_tensor([999 - 99 * step]), context[i : i + 1])
    handle.remove()
    cond0, uncond0, cond1, uncond1 = seen
    assert cond1 is cond0 and uncond1 is uncond0 and uncond0 is not cond0  # each half reuses its own matching


def test_caching_changes_only_later_steps_and_stays_close_to_recomputing():
    from ppdiffusers_tome.testing import tiny_sd_pipeline

    pipe = tiny_sd_pipeline()
    vanilla = run(pipe, steps=4)
    pipe.apply_tome(ratio=0.5)
    fresh = run(pipe, steps=4)
    pipe.apply_tome(ratio=0.5, recompute_every=1)
    np.testing.assert_array_equal(run(pipe, steps=4), fresh)  # k = 1 is the paper's behaviour exactly
    pipe.apply_tome(ratio=0.5, recompute_every=4)
    cached = run(pipe, steps=4)
    stats = ppdiffusers_tome.tome_stats(pipe)["unet"]
    assert (stats["plans_computed"], stats["plans_reused"]) == (3, 9)
    assert 0 < np.abs(cached - fresh).max() and np.abs(cached - vanilla).mean() < 3 * np.abs(fresh - vanilla).mean()


# ratio schedules ----------------------------------------------------------------------------------------------------
def test_ratio_schedule_follows_the_denoising_progress():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=(0.6, 0.2))
    at = lambda t: dict(sample=sample, timestep=paddle.to_tensor([t]), encoder_hidden_states=context)  # noqa: E731
    plans = plans_seen(unet, [at(999), at(500), at(0)])
    expected = [int(256 * (0.6 + (0.2 - 0.6) * (1 - t / 1000))) for t in (999, 500, 0)]
    assert [p.r for p in plans] == expected == [153, 102, 51]


def test_ratio_schedule_can_switch_merging_off_late_and_reports_bad_values_clearly():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    at = lambda t: dict(sample=sample, timestep=paddle.to_tensor([t]), encoder_hidden_states=context)  # noqa: E731
    ppdiffusers_tome.apply_tome(unet, ratio=lambda p: 0.5 if p < 0.5 else 0.0)
    with paddle.no_grad():
        unet(**at(900))
        assert get_patch(unet).merged_blocks == 3
        unet(**at(100))
        assert get_patch(unet).merged_blocks == 0
    ppdiffusers_tome.apply_tome(unet, ratio=lambda p: 0.9 if 0.52 < p < 0.58 else 0.3)  # passes the 11 probes
    with pytest.raises(ValueError, match=r"ratio\(progress=0.550\) must be in \[0, 0.75\) for sx=2, sy=2.*got 0.9"):
        with paddle.no_grad():
            unet(**at(450))


def test_pipeline_progress_uses_its_schedulers_training_timesteps():
    from ppdiffusers import DDIMScheduler

    from ppdiffusers_tome.testing import tiny_sd_pipeline

    pipe = tiny_sd_pipeline()
    pipe.scheduler = DDIMScheduler(num_train_timesteps=500, beta_schedule="scaled_linear", clip_sample=False)
    pipe.apply_tome(ratio=(0.6, 0.0))
    patch = get_patch(pipe.unet)
    assert patch.train_timesteps == 500
    ratios = []
    handle = find_blocks(pipe.unet)[0][1].attn1.register_forward_pre_hook(
        lambda layer, args: ratios.append(patch.plan_in_flight(0).r / 256 if patch.plan_in_flight(0) else 0.0)
    )
    run(pipe, steps=2)  # DDIM with 500 training steps and 2 steps: t = 250, then 0
    handle.remove()
    assert ratios == [pytest.approx(int(256 * 0.3) / 256), 0.0]


def test_a_cached_plan_keeps_its_r_under_a_ratio_schedule_and_is_reused():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=(0.6, 0.2), recompute_every=2)
    at = lambda t: dict(sample=sample, timestep=paddle.to_tensor([t]), encoder_hidden_states=context)  # noqa: E731
    plans = plans_seen(unet, [at(t) for t in (999, 750, 500)])
    assert plans[1] is plans[0] and plans[2] is not plans[0]
    assert [p.r for p in plans] == [int(256 * (0.6 - 0.4 * 0.001)), int(256 * (0.6 - 0.4 * 0.001)), int(256 * 0.4)]


def test_a_scheduled_ratio_of_zero_turns_merging_off_even_when_a_plan_is_cached():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=lambda p: 0.5 if p < 0.5 else 0.0, recompute_every=5)
    at = lambda t: dict(sample=sample, timestep=paddle.to_tensor([t]), encoder_hidden_states=context)  # noqa: E731
    plans = plans_seen(unet, [at(t) for t in (900, 700, 100)])
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    assert plans[0] is not None and plans[1] is plans[0] and plans[2] is None  # off at t=100, cached plan or not
    assert (stats["plans_computed"], stats["plans_reused"]) == (3, 3)  # three merging blocks, at t=900 and 700


def test_direct_calls_with_the_same_timestep_are_steps_and_the_plan_cache_stays_bounded():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, recompute_every=4)
    call = dict(sample=sample, timestep=t[:1], encoder_hidden_states=context)  # a one-step model, called 20 times
    plans = plans_seen(unet, [call] * 20)
    assert model_calls(unet).position[:2] == (19, 0)  # outside a pipeline every call is a step of its own
    assert all(plans[i] is plans[i - i % 4] for i in range(20)) and len({id(p) for p in plans}) == 5
    assert len(get_patch(unet).planner.cache._plans()) == 3  # one plan per merging block and call site, not per call
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    assert (stats["plans_computed"], stats["plans_reused"]) == (5 * 3, 15 * 3)  # planned at steps 0, 4, ..., 16


def test_a_cached_plan_is_not_reused_on_another_grid_and_reset_tome_forgets_it():
    unet = tiny_unet()
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, recompute_every=10)
    wide = unet_inputs(unet, batch=1, hw=(16, 8))
    tall = unet_inputs(unet, batch=1, hw=(8, 16))
    calls = [dict(sample=s, timestep=paddle.to_tensor([t]), encoder_hidden_states=c)
             for (s, _, c), t in ((wide, 900), (tall, 800), (tall, 700))]
    first, other_grid, same_grid = plans_seen(unet, calls)
    assert other_grid is not first and same_grid is other_grid
    ppdiffusers_tome.reset_tome(unet)
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["plans_computed"] == 0
    (again,) = plans_seen(unet, calls[2:])
    assert again is not same_grid  # nothing cached any more


def test_a_ratio_schedule_warns_once_about_timesteps_outside_the_training_range():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=(0.6, 0.2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans = plans_seen(unet, [dict(sample=sample, timestep=paddle.to_tensor([t]), encoder_hidden_states=context)
                                  for t in (-3.5, 1200.0)])
    messages = [str(w.message) for w in caught if "outside [0, 1000]" in str(w.message)]
    assert len(messages) == 1 and "EDM" in messages[0]
    assert [p.r for p in plans] == [int(256 * 0.2), int(256 * 0.6)]  # clipped to the ends of the schedule


# local matching, plans shared per level, min_tokens -------------------------------------------------------
@pytest.mark.parametrize("order", ["grid", "feature"])
def test_match_window_blocks_merge_with_the_local_plan_written_by_hand(order):
    from ppdiffusers_tome.ops import LocalMergePlan, window_partition_table, window_sides

    unet = tiny_unet()
    block = find_blocks(unet)[0][1]
    rng = np.random.default_rng(5)
    x = paddle.to_tensor(rng.standard_normal((2, 256, 32)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    wy, wx = window_sides(16, 16, 8)
    partition = window_partition_table(16, 16, wy, wx, 2, 2, None, seed=0, blocks=1)[0]
    plan = LocalMergePlan.from_matching(x, (16, 16, wy, wx, 2, 2), partition, 32, order=order)  # int(64 * 0.5)
    with paddle.no_grad():
        expected = expected_block_output(block, x, context, plan).numpy()
        patch = ModelPatch.install(unet, ToMeConfig(use_rand=False, match_window=8, match_order=order))
        used = []
        handle = block.attn1.to_q.register_forward_pre_hook(lambda layer, args: used.append(patch.plan_in_flight(0)))
        with patch.in_call(paddle.zeros([2, 4, 16, 16])):
            got = block(x, encoder_hidden_states=context).numpy()
        handle.remove()
    patch.remove()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert len(used) == 1 and isinstance(used[0], LocalMergePlan)


def sd15_layout_unet():
    from ppdiffusers_tome.presets import preset_pipeline

    return preset_pipeline("sd15-narrow").unet  # SD-1.5's layout: five transformer blocks at 1x


@pytest.mark.parametrize("window, order", [(None, "grid"), (8, "grid"), (8, "feature")])
def test_share_plan_level_plans_once_per_level_and_call(window, order):
    unet = sd15_layout_unet()
    inputs = unet_inputs(unet, batch=2, hw=(16, 16))
    plans = {}
    for share in ("block", "level"):
        ppdiffusers_tome.apply_tome(unet, share_plan=share, match_window=window, match_order=order)
        patch, seen = get_patch(unet), []
        handles = [b.attn1.register_forward_pre_hook(lambda layer, args, i=i: seen.append(patch.plan_in_flight(i)))
                   for i, (_, b) in enumerate(find_blocks(unet))]
        with paddle.no_grad():
            unet(*inputs)
            unet(*inputs)
        for handle in handles:
            handle.remove()
        stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
        plans[share] = stats["plans_computed"] / stats["calls"]
        merging = [p for p in seen if p is not None]
        assert len(merging) == 10 and stats["merges"] == 10  # five 1x blocks, two calls
        if share == "level":
            assert merging[0] is merging[4] and merging[5] is merging[9] and merging[0] is not merging[5]
            assert stats["plans_shared"] == 8
    assert plans == {"block": 5.0, "level": 1.0}  # >= 2.5x fewer plans per SD-1.5 call
    ppdiffusers_tome.remove_tome(unet)


def test_share_plan_level_with_recompute_every_reuses_the_level_plan_across_steps():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, share_plan="level", recompute_every=2)
    with paddle.no_grad():
        for t in (999, 980, 960, 940):
            unet(sample, paddle.to_tensor([t, t]), context)
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    # 4 calls x 3 merging blocks: planned at steps 0 and 2, taken from the step cache at 1 and 3, shared otherwise
    assert (stats["plans_computed"], stats["plans_reused"], stats["plans_shared"]) == (2, 2, 8)


def test_min_tokens_skips_blocks_below_it_and_counts_them():
    unet = tiny_unet()
    inputs = unet_inputs(unet, batch=2, hw=(16, 16))  # 1x level: 256 tokens, batch * tokens = 512
    with paddle.no_grad():
        vanilla = unet(*inputs).sample.numpy()
        ppdiffusers_tome.apply_tome(unet, min_tokens=512)
        at_threshold = unet(*inputs).sample.numpy()
        ppdiffusers_tome.apply_tome(unet, min_tokens=513)
        above = unet(*inputs).sample.numpy()
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    assert np.abs(at_threshold - vanilla).max() > 1e-4  # 512 >= 512: merged
    np.testing.assert_array_equal(above, vanilla)  # 512 < 513: every block skipped, nothing planned
    assert stats["blocks_skipped"] == 3 and stats["plans_computed"] == 0 and stats["merges"] == 0


def test_every_call_site_of_a_step_keeps_its_own_plan_for_any_number_of_calls():
    """A panorama makes one UNet call per view and step: with nine views (more calls per step than 0.8 kept apart),
    each view reuses the plan matched on its own latents, exactly as a model that sees that view alone."""
    views, timesteps = 9, (900, 800, 700)
    unet = tiny_unet()
    ppdiffusers_tome.apply_tome(unet, recompute_every=2)
    inputs = [unet_inputs(unet, seed=view) for view in range(views)]
    outputs = {view: [] for view in range(views)}
    with denoising_loop(len(timesteps)) as steps:
        for step in steps:
            t = paddle.to_tensor([timesteps[step]] * 2, dtype="int64")
            for view, (sample, _, context) in enumerate(inputs):
                outputs[view].append(forward(unet, sample, t, context))
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    # three merging blocks: every view plans at steps 0 and 2 and reuses its own plan at step 1
    assert (stats["plans_computed"], stats["plans_reused"]) == (views * 3 * 2, views * 3)
    for view in (0, 4, 8):
        alone = tiny_unet()
        ppdiffusers_tome.apply_tome(alone, recompute_every=2)
        sample, _, context = inputs[view]
        for step, t in enumerate(timesteps):  # outside a pipeline: each call a step
            np.testing.assert_array_equal(
                outputs[view][step], forward(alone, sample, paddle.to_tensor([t, t], dtype="int64"), context))


def test_each_view_of_a_panorama_pipeline_reuses_the_plan_of_its_own_call_site():
    """StableDiffusionPanoramaPipeline makes one UNet call per view per step: under recompute_every=2 each view at
    step 1 merges with the plan its own call site made at step 0 (the views' plans differ, so another view's would
    change the image), and step 2 plans anew."""
    import inspect

    from ppdiffusers import StableDiffusionPanoramaPipeline

    from ppdiffusers_tome.testing import tiny_sd_pipeline

    parts = tiny_sd_pipeline().components
    wanted = inspect.signature(StableDiffusionPanoramaPipeline.__init__).parameters
    pipe = StableDiffusionPanoramaPipeline(**{name: part for name, part in parts.items() if name in wanted})
    pipe.apply_tome(ratio=0.5, recompute_every=2)
    patch = get_patch(pipe.unet)
    first = patch.hooked[0][0]  # the first merging block
    seen = []
    handle = find_blocks(pipe.unet)[first][1].attn1.register_forward_pre_hook(
        lambda layer, args: seen.append(patch.plan_in_flight(first)))
    # 576 px wide: the panorama's 72 latent columns (in its 8-pixel units) hold two 64-column views, 8 apart
    run(pipe, steps=3, height=32, width=576)
    handle.remove()
    assert len(seen) == 3 * 2  # (step, view): (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)
    (a0, b0), (a1, b1), (a2, b2) = seen[0:2], seen[2:4], seen[4:6]
    assert a1 is a0 and b1 is b0  # step 1: each view's own plan of step 0
    assert not np.array_equal(a0.unmerge_rows.numpy(), b0.unmerge_rows.numpy())  # the two views' plans differ
    assert all(plan not in (a0, b0) for plan in (a2, b2)) and a2 is not b2  # step 2 recomputes, per view


# the decision: a pure function, memoised by the patch; a skipped block reaches no plan code ------------------------
def decision_fields(decision):
    return {name: getattr(decision, name) for name in type(decision).__slots__}


def test_decide_is_a_pure_function_of_its_inputs():
    from ppdiffusers_tome.tome.decision import decide_block, grid_of
    from ppdiffusers_tome.tome.state import CallRecord

    unet = tiny_unet()
    patch = ModelPatch.install(unet, ToMeConfig())
    settings, counters = patch.settings, patch.counters
    call = CallRecord((16, 16), None, 1, "cpu", 0.5)
    before = (dict(vars(settings)), counters.as_dict(), dict(counters.decisions), settings.policy.warned)
    for kernels, batch in (("cpu", 2), ("gpu", 2), ("gpu", 16)):
        args = (settings, 256, batch, grid_of(settings, (16, 16), 256), 1, kernels, 0.5)
        first, second = decide_block(*args), decide_block(*args)
        assert decision_fields(first) == decision_fields(second)  # same inputs, an equal decision
    assert (dict(vars(settings)), counters.as_dict(), dict(counters.decisions), settings.policy.warned) == before
    assert (call.decisions, call.finest_level, call.merged_blocks, call.partitions) == ({}, None, 0, {})
    patch.remove()


def test_every_reason_of_decide_is_reachable():
    from ppdiffusers_tome.tome.decision import REASONS, Settings, decide_block, grid_of

    unet = tiny_unet()

    def reason(tokens=256, batch=2, kernels="cpu", ratio=0.5, latent=(16, 16), **options):
        settings = Settings(ToMeConfig(**options), unet, find_blocks(unet))
        grid = grid_of(settings, latent, tokens)
        return decide_block(settings, tokens, batch, grid, 1, kernels, ratio).reason

    found = {
        reason(merge_attn=False): "nothing",
        reason(tokens=100): "no_grid",  # 100 tokens are no level of a 16 x 16 latent
        reason(tokens=64, max_downsample=1): "level",
        reason(min_tokens=1024): "min_tokens",
        reason(tokens=4096, latent=(64, 64), kernels="gpu"): "policy",  # 512 px with one image: skipped
        reason(method="todo"): "todo",
        reason(sx=32, sy=32): "no_cell",
        reason(ratio=0.0): "ratio0",
        reason(ratio=0.001): "rounds",
        reason(): "merge",
    }
    assert all(got == wanted for got, wanted in found.items()), found
    assert set(found) == set(REASONS)


def test_a_blocks_decision_is_memoised_per_key_and_changes_with_the_ratio(monkeypatch):
    import ppdiffusers_tome.tome.runner as patch_module  # (the call runner decides and memoises)
    from ppdiffusers_tome.tome.planner import Planner

    decided, planned = [], []
    real_decide, real_plan = patch_module.decide_block, Planner.plan
    monkeypatch.setattr(patch_module, "decide_block", lambda *args: decided.append(real_decide(*args)) or decided[-1])
    monkeypatch.setattr(Planner, "plan", lambda self, decision, *args: planned.append(decision) or
                        real_plan(self, decision, *args))
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=(0.6, 0.2))
    with paddle.no_grad():
        for t in (999, 999):
            unet(sample, paddle.to_tensor([t]), context)
        assert len(decided) == 1 and len(planned) == 6  # three merging blocks, two calls: decided once
        assert all(decision is decided[0] for decision in planned)
        unet(sample, paddle.to_tensor([500]), context)  # another ratio: another key
    assert len(decided) == 2 and decided[1] is not decided[0]
    assert all(decision is decided[1] for decision in planned[6:]) and len(planned) == 9
    assert (decided[0].ratio, decided[1].ratio) == (pytest.approx(0.6 - 0.4 * 0.001), pytest.approx(0.4))


def test_a_skipped_block_call_reaches_no_plan_code(monkeypatch):
    """On GPU kernels the default policy skips blocks whose attention work is below min_work (at 512 px with one
    image, batch 2 x 4096 tokens, every block): that path runs no code of the planner, and the output is the
    vanilla UNet's. (The UNet runs at a 16 x 16 latent, skipped by the same rule, where the tiny UNet is fast.)"""
    from ppdiffusers_tome.testing import gpu_kernels
    from ppdiffusers_tome.tome.planner import Planner

    unet = tiny_unet()
    inputs = unet_inputs(unet, batch=2)
    vanilla = forward(unet, *inputs)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    patch = get_patch(unet)

    def never(*args, **kwargs):
        raise AssertionError("a skipped block reached the planner")

    for name in ("plan", "global_plan", "local_plan", "partition", "window_partition"):
        monkeypatch.setattr(Planner, name, never)
    with gpu_kernels():
        with patch.in_call(paddle.zeros([2, 4, 64, 64])) as call:  # 512 px, one image: the first block's input
            assert patch.runner.plan_block(0, paddle.zeros([2, 4096, 32]), call) is None
        outputs = [forward(unet, *inputs) for _ in range(2)]
    for output in outputs:
        np.testing.assert_array_equal(output, vanilla)
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    assert stats["blocks_skipped"] == 1 + 3 * 2 and stats["plans_computed"] == 0 and stats["merges"] == 0
    assert ppdiffusers_tome.tome_status(unet)["UNet2DConditionModel"]["policy"][4096]["action"] == "skip"


def test_the_decision_memo_stays_bounded_under_a_ratio_schedule(monkeypatch):
    """A ratio schedule makes a new memo key at every new timestep (continuous timesteps: at every call): the memo
    starts over at its bound instead of growing for as long as the model is used."""
    import ppdiffusers_tome.tome.runner as patch_module

    monkeypatch.setattr(patch_module, "MAX_DECISIONS", 2)
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=(0.6, 0.2))
    sizes = []
    with paddle.no_grad():
        for t in (999.5, 700.25, 500.125, 300.0625):
            unet(sample, paddle.to_tensor([t]), context)
            sizes.append(len(get_patch(unet).runner._decisions))
    assert sizes == [1, 2, 1, 2]

"""Model glue (ppdiffusers_tome/patch.py): hook placement, image size and timestep capture, randomness, removal."""

import warnings

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.config import ToMeConfig
from ppdiffusers_tome.merge import bipartite_soft_matching_random2d, grid_partition
from ppdiffusers_tome.patch import ModelPatch, find_blocks, get_patch
from ppdiffusers_tome.testing import tiny_sdxl_unet, tiny_unet
from tests.conftest import run


def unet_inputs(unet, batch=2, hw=(16, 16), seed=0):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((batch, 4, *hw)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((batch, 5, unet.config.cross_attention_dim)).astype("float32"))
    return sample, paddle.to_tensor([500] * batch, dtype="int64"), context


def hook_counts(layer):
    return [(len(m._forward_pre_hooks), len(m._forward_post_hooks)) for m in layer.sublayers(include_self=True)]


def expected_block_output(block, x, context, plan, merge_attn=True, merge_cross=False, merge_mlp=False):
    """BasicTransformerBlock with tomesd's placement, written out by hand: merge the normed input of a sub-layer,
    unmerge its output before the residual add."""
    identity = lambda t: t  # noqa: E731
    m, u = plan
    ma, ua = (m, u) if merge_attn else (identity, identity)
    mc, uc = (m, u) if merge_cross else (identity, identity)
    mm, um = (m, u) if merge_mlp else (identity, identity)
    x = ua(block.attn1(ma(block.norm1(x)))) + x
    x = uc(block.attn2(mc(block.norm2(x)), encoder_hidden_states=context)) + x
    return um(block.ff(mm(block.norm3(x)))) + x


@pytest.mark.parametrize("flags", [(True, False, False), (True, True, True), (False, True, False)])
def test_hooks_place_merge_and_unmerge_exactly_where_tomesd_does(flags):
    unet = tiny_unet()
    block = find_blocks(unet)[0][1]
    rng = np.random.default_rng(3)
    x = paddle.to_tensor(rng.standard_normal((2, 256, 32)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    plan = bipartite_soft_matching_random2d(x, 16, 16, 2, 2, 128, no_rand=True)
    with paddle.no_grad():
        expected = expected_block_output(block, x, context, plan, *flags).numpy()
        vanilla = block(x, encoder_hidden_states=context).numpy()
        config = ToMeConfig(use_rand=False, merge_attn=flags[0], merge_crossattn=flags[1], merge_mlp=flags[2])
        patch = ModelPatch.install(unet, config)
        patch.state.begin_call(paddle.zeros([2, 4, 16, 16]), None)
        got = block(x, encoder_hidden_states=context).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(got - vanilla).max() > 1e-3  # merging changed something
    patch.remove()


def test_sample_by_keyword_and_by_position_give_the_same_result():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    with paddle.no_grad():
        positional = unet(sample, t, context).sample.numpy()
        merges = get_patch(unet).state.merges
        keyword = unet(sample=sample, timestep=t, encoder_hidden_states=context).sample.numpy()
    assert merges > 0 and get_patch(unet).state.merges == 2 * merges
    np.testing.assert_array_equal(positional, keyword)


def test_only_blocks_at_or_below_max_downsample_merge():
    unet = tiny_unet()  # 3 blocks at 1x, 3 at 2x, 1 (the mid block) at 4x
    sample, t, context = unet_inputs(unet)
    counts = {}
    for level in (1, 2, 4):
        ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=level)
        with paddle.no_grad():
            unet(sample, t, context)
        counts[level] = get_patch(unet).state.merged_blocks
    assert counts == {1: 3, 2: 6, 4: 7}


def test_odd_latent_sizes_merge_at_every_level():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet, batch=2, hw=(9, 11))
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=8)
    with paddle.no_grad():
        out = unet(sample, t, context).sample
    assert out.shape == [2, 4, 9, 11]
    assert get_patch(unet).state.merged_blocks == 7
    assert np.isfinite(out.numpy()).all()


def test_chunked_feed_forward_is_left_alone():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, merge_mlp=True, use_rand=False)
    with paddle.no_grad():
        whole = unet(sample, t, context).sample.numpy()
        for _, block in find_blocks(unet):
            block.set_chunk_feed_forward(16, dim=1)  # chunks of 16 tokens never match the 256-token plan
        chunked = unet(sample, t, context).sample.numpy()
    assert np.isfinite(chunked).all()
    assert np.abs(whole - chunked).max() > 0  # merging was skipped for the chunked ff only


def plans_seen(unet, calls):
    """Run ``calls`` (each a kwargs dict for the UNet) and return the first block's plan object in each."""
    patch, seen = get_patch(unet), []
    handle = find_blocks(unet)[0][1].attn1.register_forward_pre_hook(lambda layer, args: seen.append(patch.plan_in_flight(0)))
    with paddle.no_grad():
        for kwargs in calls:
            unet(**kwargs)
    handle.remove()
    return seen


def dst_positions_seen(unet, calls):
    """The dst positions of the first block's plan in each of ``calls``."""
    return [plan.dst_pos.numpy() for plan in plans_seen(unet, calls)]


def test_random_partition_depends_on_timestep_not_on_call_history():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)

    def at(t):
        return dict(sample=sample, timestep=paddle.to_tensor([t]), encoder_hidden_states=context)

    first, other, again = dst_positions_seen(unet, [at(999), at(500), at(999)])
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    top_left = grid_partition(16, 16, 2, 2, no_rand=True)[1]
    assert len(first) == len(top_left) == 64 and not np.array_equal(first, top_left)


def test_separate_prompted_and_unprompted_calls_share_the_partition():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet, batch=2)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, use_rand=True)
    halves = [dict(sample=sample[i : i + 1], timestep=t[i : i + 1], encoder_hidden_states=context[i : i + 1]) for i in range(2)]
    both = dict(sample=sample, timestep=t, encoder_hidden_states=context)
    p0, p1, p01 = dst_positions_seen(unet, halves + [both])
    np.testing.assert_array_equal(p0, p1)
    np.testing.assert_array_equal(p0, p01)
    with paddle.no_grad():
        together = unet(**both).sample.numpy()
        apart = np.concatenate([unet(**h).sample.numpy() for h in halves])
    np.testing.assert_allclose(together, apart, rtol=1e-4, atol=1e-5)


def test_tome_does_not_consume_paddles_global_rng(init_image):
    from ppdiffusers_tome.testing import tiny_sd_pipeline

    pipe = tiny_sd_pipeline(scheduler="EulerAncestralDiscreteScheduler")  # draws fresh noise at every step
    seen = {}

    def record(key):
        def hook(layer, args, kwargs):
            seen.setdefault(key, []).append(args[0].numpy())

        return hook

    def generate(key):
        handle = pipe.unet.register_forward_pre_hook(record(key), with_kwargs=True)
        paddle.seed(1234)
        pipe(prompt="a cube", num_inference_steps=3, height=32, width=32, output_type="np")
        handle.remove()
        return paddle.randn([8]).numpy()  # the global stream right after the call

    after_vanilla = generate("vanilla")
    pipe.apply_tome(ratio=0.5, use_rand=True)
    after_tome = generate("tome")
    np.testing.assert_array_equal(after_vanilla, after_tome)
    np.testing.assert_array_equal(seen["vanilla"][0], seen["tome"][0])  # same initial latents


def test_two_identical_calls_give_bit_identical_images_with_use_rand():
    from ppdiffusers_tome.testing import tiny_sd_pipeline

    pipe = tiny_sd_pipeline().apply_tome(ratio=0.5, use_rand=True)
    first, second = run(pipe, steps=3), run(pipe, steps=3)
    np.testing.assert_array_equal(first, second)
    fixed = run(pipe.apply_tome(ratio=0.5, use_rand=False), steps=3)
    assert np.abs(first - fixed).max() > 0  # the random partition is really in use


def test_seed_option_changes_the_partition():
    from ppdiffusers_tome.testing import tiny_sd_pipeline

    pipe = tiny_sd_pipeline()
    a = run(pipe.apply_tome(ratio=0.5, seed=0), steps=2)
    b = run(pipe.apply_tome(ratio=0.5, seed=1), steps=2)
    assert np.abs(a - b).max() > 0


def test_every_bit_of_the_seed_changes_the_output():
    """Issue #18 item 9: seeds 0, 2**29 and 2**31 gave identical outputs (the salt repeated every 2**29)."""
    unet = tiny_unet()
    inputs = unet_inputs(unet)
    outputs = {}
    for seed in (0, 1, 2**29, 2**30, 2**31, 2**31 + 1, 2**63, 10**40):
        unet.apply_tome(ratio=0.5, seed=seed)
        with paddle.no_grad():
            outputs[seed] = unet(*inputs).sample.numpy()
    seeds = list(outputs)
    for i, a in enumerate(seeds):
        for b in seeds[i + 1:]:
            assert np.abs(outputs[a] - outputs[b]).max() > 0, (a, b)
    unet.apply_tome(ratio=0.5, seed=2**29)  # the same seed again: the same output
    with paddle.no_grad():
        np.testing.assert_array_equal(unet(*inputs).sample.numpy(), outputs[2**29])


def test_odd_batch_keeps_randomness_and_merges():
    from ppdiffusers_tome.testing import tiny_sd_pipeline

    pipe = tiny_sd_pipeline().apply_tome(ratio=0.5)
    images = run(pipe, steps=2, guidance_scale=1.0)  # no classifier-free guidance: UNet batch of 1
    assert np.isfinite(images).all()
    assert ppdiffusers_tome.tome_stats(pipe)["unet"]["merges"] == 2 * 3


def sdxl_call(unet):
    sample, t, _ = unet_inputs(unet)
    rng = np.random.default_rng(5)
    context = paddle.to_tensor(rng.standard_normal((2, 5, 64)).astype("float32"))
    added = {"text_embeds": paddle.to_tensor(rng.standard_normal((2, 32)).astype("float32")),
             "time_ids": paddle.to_tensor([[32.0, 32, 0, 0, 32, 32]] * 2)}
    return (sample, t, context), dict(added_cond_kwargs=added)


def test_sdxl_at_an_explicit_level_1_warns_once_with_advice():
    unet = tiny_sdxl_unet()
    args, kwargs = sdxl_call(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with paddle.no_grad():
            unet(*args, **kwargs)
            unet(*args, **kwargs)
    messages = [str(w.message) for w in caught if "merged no tokens" in str(w.message)]
    assert len(messages) == 1 and "max_downsample=2 (or 'auto')" in messages[0]
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=2)
    with paddle.no_grad():
        unet(*args, **kwargs)
    assert get_patch(unet).state.merged_blocks > 0


def outputs_and_merged_blocks(unet, call, **options):
    args, kwargs = call
    ppdiffusers_tome.apply_tome(unet, use_rand=False, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with paddle.no_grad():
            out = unet(*args, **kwargs).sample.numpy()
    merged = get_patch(unet).state.merged_blocks
    ppdiffusers_tome.remove_tome(unet)
    return out, merged, [w for w in caught if "merged no tokens" in str(w.message)]


def test_auto_level_merges_sdxl_at_its_2x_level_without_being_told():
    unet = tiny_sdxl_unet()  # no attention at 1x; 1 block at 2x in the down path, 2 in the up path
    call = sdxl_call(unet)
    auto, auto_blocks, warned = outputs_and_merged_blocks(unet, call)  # max_downsample="auto" is the default
    level2, level2_blocks, _ = outputs_and_merged_blocks(unet, call, max_downsample=2)
    assert auto_blocks == level2_blocks == 3 and not warned
    np.testing.assert_array_equal(auto, level2)
    level4, level4_blocks, _ = outputs_and_merged_blocks(unet, call, max_downsample=4)
    assert level4_blocks > auto_blocks and np.abs(level4 - auto).max() > 0


def test_auto_level_on_the_sd_layout_is_level_1():
    unet = tiny_unet()
    call = (unet_inputs(unet), {})
    auto, auto_blocks, _ = outputs_and_merged_blocks(unet, call, max_downsample="auto")
    level1, level1_blocks, _ = outputs_and_merged_blocks(unet, call, max_downsample=1)
    assert auto_blocks == level1_blocks == 3
    np.testing.assert_array_equal(auto, level1)


# ToDo ---------------------------------------------------------------------------------------------------------------
def expected_todo_block_output(block, x, context, h, w, factor, mode):
    """BasicTransformerBlock with ToDo written out by hand: self-attention's keys/values from the downsampled
    normed tokens, every query kept, nothing else changed."""
    from tests.numpy_reference import reference_downsample

    n = block.norm1(x)
    kv = paddle.to_tensor(reference_downsample(n.numpy(), h, w, factor, mode).astype("float32"))
    x = block.attn1(n, encoder_hidden_states=kv) + x
    x = block.attn2(block.norm2(x), encoder_hidden_states=context) + x
    return block.ff(block.norm3(x)) + x


@pytest.mark.parametrize("factor, mode", [(2, "nearest"), (2, "average"), (4, "average")])
def test_todo_downsamples_only_the_keys_and_values_of_self_attention(factor, mode):
    unet = tiny_unet()
    block = find_blocks(unet)[0][1]
    rng = np.random.default_rng(11)
    x = paddle.to_tensor(rng.standard_normal((2, 256, 32)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    with paddle.no_grad():
        expected = expected_todo_block_output(block, x, context, 16, 16, factor, mode).numpy()
        vanilla = block(x, encoder_hidden_states=context).numpy()
        patch = ModelPatch.install(unet, ToMeConfig(method="todo", downsample_factor=factor, downsample_mode=mode))
        patch.state.begin_call(paddle.zeros([2, 4, 16, 16]), None)
        got = block(x, encoder_hidden_states=context).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(got - vanilla).max() > 1e-3
    patch.remove()


def test_todo_hooks_only_self_attention_inputs_and_never_matches():
    unet = tiny_unet()
    before = hook_counts(unet)
    ppdiffusers_tome.apply_tome(unet, method="todo")
    block = find_blocks(unet)[0][1]
    assert (len(block.attn1._forward_pre_hooks), len(block.attn1._forward_post_hooks)) == (1, 0)
    assert not block.attn2._forward_pre_hooks and not block.ff._forward_pre_hooks
    keys = []
    handle = block.attn1.register_forward_pre_hook(
        lambda layer, args, kwargs: keys.append(kwargs["encoder_hidden_states"].shape[1]), with_kwargs=True
    )
    with paddle.no_grad():
        unet(*unet_inputs(unet))
    handle.remove()
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    assert keys == [64] and stats["merges"] == 3 and stats["plans_computed"] == 0  # 256 queries, 64 keys
    ppdiffusers_tome.remove_tome(unet)
    assert hook_counts(unet) == before


def test_todo_composes_with_the_efficient_attention_processor(monkeypatch):
    """ppdiffusers' XFormersAttnProcessor calls F.scaled_dot_product_attention_, which Paddle's CPU build lacks; a
    plain implementation of the same contract stands in, so the processor path itself runs with fewer keys."""
    from ppdiffusers.models.attention_processor import AttnProcessor, XFormersAttnProcessor

    seen = []

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, training=False,
             attention_op=None):  # [batch, tokens, heads, head_dim], as ppdiffusers passes them
        seen.append((query.shape[1], key.shape[1]))
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (query, key, value))
        weights = paddle.nn.functional.softmax(paddle.matmul(q * scale, k, transpose_y=True), axis=-1)
        return paddle.matmul(weights, v).transpose([0, 2, 1, 3])

    monkeypatch.setattr(paddle.nn.functional, "scaled_dot_product_attention_", sdpa, raising=False)
    unet = tiny_unet()
    inputs = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, method="todo", downsample_mode="average")
    with paddle.no_grad():
        plain = unet(*inputs).sample.numpy()
        unet.set_attn_processor(XFormersAttnProcessor())
        efficient = unet(*inputs).sample.numpy()
        unet.set_attn_processor(AttnProcessor())
    assert (256, 64) in seen and (256, 256) not in seen  # the first level's self-attention ran on 64 keys
    np.testing.assert_allclose(efficient, plain, rtol=1e-4, atol=1e-5)


# plan caching -------------------------------------------------------------------------------------------------------


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
    plans = plans_seen(unet, [at(t) for t in (900, 700, 500, 300, 100)] + [at(900), at(700)])
    assert plans[0] is plans[1] is plans[2] and plans[3] is plans[4] and plans[3] is not plans[0]
    assert plans[5] is not plans[4] and plans[6] is plans[5]  # t went back up: a new generation starts at step 0
    np.testing.assert_array_equal(plans[5].dst_pos.numpy(), plans[0].dst_pos.numpy())  # same timestep, same draw


def test_plan_cache_keeps_the_two_halves_of_split_guidance_apart():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=2)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, recompute_every=2)
    calls = [dict(sample=sample[i : i + 1], timestep=paddle.to_tensor([t]), encoder_hidden_states=context[i : i + 1])
             for t in (999, 900) for i in (0, 1)]
    cond0, uncond0, cond1, uncond1 = plans_seen(unet, calls)
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
        assert get_patch(unet).state.merged_blocks == 3
        unet(**at(100))
        assert get_patch(unet).state.merged_blocks == 0
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


def test_remove_restores_hook_tables_and_attributes():
    unet = tiny_unet()
    before_hooks = hook_counts(unet)
    before_attrs = {id(m): set(m.__dict__) for m in unet.sublayers(include_self=True)}
    sublayers = {name: id(m) for name, m in unet.named_sublayers(include_self=True)}
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    assert hook_counts(unet) != before_hooks
    ppdiffusers_tome.remove_tome(unet)
    assert hook_counts(unet) == before_hooks
    assert {id(m): set(m.__dict__) for m in unet.sublayers(include_self=True)} == before_attrs
    assert {name: id(m) for name, m in unet.named_sublayers(include_self=True)} == sublayers
    assert all(type(m).__name__ == "BasicTransformerBlock" for _, m in find_blocks(unet))


def test_an_error_inside_a_patched_forward_leaves_the_model_usable():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    with pytest.raises(Exception):
        with paddle.no_grad():
            unet(sample, t, paddle.randn([2, 5, 7]))  # wrong context width fails inside attn2
    assert all(get_patch(unet).plan_in_flight(i) is None for i in range(len(get_patch(unet).blocks)))
    with paddle.no_grad():
        out = unet(sample, t, context).sample
    assert np.isfinite(out.numpy()).all()


def test_unknown_timestep_falls_back_to_call_count():
    unet = tiny_unet()
    patch = ModelPatch.install(unet, ToMeConfig())
    state = patch.state
    state.begin_call(paddle.zeros([1, 4, 8, 8]), None)
    a = patch.planner.partition(0, 8, 8).numpy()
    state.end_call()
    state.begin_call(paddle.zeros([1, 4, 8, 8]), None)
    b = patch.planner.partition(0, 8, 8).numpy()
    state.end_call()
    assert not np.array_equal(a, b) and state.calls == 2
    assert sorted(a.tolist()) == list(range(64))
    state.reset()
    assert state.calls == 0 and state.latent_hw is None


# lifecycle: copies, many cycles, threads, changes mid-generation ---------------------------------------------------
def test_deepcopy_of_a_patched_model_is_patched_independently():
    import copy

    unet = tiny_unet()
    inputs = unet_inputs(unet)
    with paddle.no_grad():
        vanilla = unet(*inputs).sample.numpy()
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    with paddle.no_grad():
        merged = unet(*inputs).sample.numpy()
    twin = copy.deepcopy(unet)
    assert get_patch(twin) is not None and get_patch(twin) is not get_patch(unet) and get_patch(twin).model is twin
    with paddle.no_grad():
        np.testing.assert_array_equal(twin(*inputs).sample.numpy(), merged)
    ppdiffusers_tome.remove_tome(twin)
    with paddle.no_grad():
        np.testing.assert_array_equal(twin(*inputs).sample.numpy(), vanilla)
        np.testing.assert_array_equal(unet(*inputs).sample.numpy(), merged)  # the original is still patched
    ppdiffusers_tome.remove_tome(unet)
    assert hook_counts(twin) == hook_counts(unet) == hook_counts(tiny_unet())


def test_many_apply_remove_cycles_leave_nothing_behind():
    import gc
    import weakref

    from ppdiffusers_tome.tools.measure import _rss_bytes

    unet = tiny_unet()
    inputs = unet_inputs(unet)
    before_hooks = hook_counts(unet)
    before_attrs = {id(m): set(m.__dict__) for m in unet.sublayers(include_self=True)}
    patches = []
    with paddle.no_grad():
        for cycle in range(200):
            if cycle == 20:
                gc.collect()
                rss_start = _rss_bytes()
            ppdiffusers_tome.apply_tome(unet, ratio=0.5, merge_mlp=cycle % 2 == 0)
            if cycle % 50 == 0:
                unet(*inputs)
            patches.append(weakref.ref(get_patch(unet)))
            ppdiffusers_tome.remove_tome(unet)
    gc.collect()
    assert hook_counts(unet) == before_hooks
    assert {id(m): set(m.__dict__) for m in unet.sublayers(include_self=True)} == before_attrs
    assert all(ref() is None for ref in patches)  # every patch object was freed
    assert _rss_bytes() - rss_start < 32 * 2**20


def test_two_models_with_different_settings_in_two_threads_do_not_mix():
    import threading

    unets = [tiny_unet(seed=0), tiny_unet(seed=1)]
    inputs = [unet_inputs(u, seed=i) for i, u in enumerate(unets)]
    for unet, ratio in zip(unets, (0.3, 0.6)):
        ppdiffusers_tome.apply_tome(unet, ratio=ratio, use_rand=True)
    with paddle.no_grad():
        expected = [u(*x).sample.numpy() for u, x in zip(unets, inputs)]
    results = {0: [], 1: []}

    def work(k):
        with paddle.no_grad():
            for _ in range(4):
                results[k].append(unets[k](*inputs[k]).sample.numpy())

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in (0, 1):
        assert len(results[k]) == 4
        for out in results[k]:
            np.testing.assert_array_equal(out, expected[k])


def test_one_model_called_from_two_threads_gives_each_call_its_own_plans():
    import threading

    unet = tiny_unet()
    inputs = [unet_inputs(unet, batch=2, seed=0), unet_inputs(unet, batch=1, hw=(12, 10), seed=1)]
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=2)
    with paddle.no_grad():
        expected = [unet(*x).sample.numpy() for x in inputs]
    results, errors = {0: [], 1: []}, []

    def work(k):
        try:
            with paddle.no_grad():
                for _ in range(4):
                    results[k].append(unet(*inputs[k]).sample.numpy())
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in (0, 1):
        for out in results[k]:
            np.testing.assert_array_equal(out, expected[k])


def test_apply_and_remove_from_a_step_callback_take_effect_at_the_next_step():
    from ppdiffusers_tome.testing import tiny_sd_pipeline

    pipe = tiny_sd_pipeline()
    log = []

    def callback(pipeline, step, timestep, kwargs):
        if step == 0:
            pipeline.apply_tome(ratio=0.5)
        if step == 2:
            log.append(dict(ppdiffusers_tome.tome_stats(pipeline)["unet"]))
            pipeline.remove_tome()
        return kwargs

    run(pipe, steps=5, callback_on_step_end=callback)
    expected = {"blocks": 7, "calls": 2, "merges": 6, "plans_computed": 6, "plans_reused": 0, "plans_shared": 0, "blocks_skipped": 0}
    assert log == [expected]  # steps 1 and 2 merged, 3 blocks each
    assert get_patch(pipe.unet) is None


def test_a_failing_merged_sublayer_leaves_no_silenced_hook_error():
    unet = tiny_unet()
    sample, t, _ = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, merge_crossattn=True)  # attn2 input is merged, then attn2 fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception) as raised:
            with paddle.no_grad():
                unet(sample, t, paddle.randn([2, 5, 7]))
    assert "NoneType" not in str(raised.value)
    assert not [w for w in caught if "NoneType" in str(w.message) or "silenced" in str(w.message).lower()]


def test_call_state_is_cleared_after_each_call():
    unet = tiny_unet()
    inputs = unet_inputs(unet)
    patch = ModelPatch.install(unet, ToMeConfig(ratio=0.5))
    with paddle.no_grad():
        unet(*inputs)
        merges = patch.state.merges
        block = find_blocks(unet)[0][1]
        block(paddle.randn([2, 256, 32]), encoder_hidden_states=inputs[2])  # outside any model call: no merging
    assert patch.state.latent_hw is None and patch.state.merges == merges
    assert patch.state.merged_blocks == 3  # the report of the last call survives


def test_installing_over_an_existing_patch_leaves_no_orphan_hooks():
    once, twice = tiny_unet(), tiny_unet()
    ModelPatch.install(once, ToMeConfig())
    first = ModelPatch.install(twice, ToMeConfig())
    second = ModelPatch.install(twice, ToMeConfig(ratio=0.3))
    assert hook_counts(once) == hook_counts(twice) and get_patch(twice) is second and not first.blocks
    second.remove()
    assert hook_counts(twice) == hook_counts(tiny_unet())


def test_a_cached_plan_keeps_its_r_under_a_ratio_schedule_and_is_reused():
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=(0.6, 0.2), recompute_every=2)
    at = lambda t: dict(sample=sample, timestep=paddle.to_tensor([t]), encoder_hidden_states=context)  # noqa: E731
    plans = plans_seen(unet, [at(t) for t in (999, 750, 500)])
    assert plans[1] is plans[0] and plans[2] is not plans[0]
    assert [p.r for p in plans] == [int(256 * (0.6 - 0.4 * 0.001)), int(256 * (0.6 - 0.4 * 0.001)), int(256 * 0.4)]


def test_plan_cache_stays_bounded_when_every_call_has_the_same_timestep():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, recompute_every=4)
    call = dict(sample=sample, timestep=t[:1], encoder_hidden_states=context)  # a one-step model, called 20 times
    plans_seen(unet, [call] * 20)
    cache = get_patch(unet).state.history.cache
    assert 0 < len(cache) <= 3 * get_patch(unet).state.history.MAX_SLOTS


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


def test_ratio_zero_never_warns_about_merging_nothing():
    unet = tiny_sdxl_unet()
    args, kwargs = sdxl_call(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.0, max_downsample=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with paddle.no_grad():
            unet(*args, **kwargs)
    assert not [w for w in caught if "merged no tokens" in str(w.message)]


# issue #17: local matching, plans shared per level, min_tokens -------------------------------------------------------
@pytest.mark.parametrize("order", ["grid", "feature"])
def test_match_window_blocks_merge_with_the_local_plan_written_by_hand(order):
    from ppdiffusers_tome.merge import LocalMergePlan, window_partition_table, window_sides

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
        patch.state.begin_call(paddle.zeros([2, 4, 16, 16]), None)
        got = block(x, encoder_hidden_states=context).numpy()
        used = patch.plan_in_flight(0)
    patch.remove()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert used is None or isinstance(used, LocalMergePlan)  # (the block's post-hook has already dropped it)


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
    assert plans == {"block": 5.0, "level": 1.0}  # issue #17: >= 2.5x fewer plans per SD-1.5 call
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

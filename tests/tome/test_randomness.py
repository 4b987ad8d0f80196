"""ToMe's own randomness: the partition is a function of (seed, block, grid, timestep), never of the call history
or of Paddle's global RNG, so identical calls give identical images and both halves of guidance share it."""

import numpy as np
import paddle

import ppdiffusers_tome
from ppdiffusers_tome.ops import grid_partition
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.config import ToMeConfig
from ppdiffusers_tome.tome.patch import ModelPatch
from tests.conftest import run
from tests.unet_calls import dst_positions_seen, unet_inputs


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
    """Seeds 0, 2**29 and 2**31 differ (a salt made from the low 29 bits alone would repeat every 2**29)."""
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


def test_unknown_timestep_falls_back_to_call_count():
    unet = tiny_unet()
    patch = ModelPatch.install(unet, ToMeConfig())
    partitions = []
    for _ in range(2):
        with patch.in_call(paddle.zeros([1, 4, 8, 8]), None) as call:  # no timestep: the call's number keys it
            partitions.append(patch.planner.partition(0, 8, 8, call).numpy())
    a, b = partitions
    assert not np.array_equal(a, b) and patch.counters.calls == 2
    assert sorted(a.tolist()) == list(range(64))
    patch.reset()  # the calls are counted from the reset again: the first call's partition comes back
    assert patch.counters.calls == 0 and patch.local.call is None
    with patch.in_call(paddle.zeros([1, 4, 8, 8]), None) as call:
        np.testing.assert_array_equal(patch.planner.partition(0, 8, 8, call).numpy(), a)
    patch.remove()

"""Faults and recovery: reset_tome never disturbs a call in flight, a generation retried after a fault matches a
fresh model, an early exception spends no warning, changes refuse while a forward runs, a NaN timestep is a clear
error."""

# items 1, 5, 6, 7, 9: threads, a retry after a fault, early exceptions, non-finite timesteps ----------------------
import pickle
import threading
import warnings  # noqa: E402

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import (
    tiny_sdxl_unet,  # noqa: E402
    tiny_unet,
)
from ppdiffusers_tome.tome.patch import (
    find_blocks,
    get_patch,
)
from tests.unet_calls import (
    call_held_inside_forward,
    forward,
    hook_tables,
    sdxl_call,
    unet_inputs,
    unet_output,
)


def test_hooks_registered_after_unpickling_in_a_fresh_process_do_not_collide(monkeypatch):
    from paddle.nn.layer.layers import HookRemoveHelper

    unet = tiny_unet()
    vanilla = unet_output(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    patched = unet_output(unet)
    data = pickle.dumps(unet)
    # a spawned worker that has registered no hook so far: Paddle's hook ids start again from 0 there
    monkeypatch.setattr(HookRemoveHelper, "next_hook_id", 0)
    twin = pickle.loads(data)
    assert not [m for m in twin.sublayers(include_self=True) if m._forward_pre_hooks or m._forward_post_hooks]
    seen = []
    twin.register_forward_pre_hook(lambda *args: seen.append("model"))
    find_blocks(twin)[0][1].attn1.register_forward_pre_hook(lambda *args: seen.append("attn1"))  # a hooked layer
    np.testing.assert_array_equal(unet_output(twin), patched)  # ToMe's hooks and the user's both run
    assert seen == ["model", "attn1"]
    ppdiffusers_tome.remove_tome(twin)  # takes off ToMe's hooks only
    np.testing.assert_array_equal(unet_output(twin), vanilla)
    assert seen == ["model", "attn1"] * 2


def test_reset_tome_does_not_disturb_a_call_in_flight_in_another_thread():
    unet = tiny_unet()
    vanilla = unet_output(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, seed=3)
    patched = unet_output(unet)
    assert np.abs(patched - vanilla).max() > 1e-4  # ToMe is active
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["calls"] == 1
    with call_held_inside_forward(unet) as result:
        ppdiffusers_tome.reset_tome(unet)
        stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
        assert stats["calls"] == stats["merges"] == stats["plans_computed"] == stats["plans_reused"] == 0
    np.testing.assert_array_equal(result["output"], patched)
    assert get_patch(unet).calls_in_flight() == 0
    np.testing.assert_array_equal(unet_output(unet), patched)  # and later calls are as before


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_a_generation_retried_after_a_fault_matches_a_fresh_model(fault):
    """A pipeline call that fails (or is interrupted) inside the UNet at its second step, after the first step kept
    its plans: the next pipeline call is a new generation by itself (no reset_tome), as on a fresh pipeline."""
    from ppdiffusers_tome.testing import tiny_sd_pipeline
    from tests.conftest import run

    fresh = tiny_sd_pipeline().apply_tome(ratio=0.5, recompute_every=3)
    expected = run(fresh, steps=4, seed=1)

    pipe = tiny_sd_pipeline().apply_tome(ratio=0.5, recompute_every=3)
    calls = []

    def fail_at_the_second_step(layer, inputs):
        calls.append(1)
        if len(calls) == 2:
            raise fault("simulated fault late in the forward")

    handle = pipe.unet.conv_out.register_forward_pre_hook(fail_at_the_second_step)
    try:
        with pytest.raises(fault):
            run(pipe, steps=4, seed=0)  # other latents than the retry's
    finally:
        handle.remove()
    assert len(calls) == 2 and get_patch(pipe.unet).calls_in_flight() == 0
    retried = run(pipe, steps=4, seed=1)
    np.testing.assert_array_equal(retried, expected)
    assert ppdiffusers_tome.tome_stats(pipe)["unet"]["plans_reused"] > 0  # the cache is in use


def test_an_exception_before_any_block_neither_warns_nor_spends_the_warning():
    unet = tiny_sdxl_unet()
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=1)  # its finest transformer level is 2
    (sample, t, context), kwargs = sdxl_call()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with paddle.no_grad():
            with pytest.raises(Exception):
                unet(sample[:, :3], t, context, **kwargs)  # conv_in wants 4 channels
    assert not [w for w in caught if "ToMe" in str(w.message)], [str(w.message) for w in caught]
    assert get_patch(unet).calls_in_flight() == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with paddle.no_grad():
            unet(sample, t, context, **kwargs)  # a genuine case of merging nothing
    assert len([w for w in caught if "merged no tokens" in str(w.message)]) == 1


def test_remove_and_apply_refuse_while_another_thread_is_inside_a_forward():
    unet = tiny_unet()
    vanilla = unet_output(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, seed=3)
    patch = get_patch(unet)
    patched = unet_output(unet)
    assert np.abs(patched - vanilla).max() > 1e-4
    with call_held_inside_forward(unet) as result:
        hooks = hook_tables(unet)  # ToMe's and the test's own hold hook
        with pytest.raises(RuntimeError, match="running in other threads"):
            ppdiffusers_tome.remove_tome(unet)
        with pytest.raises(RuntimeError, match="running in other threads"):
            ppdiffusers_tome.apply_tome(unet, ratio=0.3)
        assert get_patch(unet) is patch and ppdiffusers_tome.tome_config(unet).ratio == 0.5
        assert hook_tables(unet) == hooks  # no hook taken off, added or swapped
    np.testing.assert_array_equal(result["output"], patched)
    ppdiffusers_tome.remove_tome(unet)
    assert get_patch(unet) is None
    np.testing.assert_array_equal(unet_output(unet), vanilla)


def test_a_nan_timestep_with_a_ratio_schedule_raises_and_leaves_the_model_working():
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=(0.6, 0.3))
    expected = unet_output(ppdiffusers_tome.apply_tome(tiny_unet(), ratio=(0.6, 0.3)))
    sample, _, context = unet_inputs(unet)
    with pytest.raises(ValueError, match="not finite"):
        with paddle.no_grad():
            unet(sample, paddle.to_tensor([float("nan")] * 2), context)
    assert get_patch(unet).calls_in_flight() == 0
    np.testing.assert_array_equal(unet_output(unet), expected)


OPTIONS_ACROSS_STEPS = [dict(recompute_every=3), dict(recompute_every=3, ratio=(0.6, 0.3)),
                        dict(recompute_every=3, share_plan="level"),
                        dict(recompute_every=3, match_window=8, match_order="feature")]


def generation(unet, timesteps, seed=0):
    """One UNet call per timestep on fixed inputs, as a sampler makes them."""
    sample, _, context = unet_inputs(unet, seed=seed)
    return [forward(unet, sample, paddle.to_tensor([t, t], dtype="int64"), context) for t in timesteps]


@pytest.mark.parametrize("reset_from", ["this thread", "another thread"])
@pytest.mark.parametrize("options", OPTIONS_ACROSS_STEPS, ids=["k=3", "schedule", "shared", "feature"])
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_reset_tome_after_an_interrupted_generation_gives_a_fresh_models_output(options, reset_from, interrupt):
    unet, fresh = tiny_unet(), tiny_unet()
    ppdiffusers_tome.apply_tome(unet, **options)
    ppdiffusers_tome.apply_tome(fresh, **options)
    calls = []

    def ctrl_c(layer, args):  # Ctrl-C inside the UNet's third call, after its blocks planned
        calls.append(1)
        if len(calls) == 3:
            raise interrupt()

    handle = unet.conv_out.register_forward_pre_hook(ctrl_c)
    with pytest.raises(interrupt):
        generation(unet, [900, 800, 700])
    handle.remove()
    if reset_from == "this thread":
        ppdiffusers_tome.reset_tome(unet)
    else:
        worker = threading.Thread(target=ppdiffusers_tome.reset_tome, args=(unet,))
        worker.start()
        worker.join()
    # a new generation that starts where the interrupted one stopped (img2img from a lower noise level): only the
    # reset tells it from a continuation, and after it the model must behave as a fresh one
    got, expected = generation(unet, [700, 600, 500], seed=1), generation(fresh, [700, 600, 500], seed=1)
    for a, b in zip(got, expected):
        assert float(np.abs(a - b).max()) == 0.0  # bit-identical to a fresh model
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    assert stats["plans_computed"] == ppdiffusers_tome.tome_stats(fresh)["UNet2DConditionModel"]["plans_computed"] > 0

"""Lifecycle of a patch under concurrency and interruption: apply/remove from many threads at once,
Ctrl-C / SystemExit inside a forward, shallow copies, a model called inside its own forward, and remove_tome from
inside the model's own forward."""

import copy
import sys
import threading
import warnings

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.core.registry import KEY, original_class
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.patch import find_blocks, get_patch
from tests.unet_calls import hooks_attached, step_sample, unet_inputs, unet_output


@pytest.fixture
def busy_switching():
    """Let threads switch every few microseconds, so that races show up within a short test."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def hook_count(model):
    """Hooks attached to ``model`` and its sub-layers (this package's registry and Paddle's hook tables)."""
    return hooks_attached(model)


def untouched(model):
    """Whether ``model`` and every sub-layer have their own class again and carry no attribute of this package."""
    return all(original_class(m) is type(m) and KEY not in m.__dict__ for m in model.sublayers(include_self=True))


# apply and remove are atomic per model ----------------------------------------------------------------------
def test_threads_applying_and_removing_at_once_leave_one_consistent_patch(busy_switching):
    unet = tiny_unet()
    vanilla, vanilla_hooks = unet_output(unet), hook_count(unet)
    expected = {}
    for ratio in (0.3, 0.6):
        ppdiffusers_tome.apply_tome(unet, ratio=ratio)
        expected[ratio] = unet_output(unet)
        one_patch = hook_count(unet)
        ppdiffusers_tome.remove_tome(unet)
    assert one_patch > vanilla_hooks and np.abs(expected[0.3] - expected[0.6]).max() > 1e-4
    start, errors, rounds = threading.Barrier(4), [], 150

    def work(action):
        start.wait()
        try:
            for _ in range(rounds):
                action()
        except BaseException as error:  # reported below
            errors.append(error)

    actions = [
        lambda: ppdiffusers_tome.apply_tome(unet, ratio=0.3),
        lambda: ppdiffusers_tome.apply_tome(unet, ratio=0.6),
        lambda: ppdiffusers_tome.remove_tome(unet),
        lambda: ppdiffusers_tome.remove_tome(unet),  # two removes at once raised IndexError
    ]
    threads = [threading.Thread(target=work, args=(action,)) for action in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    config = ppdiffusers_tome.tome_config(unet)
    if config is None:  # a remove came last
        assert get_patch(unet) is None and hook_count(unet) == vanilla_hooks
    else:  # exactly one patch, and it is the one tome_config reports
        assert hook_count(unet) == one_patch
        np.testing.assert_array_equal(unet_output(unet), expected[config.ratio])
    for ratio in (0.6, 0.3):  # and the model goes on working as usual
        ppdiffusers_tome.apply_tome(unet, ratio=ratio)
        assert hook_count(unet) == one_patch
        np.testing.assert_array_equal(unet_output(unet), expected[ratio])
    ppdiffusers_tome.remove_tome(unet)
    assert get_patch(unet) is None and ppdiffusers_tome.tome_config(unet) is None
    assert hook_count(unet) == vanilla_hooks and not any(k.startswith("_ppdiffusers_tome") for k in unet.__dict__)
    assert untouched(unet)
    np.testing.assert_array_equal(unet_output(unet), vanilla)


# KeyboardInterrupt / SystemExit inside a forward ------------------------------------------------------------
def interrupt_inside_forward(unet, error, seed=99):
    """Call ``unet`` and raise ``error`` from inside its first transformer block (after attn1 ran on merged tokens),
    the way Ctrl-C lands in a notebook."""

    def interrupt(layer, inputs):
        raise error()

    handle = find_blocks(unet)[0][1].attn2.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(error):
            with paddle.no_grad():
                unet(step_sample(seed), paddle.to_tensor([999, 999]), unet_inputs(unet)[2])
    finally:
        handle.remove()


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_a_forward_ends_the_call(error):
    timesteps = [999, 800, 600, 400]
    context = unet_inputs(tiny_unet())[2]

    def generation(unet):
        with paddle.no_grad():
            return [unet(step_sample(10 + i), paddle.to_tensor([t, t]), context).sample.numpy()
                    for i, t in enumerate(timesteps)]

    expected = generation(ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5, recompute_every=2))
    unet = tiny_unet()
    vanilla, vanilla_hooks = unet_output(unet), hook_count(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, recompute_every=2)
    patch = get_patch(unet)

    interrupt_inside_forward(unet, error)
    assert patch.calls_in_flight() == 0
    # outside a pipeline every call is a step: reset_tome starts the new generation (a pipeline call does it alone,
    # see test_faults.py), which then runs as on a fresh model, cached plans and all
    ppdiffusers_tome.reset_tome(unet)
    retried = generation(unet)
    for got, want in zip(retried, expected):
        np.testing.assert_array_equal(got, want)
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["plans_reused"] > 0

    for _ in range(3):  # interrupts do not pile up: another thread may take ToMe off afterwards
        interrupt_inside_forward(unet, error)
    assert patch.calls_in_flight() == 0
    outcome = []
    remover = threading.Thread(target=lambda: outcome.append(ppdiffusers_tome.remove_tome(unet)))
    remover.start()
    remover.join(60)
    assert len(outcome) == 1 and outcome[0] is unet and get_patch(unet) is None
    assert hook_count(unet) == vanilla_hooks and untouched(unet)
    np.testing.assert_array_equal(unet_output(unet), vanilla)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("at", [1, 2], ids=["reusing-step", "recompute-step"])
def test_a_call_that_did_not_finish_is_not_a_step(error, at):
    """Outside a pipeline every call is a step, but a call ended by Ctrl-C or an error is not one: the retried step
    and the steps after it get the plans a model never interrupted gets (the interrupted call ran on other latents
    at another timestep, so a plan it kept would show). Ctrl-C once counted as a finished step."""
    timesteps = [999, 800, 600, 400]
    context = unet_inputs(tiny_unet())[2]

    def step(unet, i):
        with paddle.no_grad():
            return unet(step_sample(10 + i), paddle.to_tensor([timesteps[i]] * 2), context).sample.numpy()

    fresh = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5, recompute_every=2)
    expected = [step(fresh, i) for i in range(4)]
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5, recompute_every=2)
    got = [step(unet, i) for i in range(at)]
    interrupt_inside_forward(unet, error)  # (after the first block planned)
    got += [step(unet, i) for i in range(at, 4)]
    for i, (a, b) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
    stats, reference = (ppdiffusers_tome.tome_stats(m)["UNet2DConditionModel"] for m in (unet, fresh))
    # the interrupted call's first block planned anew at a recompute step, else it reused step 0's plan
    assert (stats["plans_computed"] - reference["plans_computed"], stats["plans_reused"] - reference["plans_reused"]) \
        == ((1, 0) if at == 2 else (0, 1))


def test_a_call_held_in_another_thread_is_still_counted_in_flight():
    from tests.unet_calls import call_held_inside_forward

    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5)
    patch = get_patch(unet)
    interrupt_inside_forward(unet, KeyboardInterrupt)  # a leaked call of this thread must not hide a live one
    with call_held_inside_forward(unet):
        assert patch.calls_in_flight() == 1
        with pytest.raises(RuntimeError, match="1 forward call"):
            ppdiffusers_tome.remove_tome(unet)
    assert patch.calls_in_flight() == 0


# shallow copies ---------------------------------------------------------------------------------------------
def test_a_shallow_copy_shares_the_patch_consistently():
    unet = tiny_unet()
    vanilla, vanilla_hooks, attrs = unet_output(unet), hook_count(unet), set(unet.__dict__)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    merged = unet_output(unet)
    twin = copy.copy(unet)  # shares the sub-layers and hooks with unet: one model under two names
    assert get_patch(twin) is get_patch(unet) and type(twin) is type(unet)
    np.testing.assert_array_equal(unet_output(twin), merged)

    ppdiffusers_tome.remove_tome(twin)  # used to take ToMe off unet while twin still reported it
    assert ppdiffusers_tome.tome_config(unet) is None and ppdiffusers_tome.tome_config(twin) is None
    for model in (unet, twin):
        assert ppdiffusers_tome.tome_status(model)["UNet2DConditionModel"]["active"] is None
        np.testing.assert_array_equal(unet_output(model), vanilla)
        assert untouched(model)  # neither name keeps a hooked class or the registry
    assert hook_count(unet) == vanilla_hooks

    ppdiffusers_tome.apply_tome(twin, ratio=0.3)
    assert ppdiffusers_tome.tome_config(unet).ratio == 0.3 and get_patch(unet) is get_patch(twin)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    assert ppdiffusers_tome.tome_config(twin).ratio == 0.5 and get_patch(unet) is get_patch(twin)
    assert hook_count(unet) == hook_count(twin) and hook_count(unet) > vanilla_hooks
    np.testing.assert_array_equal(unet_output(twin), merged)

    ppdiffusers_tome.remove_tome(unet)
    assert ppdiffusers_tome.tome_config(twin) is None and get_patch(twin) is None
    assert hook_count(twin) == vanilla_hooks and set(unet.__dict__) == attrs == set(twin.__dict__)
    assert untouched(unet) and untouched(twin)
    np.testing.assert_array_equal(unet_output(twin), vanilla)

    deep = copy.deepcopy(ppdiffusers_tome.apply_tome(unet, ratio=0.5))  # a deep copy stays independent
    ppdiffusers_tome.remove_tome(unet)
    assert ppdiffusers_tome.tome_config(deep).ratio == 0.5 and get_patch(twin) is None
    np.testing.assert_array_equal(unet_output(deep), merged)

    from ppdiffusers_tome.cache.step_cache import (
        get_cache,  # the step cache attaches the same way: shared by both names
    )

    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    third = copy.copy(unet)
    ppdiffusers_tome.apply_cache(third, interval=2)
    assert get_cache(unet) is get_cache(third) is get_cache(twin) is not None
    ppdiffusers_tome.remove_tome(twin)
    assert get_patch(third) is None and get_cache(unet) is get_cache(third)
    ppdiffusers_tome.remove_cache(unet)
    assert all(untouched(model) and get_cache(model) is None for model in (unet, twin, third))
    np.testing.assert_array_equal(unet_output(third), vanilla)


# the model called inside its own forward ----------------------------------------------------------------------
def test_a_call_inside_the_models_own_forward_keeps_tome_in_both():
    unet = tiny_unet()
    vanilla = unet_output(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    outer_expected, inner_expected = unet_output(unet, seed=0), unet_output(unet, seed=1)
    assert np.abs(outer_expected - vanilla).max() > 1e-4
    inner = []

    def call_again(layer, inputs):
        if not inner:
            inner.append(None)
            inner[0] = unet_output(unet, seed=1)

    handle = find_blocks(unet)[0][1].attn2.register_forward_pre_hook(call_again)  # after the outer attn1 merged
    try:
        outer = unet_output(unet, seed=0)
    finally:
        handle.remove()
    np.testing.assert_array_equal(inner[0], inner_expected)
    np.testing.assert_array_equal(outer, outer_expected)  # used to finish the outer call without ToMe
    assert get_patch(unet).calls_in_flight() == 0
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["calls"] == 4


# remove_tome / apply_tome from inside the model's own forward -----------------------------------------------
def test_remove_and_apply_from_inside_the_models_own_forward_are_refused():
    unet = tiny_unet()
    vanilla, vanilla_hooks = unet_output(unet), hook_count(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    merged, patch, hooks = unet_output(unet), get_patch(unet), hook_count(unet)
    refusals = []

    def change_tome(layer, inputs):
        for change in (ppdiffusers_tome.remove_tome, lambda m: ppdiffusers_tome.apply_tome(m, ratio=0.3)):
            try:
                change(unet)
            except RuntimeError as error:
                refusals.append(str(error))

    handle = find_blocks(unet)[0][1].attn2.register_forward_pre_hook(change_tome)
    try:
        np.testing.assert_array_equal(unet_output(unet), merged)  # the call runs to its end with ToMe
    finally:
        handle.remove()
    assert len(refusals) == 2 and all("its own forward" in message for message in refusals), refusals
    assert get_patch(unet) is patch and hook_count(unet) == hooks and patch.calls_in_flight() == 0
    ppdiffusers_tome.remove_tome(unet)  # between calls it is allowed
    assert hook_count(unet) == vanilla_hooks
    np.testing.assert_array_equal(unet_output(unet), vanilla)


def test_an_interrupted_call_is_not_taken_for_another_models_live_call():
    """A call of u1 ended by Ctrl-C in the main thread must not count as running while the main thread runs u2:
    each model counts its own calls in flight, and the interrupted one ended with its exception."""
    u1 = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5)
    u2 = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5)
    interrupt_inside_forward(u1, KeyboardInterrupt)
    seen, outcome = [], []

    def remove_u1():
        seen.append(get_patch(u1).calls_in_flight())
        try:
            outcome.append(ppdiffusers_tome.remove_tome(u1))
        except RuntimeError as error:
            outcome.append(error)

    def probe(layer, inputs):  # the main thread is inside u2's forward; another thread asks about u1
        thread = threading.Thread(target=remove_u1)
        thread.start()
        thread.join(60)

    handle = find_blocks(u2)[0][1].attn2.register_forward_pre_hook(probe)
    try:
        with paddle.no_grad():
            u2(step_sample(5), paddle.to_tensor([999, 999]), unet_inputs(u2)[2])
    finally:
        handle.remove()
    assert seen == [0]
    assert len(outcome) == 1 and outcome[0] is u1 and get_patch(u1) is None
    assert get_patch(u2) is not None


def test_a_call_inside_the_models_own_forward_does_not_warn_that_tome_changed_nothing():
    """The inner call ends while the outer one has merged nothing yet: the "changed nothing" check must look at the
    call that ended (which merged), not at the caller still running."""
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5)
    inner = []

    def call_again(layer, inputs):  # before the first block of the outer call
        if not inner:
            inner.append(None)
            inner[0] = unet_output(unet, seed=1)

    handle = unet.register_forward_pre_hook(call_again)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            unet_output(unet, seed=0)
    finally:
        handle.remove()
    messages = [str(w.message) for w in caught]
    assert inner[0] is not None and not [m for m in messages if "changed nothing" in m or "merged no tokens" in m], messages
    assert not get_patch(unet).counters.warned_no_merge
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["calls"] == 2


@pytest.mark.parametrize("death", ["SystemExit", "exception"])
def test_a_thread_that_dies_inside_a_forward_leaves_no_call_in_flight(death):
    unet = tiny_unet()
    vanilla = unet_output(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    patch, seen, workers = get_patch(unet), [], []

    def die(layer, inputs):  # inside the worker's forward, after the first block's attn1 ran on merged tokens
        if threading.current_thread() in workers:
            seen.append(patch.calls_in_flight())
            raise SystemExit() if death == "SystemExit" else RuntimeError("the worker dies")

    def work():
        try:
            unet_output(unet)
        except BaseException as error:  # the thread ends right after its forward failed
            seen.append(type(error).__name__)

    handle = find_blocks(unet)[0][1].attn2.register_forward_pre_hook(die)
    try:
        worker = threading.Thread(target=work)
        workers.append(worker)
        worker.start()
        worker.join(60)
    finally:
        handle.remove()
    expected = "SystemExit" if death == "SystemExit" else "RuntimeError"
    assert not worker.is_alive() and seen == [1, expected]  # the call was counted while it ran
    assert patch.calls_in_flight() == 0  # and ended with the thread
    ppdiffusers_tome.remove_tome(unet)  # not refused
    assert get_patch(unet) is None and untouched(unet)
    np.testing.assert_array_equal(unet_output(unet), vanilla)

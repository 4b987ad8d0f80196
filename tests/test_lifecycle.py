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
from ppdiffusers_tome.patch import find_blocks, get_patch
from ppdiffusers_tome.testing import tiny_unet
from tests.unet_calls import hook_counts, step_sample, unet_inputs, unet_output


@pytest.fixture
def busy_switching():
    """Let threads switch every few microseconds, so that races show up within a short test."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def hook_count(model):
    return sum(pre + post for pre, post in hook_counts(model))


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
    retried = generation(unet)  # the step after the interrupt is the first of a new generation, as on a fresh model
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
    assert outcome == [unet] and get_patch(unet) is None
    assert hook_count(unet) == vanilla_hooks
    np.testing.assert_array_equal(unet_output(unet), vanilla)


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
    twin = copy.copy(unet)  # shares the sub-layers and hook tables with unet: one model under two names
    assert get_patch(twin) is get_patch(unet)
    np.testing.assert_array_equal(unet_output(twin), merged)

    ppdiffusers_tome.remove_tome(twin)  # used to take ToMe off unet while twin still reported it
    assert ppdiffusers_tome.tome_config(unet) is None and ppdiffusers_tome.tome_config(twin) is None
    for model in (unet, twin):
        assert ppdiffusers_tome.tome_status(model)["UNet2DConditionModel"]["active"] is None
        np.testing.assert_array_equal(unet_output(model), vanilla)
    assert hook_count(unet) == vanilla_hooks

    ppdiffusers_tome.apply_tome(twin, ratio=0.3)
    assert ppdiffusers_tome.tome_config(unet).ratio == 0.3 and get_patch(unet) is get_patch(twin)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    assert ppdiffusers_tome.tome_config(twin).ratio == 0.5 and get_patch(unet) is get_patch(twin)
    assert hook_count(unet) == hook_count(twin) and hook_count(unet) > vanilla_hooks
    np.testing.assert_array_equal(unet_output(twin), merged)

    ppdiffusers_tome.remove_tome(unet)
    assert ppdiffusers_tome.tome_config(twin) is None and get_patch(twin) is None
    assert hook_count(twin) == vanilla_hooks and set(unet.__dict__) == attrs
    np.testing.assert_array_equal(unet_output(twin), vanilla)

    deep = copy.deepcopy(ppdiffusers_tome.apply_tome(unet, ratio=0.5))  # a deep copy stays independent
    ppdiffusers_tome.remove_tome(unet)
    assert ppdiffusers_tome.tome_config(deep).ratio == 0.5 and get_patch(twin) is None
    np.testing.assert_array_equal(unet_output(deep), merged)


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
    """A call of u1 left by Ctrl-C in the main thread must not count as running while the main thread runs u2:
    freed frame ids are reused at once, so only u1's own live calls may match its leftover record."""
    u1 = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5)
    u2 = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5)
    interrupt_inside_forward(u1, KeyboardInterrupt)
    seen, outcome = [], []

    def remove_u1():
        seen.append(get_patch(u1).state.busy_elsewhere(u1))
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
    assert outcome == [u1] and get_patch(u1) is None
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
    assert not get_patch(unet).state.warned_no_merge
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["calls"] == 2


def test_calls_left_in_flight_by_a_dead_thread_are_dropped():
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5)
    state, idents = get_patch(unet).state, []
    thread = threading.Thread(target=lambda: idents.append(threading.get_ident()))
    thread.start()
    thread.join(60)
    state.in_flight[idents[0]] = [None]  # what a traced call of a thread that then died leaves behind
    assert state.busy_elsewhere(unet) == 0 and idents[0] not in state.in_flight
    ppdiffusers_tome.remove_tome(unet)  # not refused
    assert get_patch(unet) is None

"""Gradient checkpointing with ToMe: the same gradients as without checkpointing, and training steps that run and
leave the patch copyable."""

import gc

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.patch import get_patch
from tests.unet_calls import forward, unet_inputs


def training_grads(checkpointing, tome=True, steps=1):
    """Gradients of a few parameters after one backward of a tiny UNet in train mode (and the loss after a few SGD
    steps when ``steps > 1``)."""
    paddle.seed(0)
    unet = tiny_unet()
    unet.train()
    if checkpointing:
        unet.enable_gradient_checkpointing()
    if tome:
        unet.apply_tome(ratio=0.5)
    optimizer = paddle.optimizer.SGD(learning_rate=0.01, parameters=unet.parameters())
    sample, timestep, context = unet_inputs(unet)
    losses = []
    for _ in range(steps):
        loss = (unet(sample, timestep, context).sample ** 2).mean()
        loss.backward()
        grads = {name: p.grad.numpy().copy() for name, p in unet.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return grads, losses, unet


def test_gradient_checkpointing_with_tome_gives_the_gradients_of_no_checkpointing():
    """Backward with checkpointing crashed ("Not supported to retrieve a tensor saved by autograd multiple times")
    because the recomputed blocks ran after the call had ended, without merging."""
    plain, _, _ = training_grads(checkpointing=False)
    checkpointed, _, unet = training_grads(checkpointing=True)
    vanilla, _, _ = training_grads(checkpointing=False, tome=False)
    names = [n for n in plain if "attn1.to_q" in n or "proj_in" in n or "conv_in" in n or "ff.net" in n]
    assert len(names) >= 4 and set(checkpointed) == set(plain)
    for name in names:
        np.testing.assert_allclose(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert max(np.abs(plain[n] - vanilla[n]).max() for n in names) > 1e-6  # ToMe changed the gradients
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["merges"] > 0


def test_training_steps_run_with_checkpointing_and_tome_and_the_patch_still_copies():
    import copy
    import pickle

    _, losses, unet = training_grads(checkpointing=True, steps=3)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    _, plain_losses, _ = training_grads(checkpointing=False, steps=3)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    sample, timestep, context = unet_inputs(unet)
    unet(sample, timestep, context)  # a forward whose backward never comes: its kept plans must not block copies
    for twin in (copy.deepcopy(unet), pickle.loads(pickle.dumps(unet))):
        twin.eval()
        np.testing.assert_allclose(forward(twin, sample, timestep, context), forward(unet.eval(), sample, timestep, context), rtol=1e-6)


CONFIGS = {"tome": dict(ratio=0.5), "shared": dict(ratio=0.5, share_plan="level"),
           "feature": dict(ratio=0.5, match_window=8, match_order="feature"), "todo": dict(method="todo")}


def grads_of(checkpointing, options, scenario):
    """Gradients of every parameter of a tiny UNet with ToMe ``options`` after ``scenario``: several forwards
    before one backward (with a no_grad forward in between for "no_grad_between"), or one forward and two
    backwards ("twice")."""
    paddle.seed(0)
    unet = tiny_unet()
    unet.train()
    if checkpointing:
        unet.enable_gradient_checkpointing()
    ppdiffusers_tome.apply_tome(unet, **options)
    inputs = [unet_inputs(unet, seed=s) for s in range(3)]
    timesteps = [paddle.to_tensor([t, t], dtype="int64") for t in (900, 500, 100)]  # several noise levels
    losses = []
    for i, (sample, _, context) in enumerate(inputs):
        if scenario == "twice" and i:
            break
        if scenario == "no_grad_between" and i == 1:
            with paddle.no_grad():
                unet(sample, timesteps[i], context)
            continue
        losses.append((unet(sample, timesteps[i], context).sample ** 2).mean())
    loss = paddle.add_n(losses)
    if scenario == "twice":
        loss.backward(retain_graph=True)
    loss.backward()
    return {name: p.grad.numpy().copy() for name, p in unet.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scenario", ["three_forwards", "no_grad_between", "twice"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_checkpointing_gives_the_gradients_of_no_checkpointing_for_any_forwards_and_backwards(config, scenario):
    plain = grads_of(False, CONFIGS[config], scenario)
    checkpointed = grads_of(True, CONFIGS[config], scenario)
    assert set(checkpointed) == set(plain) and len(plain) > 20
    worst = max(float(np.abs(checkpointed[n] - plain[n]).max() / (np.abs(plain[n]).max() + 1e-12)) for n in plain)
    assert worst < 1e-4, f"{config}, {scenario}: gradients differ by {worst:.2e} (relative)"
    assert paddle.is_grad_enabled()


def test_kept_plans_go_with_their_graphs():
    unet = tiny_unet()
    unet.train()
    unet.enable_gradient_checkpointing()
    ppdiffusers_tome.apply_tome(unet)
    kept = get_patch(unet).recompute
    sample, timestep, context = unet_inputs(unet)
    loss = (unet(sample, timestep, context).sample ** 2).mean()
    blocks = len(get_patch(unet).blocks)
    assert len(kept) == 3 and blocks == 3  # the three (hooked) 1x blocks merge; each checkpointed call keeps its plan
    loss.backward()
    del loss
    import gc

    gc.collect()
    assert len(kept) == 0  # the graph is gone, so are its inputs and their plans
    with paddle.no_grad():
        unet(sample, timestep, context)
    assert len(kept) == 0  # nothing is kept without gradients


@pytest.mark.parametrize("flag", ["FLAG_RECOMPUTE_USE_REENTRANT", "FLAG_USE_OLD_RECOMPUTE"])
def test_reentrant_recompute_is_refused_before_any_work_and_autograd_stays_on(flag, monkeypatch):
    from ppdiffusers_tome.tome.checkpoint import ReentrantRecomputeError

    monkeypatch.setenv(flag, "True")
    unet = tiny_unet()
    unet.train()
    unet.enable_gradient_checkpointing()
    ppdiffusers_tome.apply_tome(unet)
    sample, timestep, context = unet_inputs(unet)
    ran = []
    handle = unet.conv_in.register_forward_pre_hook(lambda layer, args: ran.append(1))
    with pytest.raises(ReentrantRecomputeError, match=flag if flag.endswith("REENTRANT") else "FLAG_USE_OLD"):
        unet(sample, timestep, context)
    handle.remove()
    assert not ran and paddle.is_grad_enabled()  # refused before the UNet computed anything
    assert get_patch(unet).calls_in_flight() == 0
    with paddle.no_grad():  # inference is unaffected by the flags
        assert np.isfinite(unet(sample, timestep, context).sample.numpy()).all()
    unet.disable_gradient_checkpointing()  # and so is training without checkpointing
    (unet(sample, timestep, context).sample ** 2).mean().backward()
    monkeypatch.delenv(flag)
    unet.enable_gradient_checkpointing()
    (unet(sample, timestep, context).sample ** 2).mean().backward()  # the default recompute works


def dit_grads(checkpointing):
    from ppdiffusers_tome.testing import tiny_dit_transformer

    paddle.seed(0)
    model = tiny_dit_transformer()
    model.train()
    if checkpointing:
        model.enable_gradient_checkpointing()
    ppdiffusers_tome.apply_tome(model, ratio=0.5)
    rng = np.random.default_rng(0)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    out = model(sample, timestep=paddle.to_tensor([500, 500]), class_labels=paddle.to_tensor([1, 2])).sample
    (out ** 2).mean().backward()
    assert ppdiffusers_tome.tome_stats(model)["Transformer2DModel"]["merges"] > 0
    return {name: p.grad.numpy().copy() for name, p in model.named_parameters() if p.grad is not None}


def test_a_transformer_only_model_trains_with_checkpointing_and_tome():
    """The blocks of a DiT / PixArt-alpha model sit directly under the patched model ("transformer_blocks.0"):
    their checkpointing is the model's own."""
    plain, checkpointed = dit_grads(False), dit_grads(True)
    assert set(plain) == set(checkpointed) and len(plain) > 10
    for name in plain:
        np.testing.assert_allclose(checkpointed[name], plain[name], rtol=1e-4, atol=1e-6, err_msg=name)


# issue 40 item 3: a change of ToMe between a checkpointed forward and its backward -------------------------------
TECHNIQUES = {"tome": dict(ratio=0.5), "todo": dict(method="todo")}


def one_backward(unet, inputs, between=lambda: None):
    """Gradients of every parameter after one forward and its backward, ``between`` called in between."""
    loss = (unet(*inputs).sample ** 2).mean()
    between()
    loss.backward()
    return {name: p.grad.numpy().astype(np.float64) for name, p in unet.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("technique", list(TECHNIQUES))
def test_changing_tome_between_a_checkpointed_forward_and_its_backward_is_refused(technique):
    options = TECHNIQUES[technique]
    paddle.seed(0)
    reference = tiny_unet()
    reference.train()
    ppdiffusers_tome.apply_tome(reference, **options)
    inputs = unet_inputs(reference)
    expected = one_backward(reference, inputs)  # no checkpointing, nothing in between

    paddle.seed(0)
    unet = tiny_unet()
    unet.train()
    unet.enable_gradient_checkpointing()
    ppdiffusers_tome.apply_tome(unet, **options)
    patch, config, refusals = get_patch(unet), ppdiffusers_tome.tome_config(unet), []
    changes = [lambda: ppdiffusers_tome.remove_tome(unet), lambda: unet.remove_tome(),
               lambda: ppdiffusers_tome.apply_tome(unet, ratio=0.3), lambda: unet.apply_tome(method="tome")]

    def change_tome():  # the kept plans of the checkpointed blocks are alive: every change is refused
        assert len(patch.recompute) > 0
        for change in changes:
            with pytest.raises(RuntimeError) as refused:
                change()
            refusals.append(str(refused.value))
            assert paddle.is_grad_enabled()  # autograd is never left off

    got = one_backward(unet, inputs, change_tome)
    assert len(refusals) == len(changes)
    assert all("checkpointed block call(s) wait for their backward" in message and "Run the backward first" in
               message for message in refusals), refusals
    assert get_patch(unet) is patch and ppdiffusers_tome.tome_config(unet) == config
    assert set(got) == set(expected) and len(got) > 20
    for name in expected:  # the backward ran with the plans of its forward: the gradients without checkpointing
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-7, err_msg=name)
    assert paddle.is_grad_enabled()

    gc.collect()  # the graph is gone after the backward: so are the kept plans, and removal works
    assert len(patch.recompute) == 0
    ppdiffusers_tome.remove_tome(unet)
    assert get_patch(unet) is None and paddle.is_grad_enabled()
    unet.disable_gradient_checkpointing()
    np.testing.assert_array_equal(forward(unet.eval(), *inputs), forward(tiny_unet(), *inputs))  # a vanilla model

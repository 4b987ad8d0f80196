"""Gradient checkpointing with ToMe: the same gradients as without checkpointing, and training steps that run and\nleave the patch copyable."""

import numpy as np
import paddle

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_unet
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

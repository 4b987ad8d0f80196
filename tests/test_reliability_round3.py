"""Reliability defects of issue #18 ("Reliability, round 3") in model glue: odd timesteps (item 8), gradient
checkpointing (item 3), max_downsample="auto" on a UNet whose finest level is only in the up path (item 11) and
configurations that can merge nothing (item 12). Static graphs (item 2) are in test_static_graph.py, the seed
(item 9) in test_patch.py and test_merge.py, float64 merges (item 10) in test_merge.py."""

import warnings

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_unet


def unet_inputs(unet, batch=2, hw=(16, 16), seed=0):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((batch, 4, *hw)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((batch, 5, unet.config.cross_attention_dim)).astype("float32"))
    return sample, paddle.to_tensor([500] * batch, dtype="int64"), context


def forward(unet, sample, timestep, context):
    with paddle.no_grad():
        return unet(sample, timestep, context).sample.numpy()


# item 8 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "timestep",
    [float("nan"), float("inf"), -float("inf"), np.float64("nan"), "bool_vector", "bool_scalar"],
    ids=["nan", "inf", "-inf", "np-nan", "bool-vector", "bool-scalar"],
)
def test_odd_timesteps_run_as_in_vanilla_with_the_defaults(timestep):
    """A Python NaN/inf timestep failed to become an integer, a bool tensor had no max kernel; vanilla runs."""
    if timestep == "bool_vector":
        timestep = paddle.to_tensor([True, False])
    elif timestep == "bool_scalar":
        timestep = paddle.to_tensor(True)
    unet = tiny_unet()
    sample, _, context = unet_inputs(unet)
    vanilla = forward(unet, sample, timestep, context)
    unet.apply_tome(ratio=0.5)
    patched = forward(unet, sample, timestep, context)
    assert patched.shape == vanilla.shape
    np.testing.assert_array_equal(np.isfinite(patched), np.isfinite(vanilla))
    assert np.abs(patched - vanilla).max() > 1e-4  # ToMe merged
    np.testing.assert_array_equal(forward(unet, sample, timestep, context), patched)  # and reproducibly


def test_a_non_finite_timestep_with_a_ratio_schedule_is_a_clear_error():
    unet = tiny_unet()
    unet.apply_tome(ratio=(0.6, 0.2))
    sample, _, context = unet_inputs(unet)
    with pytest.raises(ValueError, match="timestep that is not finite"):
        forward(unet, sample, float("nan"), context)
    assert np.isfinite(forward(unet, sample, paddle.to_tensor([True, True]), context)).all()


# item 11 --------------------------------------------------------------------------------------------------------
def test_auto_merges_only_at_the_finest_level_of_the_whole_model_when_it_is_only_in_the_up_path():
    """The down path reaches its first transformer block at 2x; the 1x blocks are in the up path only. "auto" is
    the finest level with transformer blocks over the whole model (ToMeConfig's docstring): only the 1x blocks
    merge, not the 2x ones too."""
    unet = tiny_unet(
        block_out_channels=(32, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    )
    merged_tokens = {}

    def record(name):
        def hook(layer, args):
            merged_tokens[name] = args[0].shape[1]

        return hook

    for name, block in ppdiffusers_tome.patch.find_blocks(unet):
        block.attn1.to_q.register_forward_pre_hook(record(name))  # inside attn1: sees the merged tokens
    unet.apply_tome(ratio=0.5)
    inputs = unet_inputs(unet)  # a 16 x 16 latent: 256 tokens at 1x, 64 at 2x
    forward(unet, *inputs)
    fine = {name for name in merged_tokens if name.startswith("up_blocks.1.")}
    assert fine and all(merged_tokens[name] == 128 for name in fine)  # 1x blocks merged half of their 256 tokens
    assert all(tokens == 64 for name, tokens in merged_tokens.items() if name not in fine)  # 2x blocks: all 64
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["merges"] == len(fine)
    unet.apply_tome(ratio=0.5, max_downsample=2)  # asking for 2x still merges there
    forward(unet, *inputs)
    assert all(tokens == 32 for name, tokens in merged_tokens.items() if name not in fine)


# item 12 --------------------------------------------------------------------------------------------------------
def stats(unet):
    return ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]


def test_strides_larger_than_the_grid_warn_once_and_plan_nothing():
    unet = tiny_unet()
    inputs = unet_inputs(unet)  # a 16 x 16 latent: no 32 x 32 cell anywhere
    vanilla = forward(unet, *inputs)
    unet.apply_tome(ratio=0.5, sx=32, sy=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [forward(unet, *inputs) for _ in range(2)]
    messages = [str(w.message) for w in caught if "merged no tokens" in str(w.message)]
    assert len(messages) == 1 and "16x16 token grid holds no sy x sx = 32x32 cell" in messages[0], messages
    for output in outputs:
        np.testing.assert_array_equal(output, vanilla)
    assert stats(unet)["plans_computed"] == 0 and stats(unet)["merges"] == 0
    unet.apply_tome(ratio=0.5, sx=8, sy=8)  # cells fit the 1x grid: merges, no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert np.abs(forward(unet, *inputs) - vanilla).max() > 1e-4
    assert not [w for w in caught if "merged no tokens" in str(w.message)]
    assert stats(unet)["plans_computed"] > 0


def test_no_sub_layer_enabled_warns_once_at_apply_and_plans_nothing():
    unet = tiny_unet()
    inputs = unet_inputs(unet)
    vanilla = forward(unet, *inputs)
    with pytest.warns(UserWarning, match="merge_attn, merge_crossattn and merge_mlp are all False"):
        unet.apply_tome(ratio=0.5, merge_attn=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [forward(unet, *inputs) for _ in range(2)]
    assert not [w for w in caught if "ToMe" in str(w.message)]  # said once, at apply
    for output in outputs:
        np.testing.assert_array_equal(output, vanilla)
    assert stats(unet)["plans_computed"] == 0 and stats(unet)["calls"] == 2


# item 3 ---------------------------------------------------------------------------------------------------------
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

"""Which blocks merge: max_downsample and "auto" (the finest level with transformer blocks, also on SDXL and odd
latents), and the warnings when a setting merges nothing."""

import warnings

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_sdxl_unet, tiny_unet
from ppdiffusers_tome.tome.patch import get_patch
from tests.unet_calls import forward, sdxl_call, unet_inputs


def test_only_blocks_at_or_below_max_downsample_merge():
    unet = tiny_unet()  # 3 blocks at 1x, 3 at 2x, 1 (the mid block) at 4x
    sample, t, context = unet_inputs(unet)
    counts, hooked = {}, {}
    for level in (1, 2, 4):
        ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=level)
        with paddle.no_grad():
            unet(sample, t, context)
        counts[level] = get_patch(unet).merged_blocks
        hooked[level] = len(get_patch(unet).blocks)  # the UNet's structure says each block's level
    assert counts == hooked == {1: 3, 2: 6, 4: 7}


def test_odd_latent_sizes_merge_at_every_level():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet, batch=2, hw=(9, 11))
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=8)
    with paddle.no_grad():
        out = unet(sample, t, context).sample
    assert out.shape == [2, 4, 9, 11]
    assert get_patch(unet).merged_blocks == 7
    assert np.isfinite(out.numpy()).all()


def test_sdxl_at_an_explicit_level_1_warns_once_with_advice():
    unet = tiny_sdxl_unet()
    args, kwargs = sdxl_call(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=1)
    assert get_patch(unet).blocks == []  # no block at 1x: none is hooked, yet the calls still get the advice
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
    assert get_patch(unet).merged_blocks > 0


def outputs_and_merged_blocks(unet, call, **options):
    args, kwargs = call
    ppdiffusers_tome.apply_tome(unet, use_rand=False, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with paddle.no_grad():
            out = unet(*args, **kwargs).sample.numpy()
    merged = get_patch(unet).merged_blocks
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


def test_ratio_zero_never_warns_about_merging_nothing():
    unet = tiny_sdxl_unet()
    args, kwargs = sdxl_call(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.0, max_downsample=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with paddle.no_grad():
            unet(*args, **kwargs)
    assert not [w for w in caught if "merged no tokens" in str(w.message)]


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

    for name, block in ppdiffusers_tome.tome.patch.find_blocks(unet):
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


@pytest.mark.parametrize("order", ["grid", "feature"])
def test_a_window_too_small_for_the_ratio_warns_once_that_nothing_merged(order):
    unet = tiny_unet()
    ppdiffusers_tome.apply_tome(unet, ratio=0.2, match_window=2, match_order=order)  # int(4 * 0.2) = 0 per window
    sample, timestep, context = unet_inputs(unet)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = forward(unet, sample, timestep, context)
        forward(unet, sample, timestep, context)
    messages = [str(w.message) for w in caught if "merged no tokens" in str(w.message)]
    assert len(messages) == 1 and "int(4 * 0.2) = 0" in messages[0] and "match_window" in messages[0]
    ppdiffusers_tome.remove_tome(unet)
    np.testing.assert_array_equal(out, forward(unet, sample, timestep, context))  # it really merged nothing
    ppdiffusers_tome.apply_tome(unet, ratio=0.25, match_window=2, match_order=order)  # one per window: merges
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward(unet, sample, timestep, context)
    assert not [w for w in caught if "merged no tokens" in str(w.message)]
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["merges"] > 0

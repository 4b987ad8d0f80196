"""The step cache's finer branches (``layers=k``, DeepCache's branches): on a cached step only the last ``k`` layers
of the last up block run, from the kept output of the layer before them, with the first ``k - 1`` layers of the first
down block for their skip connections; checked against a reference built from plain forward hooks."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.cache.layout import layout_of
from ppdiffusers_tome.cache.step_cache import CacheConfig
from ppdiffusers_tome.testing import tiny_controlnet_pipeline, tiny_dit_transformer, tiny_sd_pipeline, tiny_unet
from tests.conftest import run
from tests.test_pipelines import control_image


def sd15_layout_unet():
    """SD-1.5's block layout (2 layers per down block, 3 per up block) with narrow channels."""
    return tiny_unet(block_out_channels=(32, 32, 32, 32), layers_per_block=2,
                     down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                     up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)


def step_inputs(unet, steps=2):
    rng = np.random.default_rng(3)
    context = paddle.to_tensor(rng.standard_normal((2, 5, unet.config.cross_attention_dim)).astype("float32"))
    return [(paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32")),
             paddle.to_tensor([900 - 100 * i] * 2), context) for i in range(steps)]


def counting(layers):
    counts = {name: 0 for name in layers}
    handles = [layer.register_forward_pre_hook(lambda *_, name=name: counts.__setitem__(name, counts[name] + 1))
               for name, layer in layers.items()]
    return counts, handles


@pytest.mark.parametrize("layers", [1, 2])
def test_a_cached_step_runs_only_the_chosen_layers_of_the_first_level(layers):
    unet = sd15_layout_unet()
    up, down = unet.up_blocks[-1], unet.down_blocks[0]
    # (a convolution inside each resnet: it runs only when the resnet computes, not when it returns a kept output)
    watched = {f"up.{i}": resnet.conv1 for i, resnet in enumerate(up.resnets)}
    watched.update({f"down.{i}": resnet.conv1 for i, resnet in enumerate(down.resnets)})
    watched["conv_in"], watched["mid"] = unet.conv_in, unet.mid_block.resnets[0].conv1
    unet.apply_cache(interval=2, layers=layers)
    inputs = step_inputs(unet)
    with paddle.no_grad():
        unet(*inputs[0])  # full
        counts, handles = counting(watched)
        unet(*inputs[1])  # cached
    for handle in handles:
        handle.remove()
    ran = sorted(name for name, count in counts.items() if count)
    expected = {1: ["conv_in", "up.2"], 2: ["conv_in", "down.0", "up.1", "up.2"]}[layers]
    assert ran == expected


@pytest.mark.parametrize("layers", [1, 2])
def test_a_cached_step_equals_the_unet_with_the_deep_layers_replaced_by_their_last_full_outputs(layers):
    """Reference without the cache's code: plain forward post-hooks keep every deep part's output at the full step
    and return it at the next step."""
    unet = sd15_layout_unet()
    inputs = step_inputs(unet)
    deep = layout_of(unet, CacheConfig(layers=layers)).deep
    kept, handles = {}, []
    for name, layer in deep:
        def keep(layer, args, out, name=name):
            if "replace" in kept:
                return kept[name]
            kept[name] = out
            return None
        handles.append(layer.register_forward_post_hook(keep))
    with paddle.no_grad():
        unet(*inputs[0])
        kept["replace"] = True
        expected = unet(*inputs[1]).sample.numpy()
        for handle in handles:
            handle.remove()
        vanilla = unet(*inputs[1]).sample.numpy()
        unet.apply_cache(interval=2, layers=layers)
        unet(*inputs[0])
        got = unet(*inputs[1]).sample.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert np.abs(got - vanilla).max() > 1e-4


def test_interval_1_with_a_finer_branch_is_vanilla_bit_for_bit():
    pipe = tiny_sd_pipeline(unet=sd15_layout_unet())
    vanilla = run(pipe, steps=4)
    pipe.apply_cache(interval=1, layers=1)
    np.testing.assert_array_equal(run(pipe, steps=4), vanilla)
    pipe.apply_cache(interval=2, layers=1)
    assert np.abs(run(pipe, steps=4) - vanilla).max() > 1e-4
    pipe.remove_cache()
    np.testing.assert_array_equal(run(pipe, steps=4), vanilla)


def test_a_finer_branch_composes_with_tome_and_controlnets():
    pipe = tiny_controlnet_pipeline(1)
    vanilla = run(pipe, steps=4, image=control_image())
    pipe.apply_tome(ratio=0.5).apply_cache(interval=2, layers=1)
    both = run(pipe, steps=4, image=control_image())
    status = ppdiffusers_tome.cache_status(pipe)
    assert all(s["cached_calls"] == 2 and s["settings"]["layers"] == 1 for s in status.values())
    assert ppdiffusers_tome.tome_stats(pipe)["unet"]["merges"] > 0
    assert np.isfinite(both).all() and 0 < np.abs(both - vanilla).max() < 1
    pipe.remove_cache().remove_tome()
    np.testing.assert_array_equal(run(pipe, steps=4, image=control_image()), vanilla)


@pytest.mark.parametrize("options, message", [
    (dict(layers=0), r"layers must be 'auto', None or an integer >= 1"),
    (dict(layers=3), r"layers must be in \[1, 2\]"),
    (dict(layers=1, depth=2), r"layers=1 cuts inside the first level, so it needs depth=1"),
    (dict(layers=1.0), r"layers must be 'auto', None or an integer >= 1"),
    (dict(layers="Auto"), r"layers must be 'auto', None or an integer >= 1"),
    (dict(layers=np.array([1, 2])), r"layers must be 'auto', None or an integer >= 1.*not an array or a Tensor"),
])
def test_bad_layers_are_refused_by_name_with_their_range(options, message):
    unet = sd15_layout_unet().apply_cache(interval=2)
    with pytest.raises(ValueError, match=message):
        unet.apply_cache(**options)
    status = ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]
    assert status["settings"]["layers"] == "auto" and status["layers"] == 1
    assert type(CacheConfig(layers=np.str_("auto")).layers) is str  # a numpy str is taken as the plain one


def test_the_default_is_the_finest_branch_on_unets_at_depth_1_and_the_whole_level_elsewhere():
    """``layers="auto"``: 1 on a UNet and a ControlNet at depth 1 (the same outputs as ``layers=1``, not those of
    ``layers=None``), None at depth 2 and on a transformer-only model."""
    pipe = tiny_controlnet_pipeline(1)
    pipe.apply_cache(interval=2)
    assert {name: s["layers"] for name, s in ppdiffusers_tome.cache_status(pipe).items()} == \
        {"unet": 1, "controlnet": 1}
    default = run(pipe, steps=4, image=control_image())
    pipe.apply_cache(interval=2, layers=1)
    np.testing.assert_array_equal(run(pipe, steps=4, image=control_image()), default)
    pipe.apply_cache(interval=2, layers=None)
    assert np.abs(run(pipe, steps=4, image=control_image()) - default).max() > 1e-6
    unet = sd15_layout_unet().apply_cache(interval=2, depth=2)
    assert ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]["layers"] is None
    transformer = ppdiffusers_tome.apply_cache(tiny_dit_transformer(), interval=2)
    assert [s["layers"] for s in ppdiffusers_tome.cache_status(transformer).values()] == [None]
    with pytest.raises(ValueError, match="layers=1 cuts inside a UNet's first level"):
        ppdiffusers_tome.apply_cache(transformer, layers=1)


def test_a_first_level_that_is_not_a_stack_of_layers_keeps_the_whole_level_and_refuses_an_integer():
    """A skip block (ScoreSdeVe's UNet2DModel) runs one attention after all its resnets: no layer to cut at, so
    ``"auto"`` means the whole first level there and an integer ``layers`` is refused by name."""
    from ppdiffusers import UNet2DModel

    paddle.seed(0)
    unet = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 32),
                       down_block_types=("AttnSkipDownBlock2D", "SkipDownBlock2D"),
                       up_block_types=("SkipUpBlock2D", "AttnSkipUpBlock2D"), norm_num_groups=8,
                       attention_head_dim=8, resnet_time_scale_shift="scale_shift")
    assert layout_of(unet, CacheConfig()).layers is None
    with pytest.raises(ValueError, match="is not a stack of resnet \\+ attention layers"):
        layout_of(unet, CacheConfig(layers=1))

"""Pipelines with ToMe beyond the shared checks of tests/techniques/test_tome.py (which run every pipeline kind, merge
and restore it exactly): a ControlNet patched alone, the ratio's effect, DiT's patch grid, PixArt's timestep, refusals."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import (
    tiny_controlnet_pipeline,
    tiny_dit_pipeline,
    tiny_dit_transformer,
    tiny_sd_pipeline,
)
from ppdiffusers_tome.tome.patch import get_patch
from tests.conftest import generator, run


def control_image():
    from PIL import Image

    return Image.fromarray(np.random.default_rng(7).uniform(0, 255, (32, 32, 3)).astype("uint8"))


def test_controlnet_model_alone_can_be_patched():
    pipe = tiny_controlnet_pipeline(1)
    vanilla = run(pipe, image=control_image())
    pipe.controlnet.apply_tome(ratio=0.5)
    merged = run(pipe, image=control_image())
    stats = ppdiffusers_tome.tome_stats(pipe)
    assert list(stats) == ["controlnet"] and stats["controlnet"]["merges"] > 0
    assert np.abs(merged - vanilla).max() > 0
    pipe.controlnet.remove_tome()
    np.testing.assert_array_equal(run(pipe, image=control_image()), vanilla)


def test_higher_ratio_moves_further_from_vanilla():
    pipe = tiny_sd_pipeline()
    vanilla = run(pipe, steps=3)
    errors = []
    for ratio in (0.1, 0.7):
        pipe.apply_tome(ratio=ratio, use_rand=False)
        errors.append(np.abs(run(pipe, steps=3) - vanilla).mean())
    assert 0 < errors[0] < errors[1]


def run_dit(pipe, steps=3):
    return pipe(class_labels=[3, 7], num_inference_steps=steps, generator=generator(0), output_type="np").images


@pytest.mark.parametrize("options", [dict(ratio=0.5), dict(method="todo")], ids=["tome", "todo"])
def test_dit_pipeline_merges_on_its_patch_grid_and_is_restored_exactly(options):
    pipe = tiny_dit_pipeline()  # 16 x 16 latent, patch size 2: every block sees an 8 x 8 grid of 64 tokens
    vanilla = run_dit(pipe)
    pipe.apply_tome(**options)
    patch = get_patch(pipe.transformer)
    grids = []
    handle = pipe.transformer.transformer_blocks[2].attn1.register_forward_pre_hook(
        lambda layer, args: grids.append(patch.plan_in_flight(2))
    )
    merged = run_dit(pipe)
    handle.remove()
    stats = ppdiffusers_tome.tome_stats(pipe)
    assert list(stats) == ["transformer"] and stats["transformer"]["merges"] == 3 * 3  # 3 blocks x 3 steps
    plan = grids[0]
    assert (plan.batch_size, plan.num_tokens) == (4, 64)  # two labels, with and without guidance
    if options.get("method") == "todo":
        assert (plan.grid_h, plan.grid_w, plan.kv_tokens) == (8, 8, 16)
    else:
        assert plan.r == 32
    assert np.isfinite(merged).all() and 0 < np.abs(merged - vanilla).max() < 1.0
    pipe.remove_tome()
    np.testing.assert_array_equal(run_dit(pipe), vanilla)


def test_pixart_style_transformer_reads_the_timestep_from_its_third_positional_argument():
    model = tiny_dit_transformer("ada_norm_single")
    rng = np.random.default_rng(2)
    x = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    added = {"resolution": None, "aspect_ratio": None}
    with paddle.no_grad():
        vanilla = model(x, context, paddle.to_tensor([500, 500]), added_cond_kwargs=added).sample.numpy()
        ppdiffusers_tome.apply_tome(model, ratio=(0.6, 0.0))
        patch, rs = get_patch(model), []
        handle = model.transformer_blocks[0].attn1.register_forward_pre_hook(lambda layer, args: rs.append(patch.plan_in_flight(0).r))
        merged = model(x, context, paddle.to_tensor([500, 500]), added_cond_kwargs=added).sample.numpy()
        model(x, context, paddle.to_tensor([250, 250]), added_cond_kwargs=added)
        handle.remove()
    assert rs == [int(64 * 0.3), int(64 * 0.15)]  # progress 0.5 and 0.75
    assert 0 < np.abs(merged - vanilla).max() < 1.0


def test_models_without_transformer_blocks_are_refused_with_the_reason():
    from ppdiffusers import UNet2DModel

    model = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(16, 16), layers_per_block=1,
                        norm_num_groups=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    with pytest.raises(ValueError, match="UNet2DModel is built from .*AttnDownBlock2D.*not ppdiffusers' BasicTransformerBlock"):
        ppdiffusers_tome.apply_tome(model)
    assert get_patch(model) is None

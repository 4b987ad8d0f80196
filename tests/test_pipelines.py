"""Every supported pipeline kind: runs with ToMe, really merges, and is bit-identical to vanilla after removal."""

import numpy as np
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_controlnet_pipeline, tiny_sd_pipeline, tiny_sdxl_pipeline
from tests.conftest import run


def control_image():
    from PIL import Image

    return Image.fromarray(np.random.default_rng(7).uniform(0, 255, (32, 32, 3)).astype("uint8"))


def build(kind, init_image, mask_image):
    """(pipeline, call kwargs, apply kwargs, expected patched components) for one pipeline kind."""
    if kind == "txt2img":
        return tiny_sd_pipeline(), {}, {}, {"unet"}
    if kind == "img2img":
        return tiny_sd_pipeline("img2img"), dict(image=init_image, strength=0.9), {}, {"unet"}
    if kind == "inpaint":
        return tiny_sd_pipeline("inpaint"), dict(image=init_image, mask_image=mask_image), {}, {"unet"}
    if kind == "controlnet":
        return tiny_controlnet_pipeline(1), dict(image=control_image()), {}, {"unet", "controlnet"}
    if kind == "multicontrolnet":
        names = {"unet", "controlnet.nets.0", "controlnet.nets.1"}
        return tiny_controlnet_pipeline(2), dict(image=[control_image(), control_image()]), {}, names
    if kind == "sdxl":
        return tiny_sdxl_pipeline(), {}, dict(max_downsample=2), {"unet"}
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["txt2img", "img2img", "inpaint", "controlnet", "multicontrolnet", "sdxl"])
def test_pipeline_merges_and_is_restored_exactly(kind, init_image, mask_image):
    pipe, call, apply, patched = build(kind, init_image, mask_image)
    vanilla = run(pipe, steps=3, **call)
    pipe.apply_tome(ratio=0.5, **apply)
    merged = run(pipe, steps=3, **call)
    stats = ppdiffusers_tome.tome_stats(pipe)
    assert set(stats) == patched
    assert all(s["merges"] > 0 for s in stats.values()), stats
    assert merged.shape == vanilla.shape and np.isfinite(merged).all()
    assert 0 < np.abs(merged - vanilla).max() < 1.0
    pipe.remove_tome()
    np.testing.assert_array_equal(run(pipe, steps=3, **call), vanilla)


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

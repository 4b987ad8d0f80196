"""testing.py: the tiny builders of presets.py under their old import path, for existing scripts and tests."""

import numpy as np
import paddle

import ppdiffusers_tome
import ppdiffusers_tome.presets as presets
import ppdiffusers_tome.testing as testing


def test_every_name_of_the_old_path_is_the_presets_object():
    assert testing.__all__ and set(testing.__all__) <= set(dir(testing))
    for name in testing.__all__:
        assert getattr(testing, name) is getattr(presets, name), name


def test_the_old_path_builds_the_tiny_preset_and_runs_with_tome():
    # the package docstring's example: an old script, unchanged
    pipe = testing.tiny_sd_pipeline(seed=2)
    preset = presets.preset_pipeline("tiny", seed=2)
    ours, theirs = pipe.unet.state_dict(), preset.unet.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key].numpy(), theirs[key].numpy(), err_msg=key)
    sample = paddle.to_tensor(np.random.default_rng(0).standard_normal([2, 4, 16, 16]).astype("float32"))
    text = paddle.to_tensor(np.random.default_rng(1).standard_normal([2, 16, testing.TEXT_HIDDEN]).astype("float32"))
    with paddle.no_grad():
        vanilla = pipe.unet(sample, paddle.to_tensor(500), encoder_hidden_states=text).sample.numpy()
        pipe.apply_tome(ratio=0.5)
        merged = pipe.unet(sample, paddle.to_tensor(500), encoder_hidden_states=text).sample.numpy()
        assert ppdiffusers_tome.tome_status(pipe)["unet"]["active"] == "ppdiffusers_tome"
        pipe.remove_tome()
        again = pipe.unet(sample, paddle.to_tensor(500), encoder_hidden_states=text).sample.numpy()
    assert np.abs(merged - vanilla).max() > 1e-4  # ToMe acted on the tiny UNet
    np.testing.assert_array_equal(again, vanilla)

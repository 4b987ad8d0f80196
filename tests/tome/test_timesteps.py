"""Timesteps of every kind (0-d, [B], float, huge, negative, missing) run as in vanilla with the defaults; a
non-finite one with a ratio schedule is a clear error."""

import numpy as np
import paddle
import pytest

from ppdiffusers_tome.testing import tiny_unet
from tests.unet_calls import forward, unet_inputs


# (numpy's note when the UNet's timestep embedding casts the deliberate NaN or inf to an integer, in vanilla too)
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
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

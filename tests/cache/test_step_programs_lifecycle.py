"""Step programs made before the cache changed refuse to run instead of running a stale model, and the scheduled
steps fall back to a full step when the batch changes, as the eager cache does (run eagerly: no conversion needed)."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.cache.export import ScheduledSteps, StepPrograms
from ppdiffusers_tome.testing import tiny_unet


def inputs(batch, seed=0, t=700):
    rng = np.random.default_rng(seed)
    return (paddle.to_tensor(rng.standard_normal((batch, 4, 16, 16)).astype("float32")),
            paddle.full([batch], t, dtype="int64"),
            paddle.to_tensor(rng.standard_normal((batch, 5, 32)).astype("float32")))


@pytest.mark.parametrize("change", ["remove", "reapply"])
def test_programs_of_a_removed_or_replaced_cache_refuse_to_run(change):
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=2)
    programs = StepPrograms(unet)
    with paddle.no_grad():
        _, feature = programs.full(*inputs(2))
    assert feature is not None
    if change == "remove":
        ppdiffusers_tome.remove_cache(unet)
    else:
        ppdiffusers_tome.apply_cache(unet, interval=3)
    with paddle.no_grad(), pytest.raises(ValueError, match="build StepPrograms again"):
        programs.full(*inputs(2))
    with paddle.no_grad(), pytest.raises(ValueError, match="build StepPrograms again"):
        programs.cached(feature, *inputs(2))


def test_scheduled_steps_run_a_full_step_when_the_batch_changes():
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=3)
    programs = StepPrograms(unet)
    steps = ScheduledSteps(programs.full, programs.cached, programs.config)
    calls = [inputs(2, 0, 900), inputs(3, 1, 800), inputs(3, 2, 700)]
    with paddle.no_grad():
        got = [steps(*args)[0].numpy() for args in calls]
        ppdiffusers_tome.reset_cache(unet)
        expected = [unet(*args).sample.numpy() for args in calls]  # the eager cache: a full step at the new batch
    assert (steps.full_calls, steps.cached_calls, steps.fallbacks) == (2, 1, 1)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    status = ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]
    assert status["fallbacks"] == 1

"""The adaptive rule with the forecast (``threshold=`` with ``forecast="linear"``): the full steps against the rule
written out in numpy (float64) on the work recorded from the model, for a UNet's deep part and the whole model; the
first three steps, the cap and the protected steps; one scalar computed per full step and none per cached step;
``threshold=0`` bit for bit; each call site and thread on its own; an interrupted call changes nothing."""

import numpy as np
import paddle
import pytest
from ppdiffusers import DDIMScheduler, DiffusionPipeline, FlowMatchEulerDiscreteScheduler, KDPM2DiscreteScheduler

import ppdiffusers_tome
from ppdiffusers_tome.cache import step_cache
from ppdiffusers_tome.cache.adaptive import cached_steps_ahead, forecast_error
from ppdiffusers_tome.cache.step_cache import deep_blocks, get_cache
from ppdiffusers_tome.core.generation import relative_step_sizes
from ppdiffusers_tome.testing import tiny_sd3_pipeline, tiny_sd3_transformer, tiny_sd_pipeline, tiny_unet
from tests.cache import test_adaptive_cache as adaptive_tests
from tests.cache.test_adaptive_cache import (
    CallsPerStep,
    guidance_half,
    interrupted_and_uninterrupted,
    output,
    record_outputs,
    view,
)
from tests.conftest import run
from tests.thread_runs import alone_and_together

# how far each step's latents have moved: slowly bending, then faster at the end, as a sampler's trajectory does
BEND = (0.0, 0.1, 0.19, 0.27, 0.34, 0.4, 0.45, 0.5, 0.56, 0.64, 0.75, 0.9)


def unet_step(step, seed=0):
    return adaptive_tests.unet_step(step, seed, moves=BEND, fall=70)


def sd3_step(step, seed=0):
    return adaptive_tests.sd3_step(step, seed, moves=BEND, fall=70)


def unet_work(model):
    """The UNet's work per step without a cache: its last deep part's output (what a cached step forecasts)."""
    seen, hook = record_outputs(deep_blocks(model, 1)[-1][1])
    for step in range(len(BEND)):
        output(model, unet_step(step))
    hook.remove()
    return [s[0] if isinstance(s, list) else s for s in seen]


def whole_work(make_step):
    """The whole model's work per step: its output minus its input latents."""
    def record(model):
        return [output(model, make_step(step)) - make_step(step)[0][0].numpy() for step in range(len(BEND))]
    return record


# (model, one step's inputs, the work the rule measures, apply_cache options, a threshold)
CASES = {
    "unet": (tiny_unet, unet_step, unet_work, {}, 0.3),
    "unet whole": (tiny_unet, unet_step, whole_work(unet_step), dict(whole_model=True), 0.3),
    "sd3 whole": (lambda: tiny_sd3_transformer(num_layers=3), sd3_step, whole_work(sd3_step), dict(whole_model=True),
                  0.5),
}


def reference_rule(work, threshold, max_skips=None, sizes=None):
    """The rule with the forecast written out in numpy, in float64: ``(full steps, smallest distance of a sum to the
    threshold)``. The steps up to the third full one are full; at each full step ``f2`` after ``f0 < f1`` the error
    ``e = mean|w(f2) - forecast| / mean|forecast|`` of the forecast from ``f0`` and ``f1`` is measured, and the next
    ``n`` steps are cached for the largest ``n`` whose predicted errors ``e * j * (j + h) / (h * (h + h0))``
    (``j = 1 .. n``), each times the size of step ``f2 + j`` (``sizes``, the last one past the end; None: 1), sum
    to at most ``threshold``."""
    work = [w.astype(np.float64) for w in work]
    sizes = np.ones(len(work)) if sizes is None else np.asarray(sizes, dtype=np.float64)
    full, next_full, margin = [], 0, np.inf
    for step in range(len(work)):
        if step < next_full:
            continue
        full.append(step)
        next_full = step + 1
        if len(full) < 3:
            continue
        f0, f1, f2 = full[-3:]
        forecast = work[f1] + (work[f1] - work[f0]) * (f2 - f1) / (f1 - f0)
        error = np.abs(work[f2] - forecast).mean() / np.abs(forecast).mean()
        h, h0 = f2 - f1, f1 - f0
        j = np.arange(1, len(work) + 1, dtype=np.float64)
        ahead = sizes[np.minimum(f2 + j.astype(int), len(sizes) - 1)]
        sums = np.cumsum(error * j * (j + h) / (h * (h + h0)) * ahead)
        margin = min(margin, np.abs(sums - threshold).min())
        n = int(np.count_nonzero(sums <= threshold))
        next_full += n if max_skips is None else min(n, max_skips)
    return full, margin


# the rule against numpy --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_skips", [None, 1])
@pytest.mark.parametrize("kind", list(CASES))
def test_the_full_steps_are_those_of_a_numpy_reference_on_the_recorded_work(kind, max_skips):
    build, make_step, record, options, threshold = CASES[kind]
    model = build()
    work = record(model)
    ppdiffusers_tome.apply_cache(model, threshold=threshold, max_skips=max_skips, forecast="linear", **options)
    for step in range(len(BEND)):
        output(model, make_step(step))
    expected, margin = reference_rule(work, threshold, max_skips)
    assert margin > 1e-4 * threshold  # no sum on the edge of the threshold, where float32 and float64 could disagree
    status = ppdiffusers_tome.cache_status(model)[type(model).__name__]
    assert status["rule"] == "forecast" and status["threshold"] == threshold
    assert status["last_full_steps"] == expected
    assert status["last_cached_steps"] == [s for s in range(len(BEND)) if s not in expected]
    assert expected[:3] == [0, 1, 2] and 5 <= len(expected) <= len(BEND) - 3, expected  # it cached and computed
    if max_skips == 1:
        assert all(b - a <= 2 for a, b in zip(expected, expected[1:]))
    else:
        assert any(b - a > 2 for a, b in zip(expected, expected[1:])), expected  # the gaps grow where it may


def test_the_forecasts_error_is_the_numpy_relative_error_of_the_extrapolation():
    rng = np.random.default_rng(4)
    before, earlier, current = (rng.standard_normal((2, 4, 8, 8)) for _ in range(3))
    forecast = earlier + (earlier - before) * (9 - 5) / (5 - 3)  # full steps 3 and 5, measured at 9
    expected = np.abs(current - forecast).mean() / np.abs(forecast).mean()
    got = forecast_error(*(paddle.to_tensor(x.astype("float32")) for x in (current, earlier, before)), 9, 5, 3)
    assert str(got.dtype) == str(paddle.float32) and list(got.shape) == []
    assert float(got) == pytest.approx(float(expected), rel=1e-5)


def test_cached_steps_ahead_is_the_largest_count_whose_predicted_errors_fit():
    for error, gap, previous, threshold in [(0.1, 1, 1, 0.15), (0.02, 2, 1, 0.3), (0.004, 3, 3, 0.15), (0.5, 1, 2, 0.1)]:
        n = cached_steps_ahead(error, gap, previous, threshold, None)
        predicted = lambda k: sum(error * j * (j + gap) / (gap * (gap + previous)) for j in range(1, k + 1))  # noqa
        assert predicted(n) <= threshold < predicted(n + 1)
        assert cached_steps_ahead(error, gap, previous, threshold, max(n - 1, 1)) == min(n, max(n - 1, 1))
    assert cached_steps_ahead(float("nan"), 1, 1, 0.15, None) == 0
    assert cached_steps_ahead(0.0, 1, 1, 0.15, 4) == 4  # an exact forecast: only the cap ends the run


def test_cached_steps_ahead_weighs_each_predicted_error_by_the_size_of_the_step_it_stands_in_for():
    sizes = (0.25, 0.25, 0.5, 0.5, 1.0, 2.0)
    longer = []
    for error, gap, previous, threshold in [(0.01, 1, 1, 0.15), (0.02, 2, 1, 0.3), (0.004, 3, 3, 0.15)]:
        n = cached_steps_ahead(error, gap, previous, threshold, None, sizes)
        size = lambda j: sizes[min(j, len(sizes)) - 1]  # noqa: E731 - past the end: the last size
        predicted = lambda k: sum(error * j * (j + gap) / (gap * (gap + previous)) * size(j)  # noqa: E731
                                  for j in range(1, k + 1))
        assert predicted(n) <= threshold < predicted(n + 1)
        plain = cached_steps_ahead(error, gap, previous, threshold, None)
        assert cached_steps_ahead(error, gap, previous, threshold, None, (1.0,) * 4) == plain
        longer.append(n > plain)
    assert any(longer)  # small steps ahead: a longer run
    assert cached_steps_ahead(0.01, 1, 1, 0.15, None, (4.0,)) < cached_steps_ahead(0.01, 1, 1, 0.15, None)


def flow_matching_timesteps(steps, shift=3.0):
    """SD3's sampler's timesteps as ppdiffusers 0.29 sets them, written out: evenly from its largest sigma (1) to
    its smallest (the shifted 1/1000), then shifted, times 1000."""
    shifted = lambda s: shift * s / (1.0 + (shift - 1.0) * s)  # noqa: E731
    return 1000.0 * shifted(np.linspace(1.0, shifted(1e-3), steps))


def numpy_step_sizes(timesteps):
    """Each step's move in the timestep over the mean move, the last step as the one before it, in float64."""
    moves = timesteps[:-1] - timesteps[1:]
    return np.append(moves, moves[-1]) / moves.mean()


def test_relative_step_sizes_are_the_timesteps_moves_over_their_mean():
    timesteps = flow_matching_timesteps(12)
    expected = numpy_step_sizes(timesteps)
    np.testing.assert_allclose(relative_step_sizes(paddle.to_tensor(timesteps.astype("float32")), 12), expected,
                               rtol=1e-5)
    assert expected[0] < 0.5 < 2.0 < expected[-1]  # shift 3: the last step moves about eight times as far as the first
    # an img2img loop of 8 steps runs the last 8 timesteps
    np.testing.assert_allclose(relative_step_sizes(timesteps, 8), numpy_step_sizes(timesteps[4:]))
    assert relative_step_sizes([999, 979, 959, 939], 4) == (1.0,) * 4  # evenly spaced
    assert relative_step_sizes([900, 950, 800], 3) is None and relative_step_sizes([900, 800], 3) is None
    assert relative_step_sizes([900], 1) is None and relative_step_sizes(["a", "b"], 2) is None


class Loop(DiffusionPipeline):
    """A denoising loop over the timesteps of its ``scheduler`` that calls the model with made-up inputs."""

    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)
        self.set_progress_bar_config(disable=True)

    def __call__(self, make_step, steps):
        self.scheduler.set_timesteps(steps)
        with self.progress_bar(total=steps) as bar:
            for step in range(steps):
                output(self.transformer, make_step(step))
                bar.update()


def test_in_a_pipeline_the_predicted_errors_are_weighed_by_the_schedulers_step_sizes():
    build, make_step, record, options, _ = CASES["sd3 whole"]
    threshold = 0.5
    model = build()
    work = record(model)
    timesteps = flow_matching_timesteps(len(BEND))
    expected, margin = reference_rule(work, threshold, sizes=numpy_step_sizes(timesteps))
    assert margin > 1e-4 * threshold
    assert expected != reference_rule(work, threshold)[0]  # the weights change the full steps
    expected = sorted(set(expected) | {len(BEND) - 1})  # a pipeline's last step is full
    loop = Loop(ppdiffusers_tome.apply_cache(model, threshold=threshold, forecast="linear", **options),
                FlowMatchEulerDiscreteScheduler(shift=3.0))
    loop(make_step, len(BEND))
    np.testing.assert_allclose(loop.scheduler.timesteps.numpy(), timesteps, rtol=1e-5)
    assert ppdiffusers_tome.cache_status(model)["SD3Transformer2DModel"]["last_full_steps"] == expected


@pytest.mark.parametrize("scheduler", [DDIMScheduler, KDPM2DiscreteScheduler])
def test_evenly_spaced_timesteps_or_two_calls_per_step_weigh_every_step_alike(scheduler):
    build, make_step, record, options, _ = CASES["sd3 whole"]
    model = build()
    expected = sorted(set(reference_rule(record(model), 0.5)[0]) | {len(BEND) - 1})
    loop = Loop(ppdiffusers_tome.apply_cache(model, threshold=0.5, forecast="linear", **options), scheduler())
    loop(make_step, len(BEND))
    assert ppdiffusers_tome.cache_status(model)["SD3Transformer2DModel"]["last_full_steps"] == expected


# protected steps, the cap, what is read ----------------------------------------------------------------------------
def test_in_a_pipeline_the_first_three_and_the_last_step_are_full_and_max_skips_start_stop_full_steps_hold():
    pipe = tiny_sd_pipeline().apply_cache(threshold=1e6, max_skips=2, forecast="linear")
    run(pipe, steps=10)
    assert ppdiffusers_tome.cache_status(pipe)["unet"]["last_full_steps"] == [0, 1, 2, 5, 8, 9]
    pipe.apply_cache(threshold=1e6, forecast="linear", start=3, stop=9, full_steps=(6,))
    run(pipe, steps=10)
    assert ppdiffusers_tome.cache_status(pipe)["unet"]["last_full_steps"] == [0, 1, 2, 3, 6, 9]


def test_the_forecasts_error_is_computed_once_per_full_step_from_the_third_and_never_on_a_cached_one(monkeypatch):
    calls = []
    real = step_cache.forecast_error

    def counted(*args):
        calls.append(get_cache(pipe.unet).full_calls)  # full calls so far, this one included
        return real(*args)

    monkeypatch.setattr(step_cache, "forecast_error", counted)
    pipe = tiny_sd_pipeline().apply_cache(threshold=1e6, max_skips=2, forecast="linear")
    run(pipe, steps=10)
    assert calls == [3, 4, 5, 6]  # at the full steps 2, 5, 8 and 9 (the 3rd to the 6th), not at the 4 cached ones


@pytest.mark.parametrize("whole", [False, True], ids=["blocks", "whole-model"])
def test_threshold_0_with_the_forecast_is_vanilla_bit_for_bit_and_measures_nothing(whole, monkeypatch):
    measured = []
    real = step_cache.forecast_error
    monkeypatch.setattr(step_cache, "forecast_error", lambda *args: measured.append(1) or real(*args))
    model = tiny_unet()
    vanilla = [output(model, unet_step(step)) for step in range(6)]
    ppdiffusers_tome.apply_cache(model, threshold=0, forecast="linear", whole_model=whole)
    np.testing.assert_array_equal(np.stack([output(model, unet_step(step)) for step in range(6)]), np.stack(vanilla))
    assert get_cache(model).cached_calls == 0 and not measured


# call sites, threads, interruptions --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["guidance halves", "panorama views"])
def test_each_call_site_measures_its_own_forecast_as_if_it_ran_alone(kind):
    sites = [guidance_half(1), guidance_half(2)] if kind == "guidance halves" else [view(0), view(8), view(16)]
    pipe = CallsPerStep(tiny_unet()).apply_cache(threshold=0.3, forecast="linear")
    together = pipe(sites, 8)
    full = []
    for site, got in zip(sites, together):  # each site alone, in a generation of its own: the same outputs
        np.testing.assert_array_equal(np.stack(pipe([site], 8)[0]), np.stack(got))
        full.append(tuple(ppdiffusers_tome.cache_status(pipe)["unet"]["last_full_steps"]))
    assert all(3 <= len(f) < 8 for f in full), full  # every site both cached and computed


def test_threads_keep_separate_forecasts_on_one_unet():
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), threshold=0.3, forecast="linear")
    streams = [[unet_step(step, seed) for step in range(len(BEND))] for seed in (1, 2)]
    alone, together = alone_and_together(lambda step: output(unet, step), streams,
                                         reset=lambda: ppdiffusers_tome.reset_cache(unet))
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(np.stack(a), np.stack(b))
    assert get_cache(unet).cached_calls > 0


@pytest.mark.parametrize("at", [4, 5], ids=["full-step", "cached-step"])
def test_an_interrupted_call_leaves_the_next_full_step_as_it_was(at):
    got, expected, unet, twin = interrupted_and_uninterrupted(dict(threshold=0.3, forecast="linear"), unet_step,
                                                              len(BEND), at)
    reference = ppdiffusers_tome.cache_status(twin)["UNet2DConditionModel"]
    assert at in (reference["last_full_steps"] if at == 4 else reference["last_cached_steps"])
    np.testing.assert_array_equal(np.stack(got), np.stack(expected))
    assert ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]["last_full_steps"] == reference["last_full_steps"]


def test_a_pipeline_call_the_rule_cached_nothing_in_warns_naming_the_forecast_and_its_first_three_steps():
    pipe = tiny_sd_pipeline().apply_cache(threshold=1e-6, forecast="linear")
    with pytest.warns(UserWarning, match=r"ran every call .* in full .*threshold=1e-06 and forecast='linear' .*"
                                         r"needs three full steps first; the first and the last step .*a larger"):
        run(pipe, steps=4)


@pytest.mark.parametrize("kind", ["txt2img", "img2img"])
def test_sd3_pipelines_weigh_the_steps_by_their_schedulers_timesteps(kind, monkeypatch):
    from tests.test_sd3_model import call, init_picture

    seen = []
    real = step_cache.cached_steps_ahead
    monkeypatch.setattr(step_cache, "cached_steps_ahead", lambda *args: seen.append(args[5]) or real(*args))
    pipe = tiny_sd3_pipeline(kind, seed=0)
    pipe.transformer.apply_cache(whole_model=True, threshold=1e6, max_skips=1, forecast="linear")
    extra = dict(image=init_picture(0), strength=0.6) if kind == "img2img" else {}
    call(pipe, steps=10, **extra)
    timesteps = flow_matching_timesteps(10)[4 if kind == "img2img" else 0:]  # strength 0.6: the last 6 of 10
    sizes = numpy_step_sizes(timesteps)
    full = ppdiffusers_tome.cache_status(pipe)["transformer"]["last_full_steps"]
    assert len(seen) == len([f for f in full if f >= 2]) > 0  # one measurement per full step from the third
    np.testing.assert_allclose(seen[0], sizes[3:], rtol=1e-5)  # measured at step 2: the steps from 3 on

"""The step cache's adaptive rule (``threshold=``, ``max_skips=``) and forecast (``forecast="linear"``) on UNets,
ControlNets, SD3, DiT and PixArt: vanilla bit for bit at ``threshold=0``; the full steps against the rule written out
in numpy on the signals recorded from the model; the cap and the protected steps; each call site's own signal; the
forecast against the extrapolation computed by hand; refusals, threads, copies, ``cache_status`` and bad values."""

import copy
import pickle
import warnings

import numpy as np
import paddle
import pytest
from ppdiffusers import DiffusionPipeline, StableDiffusionImg2ImgPipeline

import ppdiffusers_tome
from ppdiffusers_tome.cache.config import CacheConfig
from ppdiffusers_tome.cache.export import ScheduledSteps, StepPrograms
from ppdiffusers_tome.cache.step_cache import StepCacheError, deep_blocks, get_cache
from ppdiffusers_tome.testing import (
    tiny_dit_transformer,
    tiny_sd3_transformer,
    tiny_sd_pipeline,
    tiny_unet,
)
from tests.conftest import run
from tests.thread_runs import alone_and_together

DRIFT = (0.0, 0.05, 0.09, 0.3, 0.34, 0.38, 0.7, 0.75)  # how far each step's latents have moved: uneven steps


# made-up trajectories: the latents drift by uneven amounts, the timestep falls ---------------------------------------
def unet_step(step, seed=0, moves=DRIFT, fall=100):
    """Step ``step`` of a made-up trajectory: the latents moved by ``moves[step]``, the timestep ``900 - fall * step``."""
    rng = np.random.default_rng(seed)
    base, drift = rng.standard_normal((2, 2, 4, 16, 16)).astype("float32")
    context = rng.standard_normal((2, 5, 32)).astype("float32")
    return (paddle.to_tensor(base + moves[step] * drift), paddle.to_tensor([900 - fall * step] * 2),
            paddle.to_tensor(context)), {}


def sd3_step(step, seed=0, moves=DRIFT, fall=100):
    rng = np.random.default_rng(seed)
    base, drift = rng.standard_normal((2, 2, 16, 16, 16)).astype("float32")
    text, pooled = rng.standard_normal((2, 7, 96)).astype("float32"), rng.standard_normal((2, 64)).astype("float32")
    return (paddle.to_tensor(base + moves[step] * drift), paddle.to_tensor(text), paddle.to_tensor(pooled),
            paddle.to_tensor([900.0 - fall * step] * 2)), {}


def dit_step(step, seed=0):
    rng = np.random.default_rng(seed)
    base, drift = rng.standard_normal((2, 2, 4, 16, 16)).astype("float32")
    return (paddle.to_tensor(base + DRIFT[step] * drift),), dict(
        timestep=paddle.to_tensor([900 - 100 * step] * 2), class_labels=paddle.to_tensor([3, 5]))


# (model, one step's inputs, the first deep part: its input is the rule's signal, a threshold)
MODELS = {
    "unet": (tiny_unet, unet_step, lambda m: deep_blocks(m, 1)[0][1], 0.12),
    "sd3": (lambda: tiny_sd3_transformer(num_layers=5), sd3_step, lambda m: m.transformer_blocks[1], 0.25),
    "dit": (lambda: tiny_dit_transformer(num_layers=5), dit_step, lambda m: m.transformer_blocks[1], 0.15),
}


def output(model, step):
    args, kwargs = step
    with paddle.no_grad():
        out = model(*args, **kwargs, return_dict=False)
    return out[0].numpy()


def record_inputs(layer):
    """The first input of every call of ``layer`` (cached or not), as numpy; returns the list and the hook."""
    seen = []
    hook = layer.register_forward_post_hook(
        lambda _, args, kwargs, out: seen.append((args[0] if args else kwargs["hidden_states"]).numpy()),
        with_kwargs=True)
    return seen, hook


def record_outputs(layer):
    seen = []
    hook = layer.register_forward_post_hook(
        lambda _, args, out: seen.append([o.numpy() if o is not None else None for o in out]
                                         if isinstance(out, (tuple, list)) else out.numpy()))
    return seen, hook


def reference_rule(signals, threshold, max_skips=None):
    """The adaptive rule written out in numpy, in float64: ``(full steps, smallest distance of a sum to the
    threshold)``. Step 0 is full; then each step adds ``mean|s_t - s_(t-1)| / mean|s_(t-1)|`` to the sum since
    the last full step, and is full when the sum reaches ``threshold`` (the sum starts again) or after ``max_skips``
    cached steps in a row."""
    full, total, skips, margin = [0], 0.0, 0, np.inf
    for step in range(1, len(signals)):
        if max_skips is not None and skips >= max_skips:
            full.append(step)
            total, skips = 0.0, 0
            continue
        now, before = signals[step].astype(np.float64), signals[step - 1].astype(np.float64)
        total += np.abs(now - before).mean() / np.abs(before).mean()
        margin = min(margin, abs(total - threshold))
        if total >= threshold:
            full.append(step)
            total, skips = 0.0, 0
        else:
            skips += 1
    return full, margin


# the rule against numpy --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_skips", [None, 1])
@pytest.mark.parametrize("kind", list(MODELS))
def test_the_full_steps_are_those_of_a_numpy_reference_of_the_rule_on_the_recorded_signals(kind, max_skips):
    build, make_step, first_deep, threshold = MODELS[kind]
    model = build()
    ppdiffusers_tome.apply_cache(model, threshold=threshold, max_skips=max_skips)
    signals, hook = record_inputs(first_deep(model))
    deep = get_cache(model).deep[-1][1]
    inner = next(layer for layer in deep.sublayers() if not layer.sublayers())  # runs on full steps only
    deep_calls = []
    counter = inner.register_forward_pre_hook(lambda *_: deep_calls.append(1))
    full_calls = []
    for step in range(len(DRIFT)):
        before = len(deep_calls)
        output(model, make_step(step))
        if len(deep_calls) > before:
            full_calls.append(step)
    hook.remove()
    counter.remove()
    expected, margin = reference_rule(signals, threshold, max_skips)
    assert margin > 1e-3  # no sum on the edge of the threshold, where float32 and float64 could disagree
    status = ppdiffusers_tome.cache_status(model)[type(model).__name__]
    assert status["last_full_steps"] == expected == full_calls
    assert status["last_cached_steps"] == [s for s in range(len(DRIFT)) if s not in expected]
    assert 2 <= len(expected) < len(DRIFT) - 2  # the rule both cached and computed


def test_max_skips_caps_cached_steps_and_start_stop_full_steps_and_the_last_step_are_full():
    pipe = tiny_sd_pipeline().apply_cache(threshold=1e6, max_skips=2)
    run(pipe, steps=8)
    status = ppdiffusers_tome.cache_status(pipe)["unet"]
    assert status["last_full_steps"] == [0, 3, 6, 7]  # two cached in a row at most; the pipeline's last step
    pipe.apply_cache(threshold=1e6, start=2, stop=6, full_steps=(4,))
    run(pipe, steps=8)
    assert ppdiffusers_tome.cache_status(pipe)["unet"]["last_full_steps"] == [0, 1, 2, 4, 6, 7]
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), threshold=1e6)  # called directly: the last step is unknown
    for step in range(4):
        output(unet, unet_step(step))
    assert ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]["last_full_steps"] == [0]


# each call site its own signal -------------------------------------------------------------------------------------
class CallsPerStep(DiffusionPipeline):
    """A denoising loop that calls its model several times per step: the two halves of split guidance, or the
    views of a panorama (MultiDiffusion calls the UNet once per view and step)."""

    def __init__(self, unet):
        super().__init__()
        self.register_modules(unet=unet)
        self.set_progress_bar_config(disable=True)

    def __call__(self, sites, steps):
        outputs = [[] for _ in sites]
        with self.progress_bar(total=steps) as bar:
            for step in range(steps):
                for out, site in zip(outputs, sites):
                    out.append(output(self.unet, site(step)))
                bar.update()
        return outputs


def guidance_half(prompt_seed):
    """One half of split guidance: the same latents, the prompt's own text embeddings."""
    def site(step):
        (sample, t, _), _ = unet_step(step)
        text = np.random.default_rng(prompt_seed).standard_normal((2, 5, 32)).astype("float32")
        return (sample, t, paddle.to_tensor(text)), {}
    return site


LATE = (0.0, 0.01, 0.02, 0.03, 0.04, 0.3, 0.32, 0.7)  # a region of the panorama that changes late


def view(offset):
    """One view of a panorama: a 16-wide crop of 32-wide latents whose left half drifts as ``DRIFT`` says and whose
    right half as ``LATE`` says."""
    def site(step):
        (left, t, context), _ = unet_step(step)
        rng = np.random.default_rng(3)
        base, drift = rng.standard_normal((2, 2, 4, 16, 16)).astype("float32")
        wide = paddle.concat([left, paddle.to_tensor(base + LATE[step] * drift)], axis=3)
        return (wide[:, :, :, offset:offset + 16], t, context), {}
    return site


@pytest.mark.parametrize("kind", ["guidance halves", "panorama views"])
def test_each_call_site_decides_on_its_own_signal_as_if_it_ran_alone(kind):
    sites = [guidance_half(1), guidance_half(2)] if kind == "guidance halves" else [view(0), view(8), view(16)]
    pipe = CallsPerStep(tiny_unet()).apply_cache(threshold=0.12)
    together = pipe(sites, 8)
    full = []
    for site, got in zip(sites, together):  # each site alone, in a generation of its own: the same outputs
        np.testing.assert_array_equal(np.stack(pipe([site], 8)[0]), np.stack(got))
        full.append(tuple(ppdiffusers_tome.cache_status(pipe)["unet"]["last_full_steps"]))
    assert all(2 < len(f) < 8 for f in full), full  # every site both cached and computed
    if kind == "panorama views":
        assert len(set(full)) == 3, full  # the views decided differently: one signal for all would not


def test_two_pipelines_sharing_a_unet_each_start_with_a_fresh_signal(init_image):
    pipe = tiny_sd_pipeline().apply_cache(threshold=0.8)
    img2img = StableDiffusionImg2ImgPipeline(**pipe.components)
    alone = run(img2img, steps=6, image=init_image, strength=0.9)  # 5 denoising steps
    status = ppdiffusers_tome.cache_status(pipe)["unet"]
    full, cached = status["last_full_steps"], status["last_cached_steps"]
    run(pipe, steps=6)
    assert ppdiffusers_tome.cache_status(pipe)["unet"]["last_cached_steps"]  # the other pipeline cached too
    np.testing.assert_array_equal(run(img2img, steps=6, image=init_image, strength=0.9), alone)
    status = ppdiffusers_tome.cache_status(pipe)["unet"]
    assert (status["last_full_steps"], status["last_cached_steps"]) == (full, cached) and cached


def interrupted_and_uninterrupted(options, make_step, steps, at):
    """``steps`` calls of a UNet cached with ``options``, where step ``at`` is first tried on other latents and
    interrupted late (Ctrl-C in conv_out), then retried; and the same calls of an uninterrupted twin. Returns
    ``(outputs, the twin's outputs, the UNet, the twin)``."""
    twin = ppdiffusers_tome.apply_cache(tiny_unet(), **options)
    expected = [output(twin, make_step(step)) for step in range(steps)]
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), **options)
    got = [output(unet, make_step(step)) for step in range(at)]

    def interrupt(*_):
        raise KeyboardInterrupt

    handle = unet.conv_out.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        output(unet, make_step(at, seed=9))
    handle.remove()
    got += [output(unet, make_step(step)) for step in range(at, steps)]
    return got, expected, unet, twin


@pytest.mark.parametrize("at", [2, 3], ids=["cached-step", "full-step"])
def test_an_interrupted_call_leaves_the_rules_sum_and_signal_as_it_found_them(at):
    """An interrupted call is no step and changes nothing the rule remembers: the retried step and the steps after
    it decide and compute what an uninterrupted run does."""
    got, expected, unet, expected_model = interrupted_and_uninterrupted(dict(threshold=0.12), unet_step, len(DRIFT), at)
    np.testing.assert_array_equal(np.stack(got), np.stack(expected))
    status, reference = (ppdiffusers_tome.cache_status(m)["UNet2DConditionModel"] for m in (unet, expected_model))
    assert status["last_full_steps"] == reference["last_full_steps"] == [0, 3, 6]
    assert (status["calls"], status["cached_calls"]) == (len(DRIFT), len(DRIFT) - 3)


def test_a_pipeline_call_the_rule_cached_nothing_in_warns_once_and_threshold_0_never():
    pipe = tiny_sd_pipeline().apply_cache(threshold=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(pipe, steps=4)  # every step full, as asked: no warning
    pipe.apply_cache(threshold=1e-6)
    with pytest.warns(UserWarning, match=r"ran every call .* in full .*threshold=1e-06 .*a larger threshold"):
        run(pipe, steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(pipe, steps=4)  # said once


# the forecast ------------------------------------------------------------------------------------------------------
def test_the_forecast_of_a_unets_last_deep_output_is_the_linear_extrapolation_by_hand():
    unet = tiny_unet()
    vanilla = output(unet, unet_step(3))
    ppdiffusers_tome.apply_cache(unet, interval=2, forecast="linear")  # full steps 0 and 2, cached 1 and 3
    read, hook = record_outputs(deep_blocks(unet, 1)[-1][1])  # what the layers that run read from the deep part
    got = [output(unet, unet_step(step)) for step in range(4)]
    hook.remove()
    last = lambda step: read[step][0] if isinstance(read[step], list) else read[step]  # noqa: E731
    np.testing.assert_array_equal(last(1), last(0))  # one full step: reused as it is
    by_hand = last(2) + (last(2) - last(0)) * (3 - 2) / (2 - 0)
    np.testing.assert_allclose(last(3), by_hand, rtol=1e-5, atol=1e-5)
    assert np.abs(by_hand - last(2)).max() > 1e-3
    ppdiffusers_tome.apply_cache(unet, interval=2)
    without = [output(unet, unet_step(step)) for step in range(4)]
    assert np.abs(got[3] - without[3]).max() > 1e-5 and np.abs(got[3] - vanilla).max() > 0


def test_the_forecast_of_a_transformer_segment_extrapolates_both_streams_by_hand():
    model = tiny_sd3_transformer(num_layers=5)
    first, last = model.transformer_blocks[1], model.transformer_blocks[3]  # depth 1: the segment is blocks 1-3
    ppdiffusers_tome.apply_cache(model, interval=2, forecast="linear")
    inputs = []
    hook_in = first.register_forward_post_hook(
        lambda _, args, kwargs, out: inputs.append((kwargs["hidden_states"].numpy(),
                                                    kwargs["encoder_hidden_states"].numpy())), with_kwargs=True)
    firsts, hook_first = record_outputs(first)
    lasts, hook_last = record_outputs(last)
    for step in range(4):
        output(model, sd3_step(step))
    for hook in (hook_in, hook_first, hook_last):
        hook.remove()
    # full steps 0 and 2: the segment's contribution per stream (a joint block returns (text, image))
    delta = {step: (lasts[step][1] - inputs[step][0], lasts[step][0] - inputs[step][1]) for step in (0, 2)}
    for stream, position in ((0, 1), (1, 0)):
        by_hand = inputs[3][stream] + delta[2][stream] + (delta[2][stream] - delta[0][stream]) * (3 - 2) / (2 - 0)
        np.testing.assert_allclose(firsts[3][position], by_hand, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(firsts[1][position], inputs[1][stream] + delta[0][stream], rtol=1e-5, atol=1e-5)


# refusals, threads, copies, bad values ----------------------------------------------------------------------------
def test_static_graphs_and_step_programs_refuse_the_adaptive_rule_by_name():
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), threshold=0.15)
    static = paddle.jit.to_static(unet.forward, full_graph=True)
    with pytest.raises(StepCacheError, match=r"threshold=0.15.*remove_cache.*threshold=None"):
        static(*unet_step(0)[0])
    for options, name in ((dict(threshold=0.15), "threshold=0.15"), (dict(threshold=0), "threshold=0.0"),
                          (dict(interval=2, forecast="linear"), "forecast='linear'")):
        ppdiffusers_tome.apply_cache(unet, **options)
        with pytest.raises(ValueError, match=f"step programs run the fixed interval; .*{name}"):
            StepPrograms(unet)
        with pytest.raises(ValueError, match=f"step programs run the fixed interval; config has {name}"):
            ScheduledSteps(lambda *a: None, lambda *a: None, CacheConfig(**options))


def test_threads_keep_separate_signals_on_one_unet():
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), threshold=0.12)
    streams = [[unet_step(step, seed) for step in range(6)] for seed in (1, 2)]
    alone, together = alone_and_together(lambda step: output(unet, step), streams,
                                         reset=lambda: ppdiffusers_tome.reset_cache(unet))
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(np.stack(a), np.stack(b))
    assert get_cache(unet).cached_calls > 0


@pytest.mark.parametrize("copier", [lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy], ids=["pickle", "deepcopy"])
def test_a_copy_made_mid_generation_caches_the_same_from_a_fresh_start(copier):
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), threshold=0.12, max_skips=3, forecast="linear")
    expected = [output(unet, unet_step(step)) for step in range(6)]
    ppdiffusers_tome.reset_cache(unet)
    output(unet, unet_step(0))  # the original is mid-generation, with a signal kept
    twin = copier(unet)
    assert get_cache(twin).config == get_cache(unet).config and get_cache(twin) is not get_cache(unet)
    ppdiffusers_tome.reset_cache(twin)
    np.testing.assert_array_equal(np.stack([output(twin, unet_step(step)) for step in range(6)]), np.stack(expected))


@pytest.mark.parametrize("options, message", [
    (dict(threshold=-0.1), "threshold must be None .* or a finite number >= 0 .*; got -0.1"),
    (dict(threshold=float("nan")), "threshold must be None .*; got nan"),
    (dict(threshold=float("inf")), "threshold must be None .*; got inf"),
    (dict(threshold="0.15"), "threshold must be None .*; got '0.15'"),
    (dict(threshold=True), "threshold must be None .*; got True"),
    (dict(threshold=0.1, max_skips=0), "max_skips must be None .* or an integer >= 1 .*; got 0"),
    (dict(threshold=0.1, max_skips=-2), "max_skips must be None .*; got -2"),
    (dict(threshold=0.1, max_skips=2.0), "max_skips must be None .*; got 2.0"),
    (dict(threshold=0.1, max_skips="2"), "max_skips must be None .*; got '2'"),
    (dict(threshold=0.1, max_skips=True), "max_skips must be None .*; got True"),
    (dict(threshold=0.1, max_skips=float("nan")), "max_skips must be None .*; got nan"),
    (dict(max_skips=2), "max_skips=2 caps the adaptive rule's cached steps in a row; it needs threshold="),
    (dict(forecast="quadratic"), "forecast must be None .* or 'linear' .*; got 'quadratic'"),
    (dict(forecast=True), "forecast must be None .* or 'linear' .*; got True"),
    (dict(forecast=-1), "forecast must be None .*; got -1"),
])
def test_bad_values_are_refused_naming_the_argument_and_change_nothing(options, message):
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), threshold=0.2)
    with pytest.raises(ValueError, match=message):
        ppdiffusers_tome.apply_cache(unet, **options)
    assert get_cache(unet).config.threshold == 0.2


def test_numpy_numbers_are_plain_values_in_the_settings():
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), threshold=np.float32(0.25), max_skips=np.int64(3))
    settings = ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]["settings"]
    assert (settings["threshold"], settings["max_skips"]) == (0.25, 3)
    assert type(settings["threshold"]) is float and type(settings["max_skips"]) is int

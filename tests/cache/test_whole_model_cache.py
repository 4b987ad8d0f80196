"""The whole-model step cache (``apply_cache(..., whole_model=True)``): whole calls of a denoiser skipped, the only
cache that reaches SD3 built with ``INFERENCE_OPTIMIZE=True``. Tested on a stand-in of that fused model (SD3's forward
signature and class name, no blocks, no fused kernel) and on the tiny SD3 and SD pipelines: vanilla at threshold 0,
a cached call equal to the input plus the kept residual (and its forecast), the output's structure kept, refusals."""

import copy
import pickle

import numpy as np
import paddle
import pytest
from ppdiffusers.models.transformer_2d import Transformer2DModelOutput

import ppdiffusers_tome
from ppdiffusers_tome.cache.step_cache import StepCacheError, get_cache
from ppdiffusers_tome.core.targets import is_fused_sd3
from ppdiffusers_tome.testing import tiny_sd3_pipeline, tiny_sd3_transformer, tiny_sd_pipeline
from tests.conftest import generator, run
from tests.unet_calls import hook_shape


class SD3Transformer2DModel(paddle.nn.Layer):
    """A stand-in for ppdiffusers' SD3 transformer built with ``INFERENCE_OPTIMIZE=True``: the same class name, the
    ``inference_optimize`` flag and forward signature, and no blocks (the fused model has none to hook); its output
    depends on the latents, the timestep and the pooled text, non-linearly."""

    inference_optimize = True

    def __init__(self, config=None, channels=16):
        super().__init__()
        paddle.seed(7)
        self.mix = paddle.nn.Conv2D(channels, channels, 3, padding=1)
        self.time = paddle.nn.Linear(1, channels)
        self.config = config

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                block_controlnet_hidden_states=None, joint_attention_kwargs=None, return_dict=True):
        batch = hidden_states.shape[0]
        scale = self.time(timestep.astype("float32").reshape([-1, 1]) / 1000.0).reshape([batch, -1, 1, 1])
        out = paddle.tanh(self.mix(hidden_states)) * (1.0 + scale) - 0.5 * hidden_states
        if pooled_projections is not None:
            out = out + pooled_projections.mean(axis=1).reshape([batch, 1, 1, 1])
        return (out,) if return_dict is False else Transformer2DModelOutput(sample=out)


DRIFT = (0.0, 0.04, 0.2, 0.25, 0.3, 0.6, 0.65)  # how far the latents of each step have drifted


def stand_in_inputs(step, seed=0, batch=2):
    """The inputs of call ``step`` of a made-up trajectory: latents that drift, by uneven amounts, step by step."""
    rng = np.random.default_rng(seed)
    base, drift = rng.standard_normal((2, batch, 16, 8, 8)).astype("float32")
    latents = paddle.to_tensor(base + DRIFT[step] * drift)
    pooled = paddle.to_tensor(rng.standard_normal((batch, 64)).astype("float32"))
    return dict(hidden_states=latents, pooled_projections=pooled, timestep=paddle.to_tensor([900.0 - 100 * step] * batch))


def outputs(model, steps, return_dict=False, seed=0):
    with paddle.no_grad():
        results = [model(**stand_in_inputs(step, seed), return_dict=return_dict) for step in range(steps)]
    return [(r[0] if isinstance(r, tuple) else r.sample).numpy() for r in results]


def test_the_stand_in_is_what_the_package_calls_a_fused_sd3():
    model = SD3Transformer2DModel()
    assert is_fused_sd3(model) and not hasattr(model, "transformer_blocks")
    with pytest.raises(ValueError, match="INFERENCE_OPTIMIZE=True.*whole_model=True"):
        ppdiffusers_tome.apply_cache(model, interval=2)


@pytest.mark.parametrize("options", [dict(threshold=0), dict(interval=1)], ids=["threshold=0", "interval=1"])
def test_threshold_0_is_vanilla_bit_for_bit_on_the_fused_stand_in(options):
    model = SD3Transformer2DModel()
    vanilla = outputs(model, 4)
    ppdiffusers_tome.apply_cache(model, whole_model=True, **options)
    np.testing.assert_array_equal(np.stack(outputs(model, 4)), np.stack(vanilla))
    status = ppdiffusers_tome.cache_status(model)["SD3Transformer2DModel"]
    assert (status["calls"], status["full_calls"], status["cached_calls"]) == (4, 4, 0)


@pytest.mark.parametrize("return_dict", [False, True])
def test_a_cached_call_returns_the_input_plus_the_residual_of_the_last_full_call(return_dict):
    model = SD3Transformer2DModel()
    vanilla = outputs(model, 3, return_dict)
    ppdiffusers_tome.apply_cache(model, whole_model=True, interval=3)
    with paddle.no_grad():
        got = [model(**stand_in_inputs(step), return_dict=return_dict) for step in range(3)]
    assert all(isinstance(r, tuple if not return_dict else Transformer2DModelOutput) for r in got)
    got = [(r[0] if isinstance(r, tuple) else r.sample).numpy() for r in got]
    latents = [stand_in_inputs(step)["hidden_states"].numpy() for step in range(3)]
    np.testing.assert_array_equal(got[0], vanilla[0])
    for step in (1, 2):  # input + (output - input) of step 0, computed here in numpy
        np.testing.assert_allclose(got[step], latents[step] + (vanilla[0] - latents[0]), rtol=1e-6, atol=1e-6)
        assert np.abs(got[step] - vanilla[step]).max() > 1e-3  # (not the full call's output: the test can fail)


def test_the_linear_forecast_extrapolates_the_residual_from_the_last_two_full_calls():
    model = SD3Transformer2DModel()
    vanilla = outputs(model, 4)
    latents = [stand_in_inputs(step)["hidden_states"].numpy() for step in range(4)]
    residual = [v - x for v, x in zip(vanilla, latents)]
    ppdiffusers_tome.apply_cache(model, whole_model=True, interval=2, forecast="linear")
    got = outputs(model, 4)
    np.testing.assert_allclose(got[1], latents[1] + residual[0], rtol=1e-6, atol=1e-6)  # one full call: as it is
    by_hand = latents[3] + residual[2] + (residual[2] - residual[0]) * (3 - 2) / (2 - 0)
    np.testing.assert_allclose(got[3], by_hand, rtol=1e-5, atol=1e-5)
    assert np.abs(got[3] - (latents[3] + residual[2])).max() > 1e-3


def test_the_adaptive_rule_decides_on_the_models_input_and_the_whole_model_cache_comes_off_to_vanilla():
    model = SD3Transformer2DModel()
    unpatched, vanilla = hook_shape(model), outputs(model, 6)
    ppdiffusers_tome.apply_cache(model, whole_model=True, threshold=0.22)
    got = outputs(model, 6)
    status = ppdiffusers_tome.cache_status(model)["SD3Transformer2DModel"]
    latents = [stand_in_inputs(step)["hidden_states"].numpy() for step in range(6)]
    full, total = [0], 0.0  # the rule by hand on the inputs (no pipeline: the last step is not known)
    for step in range(1, 6):
        total += np.abs(latents[step] - latents[step - 1]).mean() / np.abs(latents[step - 1]).mean()
        assert abs(total - 0.22) > 1e-2  # (no decision on the edge, where float32 and float64 could differ)
        if total >= 0.22:
            full.append(step)
            total = 0.0
    assert status["last_full_steps"] == full and 1 < len(full) < 6, full
    assert (status["rule"], status["threshold"], status["deep_blocks"]) == ("adaptive", 0.22, 0)
    for step in full:
        np.testing.assert_array_equal(got[step], vanilla[step])
    ppdiffusers_tome.remove_cache(model)
    assert hook_shape(model) == unpatched and get_cache(model) is None
    np.testing.assert_array_equal(np.stack(outputs(model, 6)), np.stack(vanilla))


def sd3_call(pipe, steps=5):
    return pipe(prompt="a red cube", height=32, width=32, num_inference_steps=steps, generator=generator(0),
                output_type="np").images


def test_a_pipeline_with_the_fused_stand_in_takes_only_the_whole_model_cache():
    pipe = tiny_sd3_pipeline()
    pipe = tiny_sd3_pipeline(transformer=SD3Transformer2DModel(pipe.transformer.config), math_attention=False)
    vanilla = sd3_call(pipe)
    with pytest.raises(ValueError, match="INFERENCE_OPTIMIZE=True.*whole_model=True"):
        pipe.apply_cache(interval=2)
    pipe.apply_cache(whole_model=True, threshold=0)
    np.testing.assert_array_equal(sd3_call(pipe), vanilla)
    pipe.apply_cache(whole_model=True, threshold=1e6)  # every step the rule may cache is cached
    cached = sd3_call(pipe)
    status = ppdiffusers_tome.cache_status(pipe)["transformer"]
    assert (status["last_full_steps"], status["last_cached_steps"]) == ([0, 4], [1, 2, 3])  # first and last full
    assert np.isfinite(cached).all() and np.abs(cached - vanilla).max() > 1e-4
    pipe.remove_cache()
    assert ppdiffusers_tome.cache_status(pipe) == {"transformer": None}
    np.testing.assert_array_equal(sd3_call(pipe), vanilla)


@pytest.mark.parametrize("kind", ["sd3", "unet"])
def test_the_whole_model_cache_at_threshold_0_is_vanilla_on_real_pipelines(kind):
    pipe = tiny_sd3_pipeline() if kind == "sd3" else tiny_sd_pipeline()
    call = sd3_call if kind == "sd3" else (lambda p: run(p, steps=4))
    vanilla = call(pipe)
    pipe.apply_cache(whole_model=True, threshold=0)
    np.testing.assert_array_equal(call(pipe), vanilla)
    name = "transformer" if kind == "sd3" else "unet"
    pipe.apply_cache(whole_model=True, interval=2)
    cached = call(pipe)
    status = ppdiffusers_tome.cache_status(pipe)[name]
    assert status["cached_calls"] > 0 and status["deep_blocks"] == 0 and np.isfinite(cached).all()
    assert np.abs(cached - vanilla).max() > 1e-4


def test_a_pipeline_at_interval_3_with_the_forecast_extrapolates_each_cached_step_from_its_own_inputs():
    pipe = tiny_sd_pipeline()
    calls = []  # (input latents, output) of every UNet call, as the pipeline sees them
    pipe.unet.register_forward_post_hook(
        lambda layer, inputs, output: calls.append((inputs[0].numpy().astype("float64"),
                                                    (output[0] if isinstance(output, tuple) else output.sample)
                                                    .numpy().astype("float64"))))
    pipe.apply_cache(whole_model=True, interval=3, forecast="linear")
    run(pipe, steps=7)
    status = ppdiffusers_tome.cache_status(pipe)["unet"]
    assert (status["last_full_steps"], status["last_cached_steps"]) == ([0, 3, 6], [1, 2, 4, 5])
    assert len(calls) == 7
    residual = {step: calls[step][1] - calls[step][0] for step in (0, 3, 6)}
    for step, (earlier, last) in {1: (None, 0), 2: (None, 0), 4: (0, 3), 5: (0, 3)}.items():
        trend = 0.0 if earlier is None else (residual[last] - residual[earlier]) * (step - last) / (last - earlier)
        np.testing.assert_allclose(calls[step][1], calls[step][0] + residual[last] + trend, rtol=1e-5, atol=1e-5)
    assert np.abs(residual[3] - residual[0]).max() > 1e-3  # the trend is not zero: the check above can fail
    assert not np.allclose(calls[6][0], calls[0][0])  # the full calls saw the cached trajectory's own latents


def test_a_controlnet_pipeline_caches_its_unet_whole_and_a_controlnet_is_refused_by_name():
    from ppdiffusers_tome.testing import tiny_controlnet_pipeline
    from tests.test_pipelines import control_image

    pipe = tiny_controlnet_pipeline(1).apply_cache(interval=3)  # the block cache on both first
    pipe.apply_cache(whole_model=True, interval=2)
    assert ppdiffusers_tome.cache_status(pipe)["controlnet"] is None  # replaced: the ControlNet runs as it is
    run(pipe, steps=4, image=control_image())
    assert ppdiffusers_tome.cache_status(pipe)["unet"]["cached_calls"] == 2
    with pytest.raises(ValueError, match="whole_model=True caches a denoiser's prediction; .* is a ControlNet"):
        ppdiffusers_tome.apply_cache(pipe.controlnet, whole_model=True)


@pytest.mark.parametrize("options, message", [
    (dict(depth=2), "depth=2 chooses the parts of a model a cached step runs; whole_model=True runs none"),
    (dict(layers=1), "layers=1 chooses the parts"),
    (dict(whole_model="yes"), "whole_model must be True .* or False; got 'yes'"),
    (dict(whole_model=1), "whole_model must be True .* or False; got 1"),
])
def test_bad_whole_model_options_are_refused_by_name(options, message):
    model = ppdiffusers_tome.apply_cache(tiny_sd3_transformer(), interval=2)
    with pytest.raises(ValueError, match=message):
        ppdiffusers_tome.apply_cache(model, **{"whole_model": True, **options})
    assert get_cache(model).config.whole_model is False  # nothing changed


def test_a_model_without_latents_first_is_refused_and_static_graphs_refuse_by_name():
    with pytest.raises(ValueError, match="needs a denoiser whose forward takes the latents first"):
        ppdiffusers_tome.apply_cache(paddle.nn.Linear(2, 2), whole_model=True)
    model = ppdiffusers_tome.apply_cache(SD3Transformer2DModel(), whole_model=True, interval=2)
    static = paddle.jit.to_static(model.forward, full_graph=True)
    with pytest.raises(StepCacheError, match=r"whole_model=True.*remove_cache"):
        static(**stand_in_inputs(0), return_dict=False)


@pytest.mark.parametrize("copier", [lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy], ids=["pickle", "deepcopy"])
def test_a_copy_of_a_whole_model_cache_caches_the_same(copier):
    model = ppdiffusers_tome.apply_cache(SD3Transformer2DModel(), whole_model=True, threshold=0.25, forecast="linear")
    expected = outputs(model, 5)
    twin = copier(model)
    assert get_cache(twin) is not get_cache(model) and get_cache(twin).config == get_cache(model).config
    ppdiffusers_tome.reset_cache(twin)
    np.testing.assert_array_equal(np.stack(outputs(twin, 5)), np.stack(expected))

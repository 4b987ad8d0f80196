"""The step cache counts the pipeline's own denoising steps: every pipeline call that reaches a cached model starts
at step 0 whatever pipeline object made it, each call site of a step keeps its own features, schedulers that call the
model twice per step count one step, and copies, pickles, gradients and numpy integers behave."""

import copy
import inspect
import pickle

import numpy as np
import paddle
import pytest
from ppdiffusers import (
    HeunDiscreteScheduler,
    StableDiffusionControlNetImg2ImgPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionPipeline,
    StableDiffusionSAGPipeline,
)

import ppdiffusers_tome
from ppdiffusers_tome.cache.step_cache import CacheConfig, deep_blocks
from ppdiffusers_tome.testing import tiny_controlnet_pipeline, tiny_dit_pipeline, tiny_sd_pipeline, tiny_unet
from tests.conftest import run
from tests.test_pipelines import control_image

STEPS = 5
FULL = sum(CacheConfig(interval=3).is_full(step) for step in range(STEPS))  # steps 0 and 3


def built_from(cls, pipe):
    """A pipeline of class ``cls`` from ``pipe``'s components (those its constructor takes)."""
    wanted = inspect.signature(cls.__init__).parameters
    return cls(**{name: part for name, part in pipe.components.items() if name in wanted})


def img2img_from(pipe):
    return built_from(StableDiffusionImg2ImgPipeline, pipe)


@pytest.mark.parametrize("route", ["img2img from components", "unet only", "built before", "second pipeline",
                                   "pipeline then unet"])
def test_every_pipeline_call_that_reaches_a_cached_unet_starts_at_step_0(route, init_image):
    pipe = tiny_sd_pipeline()
    call = {}
    if route == "img2img from components":
        pipe.apply_cache(interval=3)
        pipe, call = img2img_from(pipe), dict(image=init_image, strength=1.0)
    elif route == "unet only":
        pipe.unet.apply_cache(interval=3)
    elif route == "built before":
        early = StableDiffusionPipeline(**pipe.components)
        pipe.apply_cache(interval=3)
        pipe = early
    elif route == "second pipeline":
        other = StableDiffusionPipeline(**pipe.components)
        other.apply_cache(interval=3)
        pipe.apply_cache(interval=3)
    else:
        pipe.apply_cache(interval=3)
        pipe.unet.apply_cache(interval=3)
    first = run(pipe, steps=STEPS, **call)
    second = run(pipe, steps=STEPS, **call)
    np.testing.assert_array_equal(first, second)
    status = ppdiffusers_tome.cache_status(pipe.unet)["UNet2DConditionModel"]
    assert (status["calls"], status["full_calls"]) == (2 * STEPS, 2 * FULL)


def test_a_controlnet_img2img_pipeline_built_from_a_cached_one_starts_at_step_0(init_image):
    pipe = tiny_controlnet_pipeline(1).apply_cache(interval=3)
    run(pipe, steps=STEPS, image=control_image())
    img2img = built_from(StableDiffusionControlNetImg2ImgPipeline, pipe)
    call = dict(image=init_image, control_image=control_image(), strength=1.0)
    first, second = run(img2img, steps=STEPS, **call), run(img2img, steps=STEPS, **call)
    np.testing.assert_array_equal(first, second)
    status = ppdiffusers_tome.cache_status(img2img)
    assert all((s["calls"], s["full_calls"]) == (3 * STEPS, 3 * FULL) for s in status.values()), status


def deep_outputs(unet):
    """Record the output of a deep block (it returns its kept output on a cached step) at every UNet call."""
    seen = []
    block = dict(deep_blocks(unet, 1))["up_blocks.0"]
    return seen, block.register_forward_post_hook(lambda layer, args, out: seen.append(out.numpy()))


def test_each_call_site_of_a_step_keeps_its_own_deep_features():
    """Self-attention guidance calls the UNet twice per step (the prompt, then the degraded latents): on a cached
    step each call gets the deep features of its own call at the last full step."""
    pipe = built_from(StableDiffusionSAGPipeline, tiny_sd_pipeline())
    pipe.apply_cache(interval=3)
    seen, handle = deep_outputs(pipe.unet)
    run(pipe, steps=3, guidance_scale=1.0, sag_scale=0.75)
    handle.remove()
    assert len(seen) == 6  # steps 0 (full), 1 and 2 (cached), two call sites each
    assert np.abs(seen[0] - seen[1]).max() > 1e-4  # the two sites' features differ at the full step
    for step in (1, 2):
        for site in (0, 1):
            np.testing.assert_array_equal(seen[2 * step + site], seen[site])


def test_a_scheduler_that_calls_the_unet_twice_per_step_counts_denoising_steps():
    """Heun calls the UNet twice per denoising step (the last step once): full_steps=(0, 1, 2) runs the calls of
    steps 0 to 2 in full, and interval=2 never switches between full and cached inside one step."""
    pipe = tiny_sd_pipeline()
    pipe.scheduler = HeunDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe.apply_cache(full_steps=(0, 1, 2))
    run(pipe, steps=6)
    status = ppdiffusers_tome.cache_status(pipe)["unet"]
    assert (status["calls"], status["full_calls"]) == (11, 6)
    pipe.apply_cache(interval=2)
    seen, handle = deep_outputs(pipe.unet)
    run(pipe, steps=6)
    handle.remove()
    status = ppdiffusers_tome.cache_status(pipe)["unet"]
    assert (status["calls"], status["full_calls"]) == (11, 6)  # steps 0, 2, 4: calls 0-1, 4-5, 8-9
    for cached in (2, 3, 6, 7, 10):  # the two calls of a cached step reuse their own site of the last full step
        np.testing.assert_array_equal(seen[cached], seen[cached - 2])


def test_a_cached_model_deep_copies_and_pickles_and_the_copies_compute_the_same():
    pipe = tiny_sd_pipeline().apply_tome(ratio=0.5).apply_cache(interval=2)
    expected = run(pipe, steps=4)
    for twin in (copy.deepcopy(pipe.unet), pickle.loads(pickle.dumps(pipe.unet))):
        other = StableDiffusionPipeline(**dict(pipe.components, unet=twin))
        np.testing.assert_array_equal(run(other, steps=4), expected)
        assert ppdiffusers_tome.cache_status(twin)["UNet2DConditionModel"]["settings"]["interval"] == 2
    ppdiffusers_tome.remove_cache(pipe)
    assert ppdiffusers_tome.cache_status(twin)["UNet2DConditionModel"] is not None  # copies are independent


def test_with_gradients_on_every_call_is_full_and_the_gradients_are_vanilla():
    unet = tiny_unet()
    rng = np.random.default_rng(4)
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    samples = [paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32")) for _ in range(3)]

    def gradients():
        grads = []
        for i, sample in enumerate(samples):
            unet.clear_gradients()
            unet(sample, paddle.to_tensor([900 - 100 * i] * 2), context).sample.square().mean().backward()
            grads.append(unet.conv_in.weight.grad.numpy().copy())
        return grads

    vanilla = gradients()
    unet.apply_cache(interval=3)
    cached = gradients()
    for a, b in zip(vanilla, cached):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    status = ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]
    assert status["grad_calls"] == 3 and status["cached_calls"] == 0


def test_numpy_integers_are_accepted_as_plain_values():
    unet = tiny_unet().apply_cache(interval=np.int64(3), depth=np.int32(1), start=np.int8(0), stop=np.uint16(9),
                                   full_steps=[np.int64(2)])
    settings = ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]["settings"]
    assert settings == {"interval": 3, "depth": 1, "layers": "auto", "start": 0, "stop": 9, "full_steps": (0, 2),
                        "threshold": None, "max_skips": None, "forecast": None, "whole_model": False}
    assert all(type(value) is int for value in (settings["interval"], settings["stop"], *settings["full_steps"]))


def test_status_remove_and_reset_answer_on_a_transformer_pipeline_without_a_cache():
    pipe = tiny_dit_pipeline()
    assert ppdiffusers_tome.cache_status(pipe) == {"transformer": None}
    assert ppdiffusers_tome.remove_cache(pipe) is pipe and ppdiffusers_tome.reset_cache(pipe) is pipe
    assert ppdiffusers_tome.tome_status(pipe)["transformer"]["cache"] is None


def cache_warnings(caught):
    return [str(w.message) for w in caught if "step cache" in str(w.message)]


def test_a_pipeline_call_with_no_cached_step_warns_once_and_names_why(init_image):
    """Steps are counted by the denoising loop, so a short run (img2img at strength 0.5 of 2 steps: 1 step) has no
    cached step: the cache computes every call in full and said nothing. It warns once, as ToMe's "merged nothing"
    warning does; a run with cached steps and an interrupted one do not warn."""
    import warnings

    pipe = img2img_from(tiny_sd_pipeline().apply_cache(interval=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(pipe, steps=3, image=init_image, strength=1.0)  # steps 0 (full), 1 and 2 (cached): silent
        assert cache_warnings(caught) == []
        calls = []
        handle = pipe.unet.conv_out.register_forward_pre_hook(
            lambda *_: calls.append(1) or (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):  # interrupted at step 0: not a run that finished
            run(pipe, steps=3, image=init_image, strength=1.0)
        handle.remove()
        assert cache_warnings(caught) == []
        run(pipe, steps=2, image=init_image, strength=0.5)  # one denoising step: all full
        run(pipe, steps=2, image=init_image, strength=0.5)
    found = cache_warnings(caught)
    assert len(found) == 1, found
    assert ("UNet2DConditionModel ran every call of a pipeline call in full (1 call, 1 denoising step)" in found[0]
            and "first cached step is step 1" in found[0] and "interval=3" in found[0]
            and "strength" in found[0]), found[0]
    status = ppdiffusers_tome.cache_status(pipe)["unet"]
    assert (status["cached_calls"], status["full_calls"]) == (2, 1 + 1 + 1)  # (the interrupted call is not counted)


def test_a_cache_that_never_caches_by_its_settings_does_not_warn():
    import warnings

    pipe = tiny_sd_pipeline().apply_cache(interval=1)  # every step full, as asked
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(pipe, steps=2)
    assert cache_warnings(caught) == []

"""Pickling: a patched model, pipeline or patch pickles to one patched the same way, keeps working in threads, and
its hooks never collide with hooks registered later in a fresh process."""

import pickle

# items 1, 5, 6, 7, 9: threads, a retry after a fault, early exceptions, non-finite timesteps ----------------------
import threading  # noqa: E402

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_dit_pipeline, tiny_dit_transformer, tiny_unet
from ppdiffusers_tome.tome.patch import get_patch
from tests.unet_calls import hook_shape, unet_output


def dit_output(model, seed=0):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    with paddle.no_grad():
        out = model(sample, timestep=paddle.to_tensor([700, 700]), class_labels=paddle.to_tensor([3, 5]))
    return out.sample.numpy()


# pickle --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["unet", "dit"])
def test_a_patched_model_pickles_to_a_model_patched_the_same_way(kind):
    model = tiny_unet() if kind == "unet" else tiny_dit_transformer()
    output = unet_output if kind == "unet" else dit_output
    unpatched_shape = hook_shape(model)
    vanilla = output(model)
    ppdiffusers_tome.apply_tome(model, ratio=0.5, seed=7, merge_mlp=True)
    patched = output(model)
    assert np.abs(patched - vanilla).max() > 1e-4  # ToMe changes the output (else the test proves nothing)
    stats_before = ppdiffusers_tome.tome_stats(model)

    twin = pickle.loads(pickle.dumps(model))

    patch, twin_patch = get_patch(model), get_patch(twin)
    assert twin_patch is not None and twin_patch is not patch and twin_patch.model is twin
    assert twin_patch.config == patch.config and twin_patch.train_timesteps == patch.train_timesteps
    assert ppdiffusers_tome.tome_stats(twin) == stats_before  # the counters travel, no call is in flight
    assert hook_shape(twin) == hook_shape(model)
    np.testing.assert_array_equal(output(twin), patched)  # same partition (seed, block, timestep, grid)
    np.testing.assert_array_equal(output(twin, seed=1), output(model, seed=1))
    name = type(model).__name__
    assert ppdiffusers_tome.tome_stats(model)[name]["calls"] == 2  # one before pickling, one since
    assert ppdiffusers_tome.tome_stats(twin)[name]["calls"] == 3  # the twin counts on from the pickled count

    ppdiffusers_tome.remove_tome(twin)
    assert get_patch(twin) is None and hook_shape(twin) == unpatched_shape
    np.testing.assert_array_equal(output(twin), vanilla)
    np.testing.assert_array_equal(output(model), patched)  # the original is unaffected
    assert get_patch(model) is patch


def test_a_pickled_patch_keeps_working_in_threads_and_can_be_pickled_again():
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5, recompute_every=2)
    reference = unet_output(unet)
    twin = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(unet))))
    results = {}

    def work():
        results["thread"] = unet_output(twin)


    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    np.testing.assert_array_equal(results["thread"], reference)


def test_a_patched_pipeline_pickles_when_the_pipeline_does():
    # SD-style pipelines do not pickle even without ToMe (paddlenlp's CLIPTokenizer keeps the `re` module as an
    # attribute); the DiT pipeline, which has no tokenizer, does
    pipe = tiny_dit_pipeline()

    def images(p):
        result = p(class_labels=[1, 4], num_inference_steps=2, generator=paddle.Generator().manual_seed(0), output_type="np")
        return result.images

    vanilla = images(pipe)
    pipe.apply_tome(ratio=0.5)
    patched = images(pipe)
    assert np.abs(patched - vanilla).max() > 1e-4
    twin = pickle.loads(pickle.dumps(pipe))
    assert ppdiffusers_tome.tome_config(twin.transformer) == ppdiffusers_tome.tome_config(pipe.transformer)
    np.testing.assert_array_equal(images(twin), patched)
    twin.remove_tome()
    np.testing.assert_array_equal(images(twin), vanilla)
    np.testing.assert_array_equal(images(pipe), patched)

"""Pickling: a patched model, pipeline or patch pickles to one patched the same way, keeps working in threads, and
its hooks never collide with hooks registered later in a fresh process."""

import pickle

# items 1, 5, 6, 7, 9: threads, a retry after a fault, early exceptions, non-finite timesteps ----------------------
import threading  # noqa: E402

import numpy as np
import paddle

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_dit_pipeline, tiny_unet
from tests.unet_calls import unet_output


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

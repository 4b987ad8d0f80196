"""Threads: two models, and one model called from two threads, keep their calls and plans apart."""

import numpy as np
import paddle

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_unet
from tests.unet_calls import unet_inputs


def test_two_models_with_different_settings_in_two_threads_do_not_mix():
    import threading

    unets = [tiny_unet(seed=0), tiny_unet(seed=1)]
    inputs = [unet_inputs(u, seed=i) for i, u in enumerate(unets)]
    for unet, ratio in zip(unets, (0.3, 0.6)):
        ppdiffusers_tome.apply_tome(unet, ratio=ratio, use_rand=True)
    with paddle.no_grad():
        expected = [u(*x).sample.numpy() for u, x in zip(unets, inputs)]
    results = {0: [], 1: []}

    def work(k):
        with paddle.no_grad():
            for _ in range(4):
                results[k].append(unets[k](*inputs[k]).sample.numpy())

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in (0, 1):
        assert len(results[k]) == 4
        for out in results[k]:
            np.testing.assert_array_equal(out, expected[k])


def test_one_model_called_from_two_threads_gives_each_call_its_own_plans():
    import threading

    unet = tiny_unet()
    inputs = [unet_inputs(unet, batch=2, seed=0), unet_inputs(unet, batch=1, hw=(12, 10), seed=1)]
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=2)
    with paddle.no_grad():
        expected = [unet(*x).sample.numpy() for x in inputs]
    results, errors = {0: [], 1: []}, []

    def work(k):
        try:
            with paddle.no_grad():
                for _ in range(4):
                    results[k].append(unet(*inputs[k]).sample.numpy())
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in (0, 1):
        for out in results[k]:
            np.testing.assert_array_equal(out, expected[k])

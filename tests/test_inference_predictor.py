"""The deployment path: a ToMe UNet and the step cache's two programs, saved with ``paddle.jit.save``, run in Paddle
Inference's CPU predictor (``paddle.inference``) with oneDNN turned off, and give the eager outputs. (Paddle's CPU
predictor turns oneDNN on by default and then fails on the vanilla UNet itself; ``config.disable_mkldnn()`` is the
line a user needs, as docs/design.md says.)"""

import os

import numpy as np
import paddle
import paddle.inference as paddle_infer
from paddle.static import InputSpec

import ppdiffusers_tome
from ppdiffusers_tome.cache.export import StepPrograms
from ppdiffusers_tome.testing import tiny_unet
from tests.tome.test_static_graph import NoisePredictor, small_unet
from tests.unet_calls import unet_inputs


def predictor(path):
    """A CPU predictor from the files ``paddle.jit.save`` wrote at ``path``, with oneDNN off."""
    suffixes = [(".json", ".pdiparams"), (".pdmodel", ".pdiparams")]
    model_file, params_file = next((path + m, path + p) for m, p in suffixes if os.path.exists(path + m))
    config = paddle_infer.Config(model_file, params_file)
    config.disable_mkldnn()
    config.disable_gpu()
    return paddle_infer.create_predictor(config)


def predict(pred, *arrays):
    for name, array in zip(pred.get_input_names(), arrays):
        pred.get_input_handle(name).copy_from_cpu(np.ascontiguousarray(array))
    pred.run()
    return [pred.get_output_handle(name).copy_to_cpu() for name in pred.get_output_names()]


def test_a_tome_unet_runs_in_the_cpu_predictor_as_eager(tmp_path):
    unet = small_unet()
    unet.apply_tome(ratio=0.5)
    model = NoisePredictor(unet)
    model.eval()
    inputs = unet_inputs(unet)
    with paddle.no_grad():
        eager = model(*inputs).numpy()
    spec = [InputSpec([None, 4, 16, 16], "float32"), InputSpec([None], "int64"), InputSpec([None, 5, 32], "float32")]
    path = str(tmp_path / "unet")
    paddle.jit.save(paddle.jit.to_static(model, input_spec=spec, full_graph=True), path)
    (got,) = predict(predictor(path), *(x.numpy() for x in inputs))
    np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-5)
    ppdiffusers_tome.remove_tome(unet)
    with paddle.no_grad():
        assert np.abs(model(*inputs).numpy() - eager).max() > 1e-4  # the program holds ToMe, the eager model no more


def test_the_step_caches_two_programs_run_in_the_cpu_predictor_as_the_eager_cache(tmp_path):
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=2)
    inputs = unet_inputs(unet)
    programs = StepPrograms(unet)
    spec = [InputSpec(x.shape, x.dtype) for x in inputs]
    feature_spec = programs.feature_spec(*inputs)
    full_path, cached_path = str(tmp_path / "full"), str(tmp_path / "cached")
    paddle.jit.save(paddle.jit.to_static(programs.full, input_spec=spec, full_graph=True), full_path)
    paddle.jit.save(paddle.jit.to_static(programs.cached, input_spec=[feature_spec] + spec, full_graph=True), cached_path)
    later = (inputs[0] * 0.5, paddle.to_tensor([300, 300], dtype="int64"), inputs[2])
    with paddle.no_grad():
        ppdiffusers_tome.reset_cache(unet)
        eager = [unet(*args).sample.numpy() for args in (inputs, later)]  # a full step, then a cached one
    sample, feature = predict(predictor(full_path), *(x.numpy() for x in inputs))
    (cached,) = predict(predictor(cached_path), feature, *(x.numpy() for x in later))
    np.testing.assert_allclose(sample, eager[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cached, eager[1], rtol=1e-5, atol=1e-5)
    assert np.abs(cached - eager[0]).max() > 1e-4

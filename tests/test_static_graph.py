"""A ToMe-patched UNet converted with paddle.jit.to_static and saved with paddle.jit.save for Paddle Inference
(ppdiffusers_tome/patch.py and merge.py under static-graph tracing), with a fixed and with a dynamic batch."""

import numpy as np
import paddle
import pytest
from paddle.static import InputSpec

import ppdiffusers_tome
from ppdiffusers_tome.patch import ToMeStaticGraphError
from ppdiffusers_tome.testing import tiny_unet
from tests.test_patch import unet_inputs


class NoisePredictor(paddle.nn.Layer):
    """The UNet with plain tensor inputs and output, as exported for inference."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, context):
        return self.unet(sample, timestep, context).sample


def small_unet():
    return tiny_unet(
        block_out_channels=(32, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )


SPEC = [InputSpec([2, 4, 16, 16], "float32"), InputSpec([2], "int64"), InputSpec([2, 5, 32], "float32")]


@pytest.mark.parametrize(
    "full_graph, options",
    [(True, dict(ratio=0.5, use_rand=False)), (False, dict(ratio=0.5, use_rand=False)), (True, dict(method="todo"))],
    ids=["ast", "sot", "todo-ast"],
)
def test_patched_unet_converts_saves_and_loads_with_same_output(tmp_path, full_graph, options):
    unet = small_unet()
    inputs = unet_inputs(unet)
    with paddle.no_grad():
        vanilla = unet(*inputs).sample.numpy()
    unet.apply_tome(**options)  # (ToDo has no randomness: its default use_rand=True does not matter)
    with paddle.no_grad():
        dynamic = unet(*inputs).sample.numpy()
    assert np.abs(dynamic - vanilla).max() > 1e-4  # ToMe is active in the dynamic model

    model = NoisePredictor(unet)
    model.eval()
    static = paddle.jit.to_static(model, input_spec=SPEC, full_graph=full_graph)
    np.testing.assert_allclose(static(*inputs).numpy(), dynamic, rtol=1e-5, atol=1e-5)
    path = str(tmp_path / "unet")
    paddle.jit.save(static, path)
    loaded = paddle.jit.load(path)
    np.testing.assert_allclose(loaded(*inputs).numpy(), dynamic, rtol=1e-5, atol=1e-5)


DYNAMIC_SPEC = [InputSpec([None, 4, 16, 16], "float32"), InputSpec([None], "int64"), InputSpec([None, 5, 32], "float32")]


@pytest.mark.parametrize(
    "options",
    [dict(), dict(method="todo"), dict(use_rand=False), dict(match_window=8, share_plan="level")],
    ids=["defaults", "todo", "no-rand", "local-shared"],
)
def test_export_with_a_dynamic_batch_follows_the_timestep_inside_the_program(tmp_path, options):
    """The defaults (random partition keyed by the timestep tensor) export with a dynamic batch; the loaded program
    equals the eager patched model at batch 1, 2 and 3 and at two timesteps, so the partition is computed inside
    the program from its timestep input, not frozen at conversion."""
    unet = small_unet()
    unet.apply_tome(ratio=0.5, **options)
    model = NoisePredictor(unet)
    model.eval()
    static = paddle.jit.to_static(model, input_spec=DYNAMIC_SPEC, full_graph=True)
    path = str(tmp_path / "unet")
    paddle.jit.save(static, path)
    loaded = paddle.jit.load(path)
    rng = np.random.default_rng(0)
    outputs = {}
    for batch in (1, 2, 3):
        sample = paddle.to_tensor(rng.standard_normal((batch, 4, 16, 16)).astype("float32"))
        context = paddle.to_tensor(rng.standard_normal((batch, 5, 32)).astype("float32"))
        for t in (999, 501):
            timestep = paddle.full([batch], t, dtype="int64")
            with paddle.no_grad():
                eager = model(sample, timestep, context).numpy()
            np.testing.assert_allclose(loaded(sample, timestep, context).numpy(), eager, rtol=1e-5, atol=1e-5)
            outputs[batch, t] = eager
    if options.get("use_rand", True) and "method" not in options:  # a random partition follows the timestep
        assert np.abs(outputs[2, 999] - outputs[2, 501]).max() > 0


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(use_rand=False, ratio=(0.6, 0.3)), "a ratio schedule"),
        (dict(use_rand=False, recompute_every=3), "recompute_every"),
        (dict(ratio=(0.6, 0.3)), "a ratio schedule"),
    ],
)
def test_options_that_change_shapes_by_timestep_refuse_conversion_with_a_clear_error(tmp_path, options, named):
    unet = small_unet()
    unet.apply_tome(**options)
    static = paddle.jit.to_static(NoisePredictor(unet), input_spec=SPEC, full_graph=True)
    with pytest.raises(ToMeStaticGraphError, match=f"ToMe with {named} cannot be converted"):
        paddle.jit.save(static, str(tmp_path / "unet"))
    ppdiffusers_tome.remove_tome(unet)  # the dynamic model is still fine afterwards
    with paddle.no_grad():
        assert np.isfinite(unet(*unet_inputs(unet)).sample.numpy()).all()


def test_min_tokens_refuses_a_dynamic_batch_with_a_clear_error(tmp_path):
    # batch * tokens is unknown in a program with a dynamic batch; a fixed batch converts
    unet = small_unet()
    unet.apply_tome(min_tokens=100)
    static = paddle.jit.to_static(NoisePredictor(unet), input_spec=DYNAMIC_SPEC, full_graph=True)
    with pytest.raises(ToMeStaticGraphError, match="min_tokens=100"):
        paddle.jit.save(static, str(tmp_path / "unet"))
    fixed = paddle.jit.to_static(NoisePredictor(unet), input_spec=SPEC, full_graph=True)
    inputs = unet_inputs(unet)
    with paddle.no_grad():
        np.testing.assert_allclose(fixed(*inputs).numpy(), unet(*inputs).sample.numpy(), rtol=1e-5, atol=1e-5)

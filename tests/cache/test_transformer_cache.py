"""The step cache on transformer-only models (SD3's MMDiT, DiT, PixArt-alpha): the first and last ``depth``
transformer blocks run on every step, the blocks between add on a cached step what they added on the last full step
(output minus input, per stream). Checked against a reference built from plain Paddle forward post-hooks, and
composed with ToMe on SD3 (interval 1 and the counts on pipelines: tests/techniques/test_step_cache.py)."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.cache.step_cache import CacheConfig, get_cache
from ppdiffusers_tome.testing import tiny_dit_transformer, tiny_sd3_pipeline, tiny_sd3_transformer
from ppdiffusers_tome.tome.patch import get_patch
from tests.conftest import generator
from tests.unet_calls import hook_shape

LAYERS = 5  # blocks of the models checked against the reference: depth 1 leaves 3 blocks between, depth 2 one


# the models and their inputs --------------------------------------------------------------------------------------
def sd3_step(timestep, seed):
    rng = np.random.default_rng(seed)
    arrays = (rng.standard_normal((2, 16, 16, 16)), rng.standard_normal((2, 7, 96)), rng.standard_normal((2, 64)))
    latents, text, pooled = (paddle.to_tensor(a.astype("float32")) for a in arrays)
    return (latents, text, pooled, paddle.to_tensor([timestep, timestep], dtype="float32")), {}


def dit_step(timestep, seed):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    return (sample,), dict(timestep=paddle.to_tensor([timestep, timestep], dtype="int64"),
                           class_labels=paddle.to_tensor([3, 5]))


def pixart_step(timestep, seed):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    return (sample, context, paddle.to_tensor([timestep, timestep], dtype="int64")), dict(
        added_cond_kwargs={"resolution": None, "aspect_ratio": None})


MODELS = {
    "sd3": (lambda: tiny_sd3_transformer(num_layers=LAYERS), sd3_step, True),
    "dit": (lambda: tiny_dit_transformer("ada_norm_zero", num_layers=LAYERS), dit_step, False),
    "pixart-alpha": (lambda: tiny_dit_transformer("ada_norm_single", num_layers=LAYERS), pixart_step, False),
}


def output(model, step):
    args, kwargs = step
    with paddle.no_grad():
        return model(*args, **kwargs, return_dict=False)[0].numpy()


class SegmentReference:
    """The cached step written with plain Paddle forward post-hooks on the blocks between the first and last
    ``depth`` ones, without any of the cache's code. While ``recording``, the first of them keeps its input streams
    and the last its output streams; while replaying, the first returns its input plus (kept last output - kept
    first input) per stream (only the streams in ``streams``; the others pass through) and the later ones return
    their input."""

    def __init__(self, model, depth, joint):
        blocks = list(model.transformer_blocks)[depth: len(model.transformer_blocks) - depth]
        self.joint, self.recording, self.streams = joint, True, (0, 1)
        self.first_input = self.last_output = None
        self.handles = [block.register_forward_post_hook(self._hook(i == 0, i == len(blocks) - 1), with_kwargs=True)
                        for i, block in enumerate(blocks)]

    def _inputs(self, args, kwargs):
        image = args[0] if args else kwargs["hidden_states"]
        if not self.joint:
            return (image,)
        return image, args[1] if len(args) > 1 else kwargs["encoder_hidden_states"]

    def _as_output(self, streams):
        return (streams[1], streams[0]) if self.joint else streams[0]  # a joint block returns (text, image)

    def _hook(self, first, last):
        def hook(layer, args, kwargs, out):
            inputs = self._inputs(args, kwargs)
            if self.recording:
                if first:
                    self.first_input = inputs
                if last:
                    self.last_output = (out[1], out[0]) if self.joint else (out,)
                return None
            if not first:
                return self._as_output(inputs)
            return self._as_output(tuple(x + (end - start) if i in self.streams else x for i, (x, start, end) in
                                         enumerate(zip(inputs, self.first_input, self.last_output))))
        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


def counting(layer):
    calls = []
    return calls, layer.register_forward_pre_hook(lambda *_: calls.append(1))


def inner_layer(block):
    """A layer every transformer block calls once per call (its attention's query projection)."""
    return block.attn.to_q if hasattr(block, "attn") else block.attn1.to_q


# a cached step against the reference -----------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_cached_step_adds_the_kept_contribution_of_the_blocks_between_as_a_hook_reference_does(kind, depth):
    build, make_step, joint = MODELS[kind]
    model = build()
    steps = [make_step(900, 0), make_step(800, 1)]  # two steps: other timesteps, other latents
    vanilla = output(model, steps[1])
    reference = SegmentReference(model, depth, joint)
    output(model, steps[0])
    reference.recording = False
    expected = output(model, steps[1])
    if joint:  # the text stream's contribution matters too: without it the result is another one
        reference.streams = (0,)
        image_only = output(model, steps[1])
    reference.remove()
    np.testing.assert_array_equal(output(model, steps[1]), vanilla)  # the hooks are gone

    ppdiffusers_tome.apply_cache(model, interval=2, depth=depth)
    blocks = list(model.transformer_blocks)
    counts = {i: counting(inner_layer(block)) for i, block in enumerate(blocks)}
    full = output(model, steps[0])
    for calls, _ in counts.values():
        calls.clear()
    cached = output(model, steps[1])
    for _, handle in counts.values():
        handle.remove()
    runs = [i for i, (calls, _) in counts.items() if calls]
    assert runs == list(range(depth)) + list(range(LAYERS - depth, LAYERS))  # the blocks between did not run
    np.testing.assert_allclose(cached, expected, rtol=1e-6, atol=1e-6)
    assert np.abs(cached - vanilla).max() > 1e-4  # the cached step is not the full one (the test can fail)
    if joint:
        assert np.abs(cached - image_only).max() > 1e-5
    status = ppdiffusers_tome.cache_status(model)[type(model).__name__]
    assert status["deep_blocks"] == LAYERS - 2 * depth
    assert (status["calls"], status["full_calls"], status["cached_calls"]) == (2, 1, 1)
    assert np.isfinite(full).all()


# pipelines -----------------------------------------------------------------------------------------------------------
def run(pipe, kwargs, steps):
    return pipe(num_inference_steps=steps, generator=generator(0), output_type="np", **kwargs).images


@pytest.mark.parametrize("first", ["tome", "cache"])
def test_cache_and_tome_compose_in_either_order_on_sd3(first):
    pipe = tiny_sd3_pipeline()
    kwargs, steps = dict(prompt="a red cube", height=32, width=32), 4
    vanilla = run(pipe, kwargs, steps)
    apply = {"tome": lambda: pipe.apply_tome(ratio=0.5, merge_mlp=True), "cache": lambda: pipe.apply_cache(interval=2)}
    for name in ([first, "cache" if first == "tome" else "tome"]):
        apply[name]()
    together = run(pipe, kwargs, steps)
    stats = ppdiffusers_tome.tome_stats(pipe)["transformer"]
    status = ppdiffusers_tome.cache_status(pipe)["transformer"]
    assert (status["full_calls"], status["cached_calls"]) == (2, 2)
    # ToMe plans and merges only in the blocks that run: 3 blocks on the 2 full steps, the 2 outer ones on the cached
    assert stats["plans_computed"] == 3 * 2 + 2 * 2 and stats["merges"] == 2 * stats["plans_computed"]
    pipe.remove_cache()
    only_tome = run(pipe, kwargs, steps)
    assert get_patch(pipe.transformer) is not None
    assert ppdiffusers_tome.tome_status(pipe)["transformer"]["cache"] is None
    pipe.apply_cache(interval=2)
    np.testing.assert_array_equal(run(pipe, kwargs, steps), together)  # the other order: the same images
    pipe.remove_tome()
    only_cache = run(pipe, kwargs, steps)
    pipe.remove_cache()
    np.testing.assert_array_equal(run(pipe, kwargs, steps), vanilla)
    assert len({a.tobytes() for a in (vanilla, together, only_tome, only_cache)}) == 4


# refusals ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sd3", "dit"])
def test_a_depth_that_leaves_no_block_between_is_refused_by_name_and_changes_nothing(kind):
    model = tiny_sd3_transformer() if kind == "sd3" else tiny_dit_transformer()  # 3 blocks: only depth 1 fits
    ppdiffusers_tome.apply_cache(model, interval=2)
    before = hook_shape(model)
    for depth in (2, 5):
        with pytest.raises(ValueError, match=r"depth must be in \[1, 1\] for .*3 transformer blocks"):
            ppdiffusers_tome.apply_cache(model, interval=3, depth=depth)
    with pytest.raises(ValueError, match="layers=1 cuts inside a UNet's first level"):
        ppdiffusers_tome.apply_cache(model, layers=1)
    assert hook_shape(model) == before and get_cache(model).config == CacheConfig(interval=2)

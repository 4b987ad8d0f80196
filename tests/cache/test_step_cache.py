"""The step cache (``apply_cache``): vanilla at interval 1, the deep features of the last full step on the steps
between (checked against a reference built from plain forward hooks; every pipeline kind: tests/techniques/), threads,
interrupted calls, composition with ToMe, bad options and static graphs."""


import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.cache.step_cache import CacheConfig, StepCacheError, deep_blocks, get_cache
from ppdiffusers_tome.core.registry import hooks_of
from ppdiffusers_tome.testing import tiny_sd_pipeline, tiny_unet
from ppdiffusers_tome.tome.patch import get_patch
from tests.conftest import run
from tests.thread_runs import alone_and_together
from tests.unet_calls import step_sample

STEPS = 6


def counting(layer):
    """Count the calls of ``layer`` (a pre-hook; returns a list whose length is the count and the hook handle)."""
    calls = []
    handle = layer.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


def test_a_cached_step_equals_the_unet_with_its_deep_outputs_replaced_by_those_of_the_last_full_step():
    """Reference without the cache's code: plain forward post-hooks record the deep blocks' outputs at a full step
    and substitute them at the next step; the cached UNet's output must be the same."""
    unet = tiny_unet()
    rng = np.random.default_rng(0)
    inputs = [(paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32")), paddle.to_tensor([t, t]),
               paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))) for t in (900, 800)]
    kept, handles = {}, []
    for name, block in deep_blocks(unet, 1):
        def record(layer, args, out, name=name):
            if name in kept and "replace" in kept:
                return kept[name]
            kept[name] = out
            return None
        handles.append(block.register_forward_post_hook(record))
    with paddle.no_grad():
        unet(*inputs[0])
        kept["replace"] = True
        expected = unet(*inputs[1]).sample.numpy()
        for handle in handles:
            handle.remove()
        vanilla = unet(*inputs[1]).sample.numpy()
        ppdiffusers_tome.apply_cache(unet, interval=2)
        unet(*inputs[0])
        got = unet(*inputs[1]).sample.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert np.abs(got - vanilla).max() > 1e-4  # the second step really used the kept features


def test_remove_cache_gives_every_block_its_own_class_and_attributes_back():
    unet = tiny_unet()
    layers = [unet] + [block for _, block in deep_blocks(unet, 1)]
    before = [(type(layer), set(layer.__dict__)) for layer in layers]
    ppdiffusers_tome.apply_cache(unet, interval=2)
    assert all(hooks_of(layer) is not None and type(layer) is not cls for layer, (cls, _) in zip(layers, before))
    ppdiffusers_tome.remove_cache(unet)
    assert [(type(layer), set(layer.__dict__)) for layer in layers] == before
    assert not unet._forward_pre_hooks and not unet._forward_post_hooks and get_cache(unet) is None
    ppdiffusers_tome.remove_cache(unet)  # a second removal is a no-op


def test_every_pipeline_call_starts_a_fresh_history():
    pipe = tiny_sd_pipeline().apply_cache(interval=3)
    first = run(pipe, steps=5)
    second = run(pipe, steps=5)
    np.testing.assert_array_equal(first, second)
    status = ppdiffusers_tome.cache_status(pipe)["unet"]
    assert (status["calls"], status["full_calls"]) == (10, 4)  # steps 0 and 3 of each call


def test_the_schedule_options_choose_the_full_steps():
    assert [s for s in range(12) if CacheConfig(interval=4, start=2, stop=10).is_full(s)] == [0, 1, 2, 6, 10, 11]
    config = CacheConfig(full_steps=[5, 1, 2])
    assert config.full_steps == (0, 1, 2, 5) and [s for s in range(7) if config.is_full(s)] == [0, 1, 2, 5]
    pipe = tiny_sd_pipeline().apply_cache(full_steps=(0, 1, 3))
    run(pipe, steps=5)
    assert ppdiffusers_tome.cache_status(pipe)["unet"]["full_calls"] == 3


def test_a_deeper_shallow_branch_keeps_fewer_blocks_deep():
    unet = tiny_unet(block_out_channels=(32, 32, 64), down_block_types=("CrossAttnDownBlock2D",) * 3,
                     up_block_types=("CrossAttnUpBlock2D",) * 3)
    assert len(deep_blocks(unet, 2)) == len(deep_blocks(unet, 1, layers=None)) - 2  # the whole first level
    with pytest.raises(ValueError, match=r"depth must be in \[1, 2\]"):
        ppdiffusers_tome.apply_cache(unet, depth=3)


def test_threads_keep_separate_histories_on_one_unet():
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=3)
    rng = np.random.default_rng(1)
    streams = [[(paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32")), paddle.to_tensor([t, t]),
                 paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))) for t in (900, 700, 500, 300)]
               for _ in range(2)]

    def call(args):
        with paddle.no_grad():
            return unet(*args).sample.numpy()

    alone, together = alone_and_together(call, streams, reset=lambda: ppdiffusers_tome.reset_cache(unet))
    for a, b in zip(alone, together):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_an_interrupted_call_leaves_nothing_for_the_next_call():
    pipe = tiny_sd_pipeline().apply_cache(interval=3)
    expected = run(pipe, steps=5)
    deep = dict(deep_blocks(pipe.unet, 1))["down_blocks.1"].resnets[0]
    state = {"calls": 0}

    def interrupt(*_):
        state["calls"] += 1
        if state["calls"] == 2:  # the second full step (step 3)
            raise KeyboardInterrupt

    handle = deep.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(pipe, steps=5)
    handle.remove()
    np.testing.assert_array_equal(run(pipe, steps=5), expected)
    # a model called directly: the interrupted call keeps nothing, so the next call runs in full
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=3)
    context = paddle.to_tensor(np.random.default_rng(9).standard_normal((2, 5, 32)).astype("float32"))
    inputs = [(step_sample(seed), paddle.to_tensor([t, t]), context) for seed, t in ((1, 900), (2, 800))]
    with paddle.no_grad():
        fresh = [unet(*args).sample.numpy() for args in inputs]
        ppdiffusers_tome.reset_cache(unet)
        handle = dict(deep_blocks(unet, 1))["down_blocks.1"].resnets[0].register_forward_pre_hook(interrupt)
        state["calls"] = 1  # the next call is interrupted inside its first deep block
        with pytest.raises(KeyboardInterrupt):
            unet(*inputs[0])
        handle.remove()
        again = unet(*inputs[1]).sample.numpy()
        ppdiffusers_tome.remove_cache(unet)
        full = unet(*inputs[1]).sample.numpy()
    np.testing.assert_array_equal(again, full)  # nothing kept from the interrupted call: a full step
    assert np.abs(fresh[1] - full).max() > 1e-5  # (while after a full first call the second one is cached)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("at", [1, 3], ids=["cached-step", "full-step"])
def test_a_call_that_did_not_finish_leaves_the_steps_and_the_kept_features_as_it_found_them(error, at):
    """A model called directly: a call ended by Ctrl-C or an error (late, in conv_out, on other latents) is not a
    step and keeps nothing, so the retried step and the steps after it compute what an uninterrupted run computes.
    It once counted as a step and dropped its site's kept features."""
    context = paddle.to_tensor(np.random.default_rng(9).standard_normal((2, 5, 32)).astype("float32"))
    inputs = [(step_sample(seed), paddle.to_tensor([t, t]), context) for seed, t in enumerate((900, 700, 500, 300, 100))]

    def steps(unet, indices):
        with paddle.no_grad():
            return [unet(*inputs[i]).sample.numpy() for i in indices]

    fresh = ppdiffusers_tome.apply_cache(tiny_unet(), interval=3)
    expected = steps(fresh, range(5))
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=3)
    got = steps(unet, range(at))

    def fail(*_):
        raise error()

    handle = unet.conv_out.register_forward_pre_hook(fail)
    with paddle.no_grad(), pytest.raises(error):
        unet(step_sample(99), paddle.to_tensor([999, 999]), context)
    handle.remove()
    got += steps(unet, range(at, 5))
    for i, (a, b) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
    status = ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]
    assert (status["calls"], status["full_calls"], status["cached_calls"]) == (5, 2, 3)


@pytest.mark.parametrize("first", ["tome", "cache"])
def test_cache_and_tome_compose_in_either_order_and_come_off_one_by_one(first):
    pipe = tiny_sd_pipeline()
    vanilla = run(pipe, steps=STEPS)
    both = [lambda: pipe.apply_tome(ratio=0.5), lambda: pipe.apply_cache(interval=3)]
    for apply in (both if first == "tome" else both[::-1]):
        apply()
    together = run(pipe, steps=STEPS)
    status = ppdiffusers_tome.tome_status(pipe)["unet"]
    assert status["active"] == "ppdiffusers_tome" and status["cache"]["settings"]["interval"] == 3
    assert ppdiffusers_tome.tome_stats(pipe)["unet"]["merges"] > 0
    pipe.remove_cache()
    only_tome = run(pipe, steps=STEPS)
    assert get_patch(pipe.unet) is not None and ppdiffusers_tome.tome_status(pipe)["unet"]["cache"] is None
    pipe.apply_cache(interval=3)
    np.testing.assert_array_equal(run(pipe, steps=STEPS), together)
    pipe.remove_tome()
    only_cache = run(pipe, steps=STEPS)
    pipe.remove_cache()
    np.testing.assert_array_equal(run(pipe, steps=STEPS), vanilla)
    assert len({a.tobytes() for a in (vanilla, together, only_tome, only_cache)}) == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(interval=0), "interval must be an integer >= 1"),
    (dict(interval=2.5), "interval must be an integer >= 1"),
    (dict(depth=0), "depth must be an integer >= 1"),
    (dict(start=-1), "start must be an integer >= 0"),
    (dict(start=4, stop=4), "stop must be None or an integer > start=4"),
    (dict(full_steps=[]), "full_steps must be None or a non-empty"),
    (dict(full_steps=[1, -2]), "full_steps must be None or a non-empty"),
    (dict(depth=5), r"depth must be in \[1, 2\]"),
])
def test_bad_options_are_refused_by_name_and_leave_the_pipeline_as_it_was(kwargs, message):
    pipe = tiny_sd_pipeline().apply_cache(interval=2)
    with pytest.raises(ValueError, match=message):
        pipe.apply_cache(**kwargs)
    assert ppdiffusers_tome.cache_status(pipe)["unet"]["settings"]["interval"] == 2
    with pytest.raises(ValueError, match="needs a UNet2DConditionModel, a ControlNetModel"):
        ppdiffusers_tome.apply_cache(pipe.vae)


def test_a_cached_step_with_another_input_shape_runs_in_full():
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=4)
    rng = np.random.default_rng(2)
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    small = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    large = paddle.to_tensor(rng.standard_normal((2, 4, 24, 24)).astype("float32"))
    with paddle.no_grad():
        unet(small, paddle.to_tensor([900, 900]), context)
        got = unet(large, paddle.to_tensor([800, 800]), context).sample.numpy()
        ppdiffusers_tome.remove_cache(unet)
        expected = unet(large, paddle.to_tensor([800, 800]), context).sample.numpy()
    np.testing.assert_array_equal(got, expected)


def test_conversion_to_a_static_graph_is_refused_with_a_clear_error():
    unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=2)

    class Predictor(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.unet = unet

        def forward(self, sample, timestep, context):
            return self.unet(sample, timestep, context).sample

    static = paddle.jit.to_static(Predictor(), full_graph=True, input_spec=[
        paddle.static.InputSpec([2, 4, 16, 16], "float32"), paddle.static.InputSpec([2], "int64"),
        paddle.static.InputSpec([2, 5, 32], "float32")])
    with pytest.raises(StepCacheError, match="StepPrograms.*remove_cache"):
        paddle.jit.save(static, "/tmp/never_written_step_cache_unet")


def test_bench_measures_the_cache_alone_and_with_tome_but_not_in_one_unet_forward():
    from ppdiffusers_tome.tools.bench.methods import BenchSettings, configure, method_list, parse_variant

    settings = BenchSettings(methods=("vanilla", "tome", "cache"), ratios=(0.5,),
                             variants=("cache:interval=2", "tome:cache=3", "todo:cache=3"))
    assert [m.label for m in method_list(settings)] == ["vanilla", "tome@0.5", "cache3", "cache2", "tome@0.5+cache3",
                                                        "todo+cache3"]
    with pytest.raises(ValueError, match="--unet-only"):
        method_list(BenchSettings(methods=("vanilla", "cache"), unet_only=True))
    with pytest.raises(ValueError, match="interval must be an integer >= 1"):
        parse_variant("tome:cache=0")
    pipe = tiny_sd_pipeline()
    configure(pipe, parse_variant("tome:cache=3,ratio=0.5"), "auto")
    assert get_cache(pipe.unet).config.interval == 3 and get_patch(pipe.unet) is not None
    configure(pipe, method_list(settings)[0], "auto")  # vanilla: both off
    assert get_cache(pipe.unet) is None and get_patch(pipe.unet) is None

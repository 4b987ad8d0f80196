"""Reliability defects of issue #11 found by trying to break the package: pickling a patched model (item 3),
arrays and tensors as arguments of apply_tome (item 8, see test_config.py for every field), and the rollback of a
failed apply_tome on a model carrying ppdiffusers' built-in ToMe port (item 10)."""

import pickle

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.patch import ModelPatch, get_patch
from ppdiffusers_tome.testing import tiny_dit_pipeline, tiny_dit_transformer, tiny_unet


def unet_inputs(unet, seed=0):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, unet.config.cross_attention_dim)).astype("float32"))
    return sample, paddle.to_tensor([500, 500], dtype="int64"), context


def unet_output(unet, seed=0):
    sample, t, context = unet_inputs(unet, seed)
    with paddle.no_grad():
        return unet(sample, t, context).sample.numpy()


def dit_output(model, seed=0):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    with paddle.no_grad():
        out = model(sample, timestep=paddle.to_tensor([700, 700]), class_labels=paddle.to_tensor([3, 5]))
    return out.sample.numpy()


def hook_tables(model):
    """Every forward hook of every sub-layer: (layer index, table, hook id, hook object), in order."""
    rows = []
    for i, layer in enumerate(model.sublayers(include_self=True)):
        for table in ("_forward_pre_hooks", "_forward_post_hooks"):
            rows.extend((i, table, hook_id, hook) for hook_id, hook in getattr(layer, table).items())
    return rows


def hook_shape(model):
    return [(i, table) for i, table, _, _ in hook_tables(model)]


# item 3: pickle --------------------------------------------------------------------------------------------------
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

    import threading

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


# item 8: arrays and tensors at apply_tome ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_downsample=paddle.to_tensor([1, 2])), r"^max_downsample must be 'auto' or one of \(1, 2, 4, 8\)"),
        (dict(max_downsample=np.array([1, 2])), r"^max_downsample must be 'auto' or one of \(1, 2, 4, 8\)"),
        (dict(method=paddle.to_tensor([1, 2])), r"^method must be one of \('tome', 'todo'\)"),
        (dict(method=np.array(["todo"])), r"^method must be one of \('tome', 'todo'\)"),
        (dict(method="todo", downsample_mode=np.array(["average", "nearest"])), r"^downsample_mode must be one of"),
        (dict(sx=10**4), r"^sx must be an integer >= 1 and <= 64"),
        (dict(sy=2**40), r"^sy must be an integer >= 1 and <= 64"),
        (dict(ratio=paddle.to_tensor(0.5)), r"^ratio must be a number in \[0, 0.75\)"),
    ],
)
def test_array_tensor_and_huge_arguments_are_refused_by_name_and_leave_the_model_as_it_was(kwargs, message):
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.3)
    patch, hooks = get_patch(unet), hook_tables(unet)
    with pytest.raises(ValueError, match=message):
        ppdiffusers_tome.apply_tome(unet, **kwargs)
    assert get_patch(unet) is patch and hook_tables(unet) == hooks


def test_numpy_scalars_are_applied_as_plain_values():
    unet = tiny_unet()
    ppdiffusers_tome.apply_tome(unet, ratio=np.float64(0.5), sx=np.int64(2), max_downsample=np.int32(1), seed=np.uint8(4))
    reference = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5, sx=2, max_downsample=1, seed=4)
    assert ppdiffusers_tome.tome_config(unet) == ppdiffusers_tome.tome_config(reference)
    np.testing.assert_array_equal(unet_output(unet), unet_output(reference))


# item 10: rollback with ppdiffusers' built-in port ----------------------------------------------------------------
def builtin_apply(model, **kwargs):
    return paddle.nn.Layer.apply_tome(model, **kwargs)  # ppdiffusers' own port, still attached to nn.Layer


def builtin_snapshot(model):
    """Everything the built-in port put on ``model``: block classes, ``_tome_info`` objects, hook handles."""
    layers = model.sublayers(include_self=True)
    infos = [layer.__dict__.get("_tome_info") for layer in layers]
    return {
        "classes": [type(layer) for layer in layers],
        "infos": [id(info) if info is not None else None for info in infos],
        "handles": [list(info["hooks"]) if info is not None else None for info in infos],
        "args": [dict(info["args"]) if info is not None else None for info in infos],
        "hooks": hook_tables(model),
    }


def fail_install_on(monkeypatch, victim):
    real_install = ModelPatch.install.__func__

    def install(cls, model, *args, **kwargs):
        if model is victim:
            raise RuntimeError("install failed half-way")
        return real_install(cls, model, *args, **kwargs)

    monkeypatch.setattr(ModelPatch, "install", classmethod(install))


@pytest.mark.parametrize("second_has_builtin", [False, True])
def test_a_failure_half_way_leaves_the_builtin_port_exactly_as_it_was(monkeypatch, second_has_builtin):
    first, second = tiny_unet(), tiny_unet(seed=1)
    vanilla = unet_output(first)
    builtin_apply(first, ratio=0.5, use_rand=False)
    if second_has_builtin:
        builtin_apply(second, ratio=0.6, use_rand=False)
    with_builtin = unet_output(first)
    assert np.abs(with_builtin - vanilla).max() > 1e-4  # the built-in port is active
    assert any(type(m).__name__.startswith("ToMe") for m in first.sublayers())
    before = [builtin_snapshot(first), builtin_snapshot(second)]
    second_before = unet_output(second)

    fail_install_on(monkeypatch, second)
    with pytest.raises(RuntimeError, match="install failed half-way"):
        ppdiffusers_tome.apply_tome([first, second], ratio=0.4)

    assert get_patch(first) is None and get_patch(second) is None
    assert [builtin_snapshot(first), builtin_snapshot(second)] == before  # same classes, objects and hooks
    np.testing.assert_array_equal(unet_output(first), with_builtin)  # the built-in hooks still feed it sizes
    np.testing.assert_array_equal(unet_output(second), second_before)
    paddle.nn.Layer.remove_tome(first)  # and the built-in port can still take itself off
    np.testing.assert_array_equal(unet_output(first), vanilla)


def test_a_failure_half_way_puts_back_this_packages_patch_and_keeps_a_builtin_one(monkeypatch):
    ours, builtin, failing = tiny_unet(), tiny_unet(), tiny_unet(seed=1)
    ppdiffusers_tome.apply_tome(ours, ratio=0.3, seed=2)
    ours_output = unet_output(ours)
    builtin_apply(builtin, ratio=0.5, use_rand=False)
    builtin_output, snapshot = unet_output(builtin), builtin_snapshot(builtin)

    fail_install_on(monkeypatch, failing)
    with pytest.raises(RuntimeError, match="install failed half-way"):
        ppdiffusers_tome.apply_tome([ours, builtin, failing], ratio=0.6)

    assert ppdiffusers_tome.tome_config(ours).ratio == 0.3 and get_patch(builtin) is None
    np.testing.assert_array_equal(unet_output(ours), ours_output)
    assert builtin_snapshot(builtin) == snapshot
    np.testing.assert_array_equal(unet_output(builtin), builtin_output)


def test_success_still_replaces_the_builtin_port_on_every_target():
    first, second, fresh = tiny_unet(), tiny_unet(), tiny_unet()
    builtin_apply(first, ratio=0.5, use_rand=False)
    builtin_apply(second, ratio=0.5, use_rand=False)
    ppdiffusers_tome.apply_tome([first, second], ratio=0.5, use_rand=False)
    ppdiffusers_tome.apply_tome(fresh, ratio=0.5, use_rand=False)
    for model in (first, second):
        assert not any(type(m).__name__.startswith("ToMe") for m in model.sublayers(include_self=True))
        assert not any("_tome_info" in m.__dict__ for m in model.sublayers(include_self=True))
        assert hook_shape(model) == hook_shape(fresh)
        np.testing.assert_array_equal(unet_output(model), unet_output(fresh))


def test_hooks_registered_after_unpickling_in_a_fresh_process_do_not_collide(monkeypatch):
    from paddle.nn.layer.layers import HookRemoveHelper

    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5)
    patched = unet_output(unet)
    data = pickle.dumps(unet)
    # a spawned worker that has registered fewer hooks so far: its next id is one that ToMe's hooks already use
    monkeypatch.setattr(HookRemoveHelper, "next_hook_id", min(unet._forward_pre_hooks))
    twin = pickle.loads(data)
    seen = []
    twin.register_forward_pre_hook(lambda *args: seen.append(1))
    np.testing.assert_array_equal(unet_output(twin), patched)  # ToMe's own pre-hook still runs
    assert seen == [1]
    ppdiffusers_tome.remove_tome(twin)  # takes off ToMe's hooks only
    unet_output(twin)
    assert seen == [1, 1]


# items 1, 5, 6, 7, 9: threads, a retry after a fault, early exceptions, non-finite timesteps ----------------------
import contextlib  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402

from ppdiffusers_tome.patch import find_blocks  # noqa: E402
from ppdiffusers_tome.testing import tiny_sdxl_unet  # noqa: E402


@contextlib.contextmanager
def call_held_inside_forward(unet, seed=0):
    """Run ``unet_output(unet, seed)`` in another thread, held inside its forward (at the first transformer block's
    cross-attention, after its self-attention ran on merged tokens) until the ``with`` body ends. Yields a dict whose
    "output" (or "error") the thread fills in."""
    entered, release, result = threading.Event(), threading.Event(), {}
    worker_ident = []

    def hold(layer, inputs):
        if threading.get_ident() in worker_ident:
            entered.set()
            assert release.wait(60)

    handle = find_blocks(unet)[0][1].attn2.register_forward_pre_hook(hold)

    def run():
        worker_ident.append(threading.get_ident())
        try:
            result["output"] = unet_output(unet, seed)
        except BaseException as error:  # reported by the main thread
            result["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        assert entered.wait(60), result.get("error")
        yield result
    finally:
        release.set()
        worker.join(60)
        handle.remove()
    assert not worker.is_alive()
    if "error" in result:
        raise result["error"]


def test_reset_tome_does_not_disturb_a_call_in_flight_in_another_thread():  # item 1
    unet = tiny_unet()
    vanilla = unet_output(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, seed=3)
    patched = unet_output(unet)
    assert np.abs(patched - vanilla).max() > 1e-4  # ToMe is active
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["calls"] == 1
    with call_held_inside_forward(unet) as result:
        ppdiffusers_tome.reset_tome(unet)
        stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
        assert stats["calls"] == stats["merges"] == stats["plans_computed"] == stats["plans_reused"] == 0
    np.testing.assert_array_equal(result["output"], patched)
    assert get_patch(unet).state.busy_elsewhere() == 0
    np.testing.assert_array_equal(unet_output(unet), patched)  # and later calls are as before


def step_sample(seed):
    rng = np.random.default_rng(seed)
    return paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))


def test_a_generation_retried_after_a_fault_matches_a_fresh_model(monkeypatch):  # item 5
    timesteps = [999, 800, 600, 400]
    context = unet_inputs(tiny_unet())[2]

    def generation(unet):
        outputs = []
        with paddle.no_grad():
            for i, t in enumerate(timesteps):
                outputs.append(unet(step_sample(10 + i), paddle.to_tensor([t, t]), context).sample.numpy())
        return outputs

    fresh = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5, recompute_every=3)
    expected = generation(fresh)

    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5, recompute_every=3)
    failures = []

    def fail_once(layer, inputs):
        if not failures:
            failures.append(1)
            raise RuntimeError("simulated fault late in the forward")

    handle = unet.conv_out.register_forward_pre_hook(fail_once)
    with pytest.raises(RuntimeError, match="simulated fault"):
        with paddle.no_grad():  # the first call of the generation, with other latents (a new seed on the retry)
            unet(step_sample(99), paddle.to_tensor([999, 999]), context)
    handle.remove()
    assert get_patch(unet).state.busy_elsewhere() == 0
    retried = generation(unet)
    for got, want in zip(retried, expected):
        np.testing.assert_array_equal(got, want)
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["plans_reused"] > 0  # the cache is in use


def sdxl_call(seed=5):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 64)).astype("float32"))
    added = {"text_embeds": paddle.to_tensor(rng.standard_normal((2, 32)).astype("float32")),
             "time_ids": paddle.to_tensor([[32.0, 32, 0, 0, 32, 32]] * 2)}
    return (sample, paddle.to_tensor([500, 500]), context), dict(added_cond_kwargs=added)


def test_an_exception_before_any_block_neither_warns_nor_spends_the_warning():  # item 6
    unet = tiny_sdxl_unet()
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, max_downsample=1)  # its finest transformer level is 2
    (sample, t, context), kwargs = sdxl_call()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with paddle.no_grad():
            with pytest.raises(Exception):
                unet(sample[:, :3], t, context, **kwargs)  # conv_in wants 4 channels
    assert not [w for w in caught if "ToMe" in str(w.message)], [str(w.message) for w in caught]
    assert get_patch(unet).state.busy_elsewhere() == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with paddle.no_grad():
            unet(sample, t, context, **kwargs)  # a genuine case of merging nothing
    assert len([w for w in caught if "merged no tokens" in str(w.message)]) == 1


def test_remove_and_apply_refuse_while_another_thread_is_inside_a_forward():  # item 7
    unet = tiny_unet()
    vanilla = unet_output(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, seed=3)
    patch = get_patch(unet)
    patched = unet_output(unet)
    assert np.abs(patched - vanilla).max() > 1e-4
    with call_held_inside_forward(unet) as result:
        hooks = hook_tables(unet)  # ToMe's and the test's own hold hook
        with pytest.raises(RuntimeError, match="running in other threads"):
            ppdiffusers_tome.remove_tome(unet)
        with pytest.raises(RuntimeError, match="running in other threads"):
            ppdiffusers_tome.apply_tome(unet, ratio=0.3)
        assert get_patch(unet) is patch and ppdiffusers_tome.tome_config(unet).ratio == 0.5
        assert hook_tables(unet) == hooks  # no hook taken off, added or swapped
    np.testing.assert_array_equal(result["output"], patched)
    ppdiffusers_tome.remove_tome(unet)
    assert get_patch(unet) is None
    np.testing.assert_array_equal(unet_output(unet), vanilla)


def test_a_nan_timestep_with_a_ratio_schedule_raises_and_leaves_the_model_working():  # item 9
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=(0.6, 0.3))
    expected = unet_output(ppdiffusers_tome.apply_tome(tiny_unet(), ratio=(0.6, 0.3)))
    sample, _, context = unet_inputs(unet)
    with pytest.raises(ValueError, match="not finite"):
        with paddle.no_grad():
            unet(sample, paddle.to_tensor([float("nan")] * 2), context)
    assert get_patch(unet).state.busy_elsewhere() == 0
    np.testing.assert_array_equal(unet_output(unet), expected)

"""ToMe and ToDo (``apply_tome``), the same checks on every model kind of tests/techniques/kinds.py: a call merges
in exactly the blocks it should and the removal gives vanilla back bit for bit; ratio 0 is vanilla; applying twice
is applying once; a pickled or deep-copied denoiser carries its own patch. Each check is a function that the last
tests of this file run on a deliberately broken technique, to see it fail.

Every kind takes every check: ToMe and ToDo patch UNets, ControlNets, SDXL's UNet, SD3's joint blocks and DiT's
blocks alike. (Kind-specific geometry — a DiT's patch grid, SD3's text stream, odd grids — stays in tests/tome/.)"""

import copy

import numpy as np
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.tome.patch import get_patch
from tests.techniques.kinds import ALL_KINDS, COPIERS, KINDS, MODEL_KINDS, same, with_models
from tests.unet_calls import hook_shape

STEPS = 3
METHODS = {
    "tome": dict(ratio=0.5),
    "todo": dict(method="todo"),
    "scheduled-cached": dict(ratio=(0.6, 0.3), recompute_every=2),  # a ratio schedule and plans kept across steps
}


def remove(pipe):
    pipe.remove_tome()


def attention_processors(model):
    """The processor object of every attention layer of ``model``, by the layer's name (ToDo on SD3 replaces them)."""
    return {name: id(layer.processor) for name, layer in model.named_sublayers() if hasattr(layer, "processor")}


# merging, then removal ----------------------------------------------------------------------------------------------
def check_merges_and_removal_gives_vanilla(kind, options, remove=remove):
    pipe = kind.build()
    models = kind.models(pipe)
    unpatched = {name: hook_shape(model) for name, model in models.items()}
    processors = {name: attention_processors(model) for name, model in models.items()}
    vanilla = kind.images(pipe, STEPS)
    pipe.apply_tome(**options)
    merged = kind.images(pipe, STEPS)
    calls = kind.denoising_steps(STEPS)
    stats, status = ppdiffusers_tome.tome_stats(pipe), ppdiffusers_tome.tome_status(pipe)
    assert set(stats) == set(kind.denoisers), stats
    for name, blocks in kind.denoisers.items():
        assert (stats[name]["blocks"], stats[name]["calls"], stats[name]["merges"]) == (blocks, calls, blocks * calls)
        assert (stats[name]["plans_computed"] == 0) == (options.get("method") == "todo")  # ToDo matches nothing
        assert status[name]["active"] == "ppdiffusers_tome" and status[name]["blocks"] == blocks
        assert status[name]["settings"]["method"] == options.get("method", "tome")
        if options.get("method") == "todo":
            assert status[name]["settings"]["downsample_factor"] == 2
        assert {p["action"] for p in status[name]["policy"].values()} == {"merge"}  # CPU kernels merge every block
    assert merged.shape == vanilla.shape and np.isfinite(merged).all()
    assert 0 < np.abs(merged - vanilla).max() < 1.0
    remove(pipe)
    for name, model in models.items():
        assert get_patch(model) is None and hook_shape(model) == unpatched[name]
        assert attention_processors(model) == processors[name]  # the same objects (compared by identity)
        assert ppdiffusers_tome.tome_status(pipe)[name]["active"] is None
    same(kind.images(pipe, STEPS), vanilla)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_call_merges_in_every_block_and_removal_gives_vanilla_back_bit_for_bit(kind, method):
    check_merges_and_removal_gives_vanilla(KINDS[kind], METHODS[method])


# ratio 0 ------------------------------------------------------------------------------------------------------------
def check_ratio_0_is_vanilla(kind, ratio=0.0):
    pipe = kind.build()
    vanilla = kind.images(pipe, STEPS)
    pipe.apply_tome(ratio=0.5)  # a patch first, as a user lowering the ratio has
    pipe.apply_tome(ratio=ratio)
    same(kind.images(pipe, STEPS), vanilla)
    stats = ppdiffusers_tome.tome_stats(pipe)
    assert set(stats) == set(kind.denoisers) and all(s["merges"] == 0 for s in stats.values()), stats


@pytest.mark.parametrize("kind", MODEL_KINDS + ["sd3-img2img"])
def test_ratio_0_is_vanilla_bit_for_bit(kind):
    check_ratio_0_is_vanilla(KINDS[kind])


# applying twice -----------------------------------------------------------------------------------------------------
def check_applying_twice_is_applying_once(kind, second=dict(ratio=0.5)):
    once, twice = kind.build(), kind.build()
    once.apply_tome(ratio=0.5)
    twice.apply_tome(ratio=0.5)
    twice.apply_tome(**second)
    for name, model in kind.models(twice).items():
        assert hook_shape(model) == hook_shape(kind.models(once)[name])
    same(kind.images(twice, STEPS), kind.images(once, STEPS))


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_applying_twice_is_applying_once(kind):
    check_applying_twice_is_applying_once(KINDS[kind])


# copies -------------------------------------------------------------------------------------------------------------
def check_a_copy_computes_the_same_and_removes_on_its_own(kind, copiers=COPIERS.values()):
    pipe = kind.build()
    models = kind.models(pipe)
    unpatched = {name: hook_shape(model) for name, model in models.items()}
    vanilla = kind.images(pipe, STEPS)
    pipe.apply_tome(ratio=0.5, seed=7, merge_mlp=True)
    patched = kind.images(pipe, STEPS)
    assert np.abs(patched - vanilla).max() > 1e-4  # ToMe changes the output (else the check proves nothing)
    stats = ppdiffusers_tome.tome_stats(pipe)
    patches = {name: get_patch(model) for name, model in models.items()}
    for copier in copiers:  # each copy made from the originals as they are after one call
        twins = {name: copier(model) for name, model in models.items()}

        other = with_models(pipe, twins)
        for name, twin in twins.items():
            patch, twin_patch = patches[name], get_patch(twin)
            assert twin_patch is not None and twin_patch is not patch and twin_patch.model is twin
            assert twin_patch.config == patch.config and twin_patch.train_timesteps == patch.train_timesteps
            assert ppdiffusers_tome.tome_stats(twin) == {type(twin).__name__: stats[name]}  # the counters travel
            assert hook_shape(twin) == hook_shape(models[name])
        same(kind.images(other, STEPS), patched)  # same partitions (seed, block, step, grid)
        for name, twin in twins.items():
            calls = stats[name]["calls"]
            assert ppdiffusers_tome.tome_stats(twin)[type(twin).__name__]["calls"] == 2 * calls  # counts on
            assert ppdiffusers_tome.tome_stats(models[name])[type(twin).__name__]["calls"] == calls
            ppdiffusers_tome.remove_tome(twin)
            assert get_patch(twin) is None and hook_shape(twin) == unpatched[name]
        same(kind.images(other, STEPS), vanilla)
    same(kind.images(pipe, STEPS), patched)  # the originals keep their patches
    assert all(get_patch(model) is patches[name] for name, model in models.items())
    pipe.remove_tome()
    assert all(hook_shape(model) == hook_shape(twins[name]) for name, model in models.items())


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_a_pickled_or_deep_copied_denoiser_computes_the_same_and_removes_on_its_own(kind):
    check_a_copy_computes_the_same_and_removes_on_its_own(KINDS[kind])


# each check fails on a broken technique -----------------------------------------------------------------------------
def test_the_checks_fail_on_a_broken_technique():
    unet = KINDS["unet"]
    with pytest.raises(AssertionError):  # a removal that leaves the patch on
        check_merges_and_removal_gives_vanilla(unet, METHODS["tome"], remove=lambda pipe: None)
    with pytest.raises(AssertionError):  # a "ratio 0" that still merges
        check_ratio_0_is_vanilla(unet, ratio=0.1)
    with pytest.raises(AssertionError):  # a second apply that changes the patch
        check_applying_twice_is_applying_once(unet, second=dict(ratio=0.4))
    with pytest.raises(AssertionError):  # a copy that loses its patch
        check_a_copy_computes_the_same_and_removes_on_its_own(
            unet, [lambda model: ppdiffusers_tome.remove_tome(copy.deepcopy(model))])

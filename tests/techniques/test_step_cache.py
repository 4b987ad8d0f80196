"""The step cache (``apply_cache``), the same checks on every model kind of tests/techniques/kinds.py: interval 1 is
vanilla bit for bit, interval 3 runs the deep layers on the full steps only and the removal gives vanilla back; the
adaptive rule at threshold 0 is vanilla; a pickled or deep-copied denoiser caches the same and removes on its own.
Each check is a function that the last test of this file runs on a deliberately broken cache, to see it fail.

Every kind takes every check: the cache keeps a UNet's (and a ControlNet's) deep levels and a transformer's blocks
between the outer ones. (What a cached step computes is checked against hook references in tests/cache/.)"""

import copy

import numpy as np
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.cache.step_cache import CacheConfig, get_cache
from tests.techniques.kinds import ALL_KINDS, COPIERS, FULL_STEP_ONLY, KINDS, MODEL_KINDS, same, with_models
from tests.unet_calls import hook_shape

STEPS = 6


def counting(model, name):
    """Count the calls of the layer ``name`` of ``model`` (a pre-hook on its first leaf: every call reaches it)."""
    layer = dict(model.named_sublayers())[name]
    leaf = next(sub for sub in layer.sublayers(include_self=True) if not sub.sublayers())
    calls = []
    return calls, leaf.register_forward_pre_hook(lambda *_: calls.append(1))


# interval 1, interval 3, removal ------------------------------------------------------------------------------------
def check_interval_1_is_vanilla_and_interval_3_caches(kind, first=dict(interval=1), remove=lambda p: p.remove_cache()):
    pipe = kind.build()
    models = kind.models(pipe)
    unpatched = {name: hook_shape(model) for name, model in models.items()}
    vanilla = kind.images(pipe, STEPS)
    pipe.apply_cache(**first)
    same(kind.images(pipe, STEPS), vanilla)
    assert all(s["cached_calls"] == 0 for s in ppdiffusers_tome.cache_status(pipe).values())
    pipe.apply_cache(interval=3)
    counts = {(name, layer): counting(model, layer) for name, model in models.items()
              for layer in FULL_STEP_ONLY[type(model).__name__]}
    cached = kind.images(pipe, STEPS)
    for _, handle in counts.values():
        handle.remove()
    calls = kind.denoising_steps(STEPS)
    full = sum(CacheConfig(interval=3).is_full(i) for i in range(calls))
    status = ppdiffusers_tome.cache_status(pipe)
    assert set(status) == set(kind.denoisers), status
    for name, s in status.items():
        assert (s["calls"], s["full_calls"], s["cached_calls"]) == (calls, full, calls - full), (name, s)
        assert (s["deep_blocks"], s["fallbacks"]) == (kind.deep[name], 0), (name, s)
    assert {key: len(seen) for key, (seen, _) in counts.items()} == {key: full for key in counts}
    assert cached.shape == vanilla.shape and np.isfinite(cached).all()
    assert 0 < np.abs(cached - vanilla).max() < 1.0
    same(kind.images(pipe, STEPS), cached)  # every pipeline call starts afresh
    assert all(s["calls"] == 2 * calls for s in ppdiffusers_tome.cache_status(pipe).values())
    remove(pipe)
    for name, model in models.items():
        assert get_cache(model) is None and hook_shape(model) == unpatched[name]
    same(kind.images(pipe, STEPS), vanilla)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_interval_1_is_vanilla_and_interval_3_runs_the_deep_layers_on_full_steps_only(kind):
    check_interval_1_is_vanilla_and_interval_3_caches(KINDS[kind])


# the adaptive rule at threshold 0 ------------------------------------------------------------------------------------
def check_threshold_0_is_vanilla(kind, threshold=0):
    pipe = kind.build()
    vanilla = kind.images(pipe, 5)
    pipe.apply_cache(threshold=threshold)
    same(kind.images(pipe, 5), vanilla)
    status = ppdiffusers_tome.cache_status(pipe)
    assert set(status) == set(kind.denoisers) and all(
        (s["rule"], s["threshold"], s["full_calls"], s["cached_calls"]) == ("adaptive", 0.0, 5, 0)
        for s in status.values()), status
    pipe.apply_cache(threshold=1e6)  # every step the rule may cache: all but the first and the last
    cached = kind.images(pipe, 5)
    for s in ppdiffusers_tome.cache_status(pipe).values():
        assert (s["last_full_steps"], s["last_cached_steps"], s["calls"]) == ([0, 4], [1, 2, 3], 5)
    assert np.isfinite(cached).all() and np.abs(cached - vanilla).max() > 1e-4


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_threshold_0_is_vanilla_bit_for_bit_and_a_large_threshold_caches(kind):
    check_threshold_0_is_vanilla(KINDS[kind])


# copies -------------------------------------------------------------------------------------------------------------
def check_a_copy_caches_the_same_and_removes_on_its_own(kind, copiers=COPIERS.values()):
    pipe = kind.build()
    models = kind.models(pipe)
    unpatched = {name: hook_shape(model) for name, model in models.items()}
    vanilla = kind.images(pipe, 4)
    pipe.apply_cache(interval=3)
    cached = kind.images(pipe, 4)  # steps 0 and 3 full, 1 and 2 cached
    assert np.abs(cached - vanilla).max() > 1e-5
    for copier in copiers:
        twins = {name: copier(model) for name, model in models.items()}
        other = with_models(pipe, twins)
        for name, twin in twins.items():
            cache = get_cache(models[name])
            assert get_cache(twin) is not None and get_cache(twin) is not cache
            assert get_cache(twin).config == cache.config and hook_shape(twin) == hook_shape(models[name])
        same(kind.images(other, 4), cached)
        for name, twin in twins.items():
            ppdiffusers_tome.remove_cache(twin)
            assert get_cache(twin) is None and hook_shape(twin) == unpatched[name]
        same(kind.images(other, 4), vanilla)
    same(kind.images(pipe, 4), cached)  # the originals keep their caches


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_a_pickled_or_deep_copied_denoiser_caches_the_same_and_removes_on_its_own(kind):
    check_a_copy_caches_the_same_and_removes_on_its_own(KINDS[kind])


# each check fails on a broken cache ---------------------------------------------------------------------------------
def test_the_checks_fail_on_a_broken_cache():
    unet = KINDS["unet"]
    with pytest.raises(AssertionError):  # an "interval 1" that caches
        check_interval_1_is_vanilla_and_interval_3_caches(unet, first=dict(interval=2))
    with pytest.raises(AssertionError):  # a removal that leaves the cache on
        check_interval_1_is_vanilla_and_interval_3_caches(unet, remove=lambda pipe: None)
    with pytest.raises(AssertionError):  # a "threshold 0" that caches
        check_threshold_0_is_vanilla(unet, threshold=1e6)
    with pytest.raises(AssertionError):  # a copy that loses its cache
        check_a_copy_caches_the_same_and_removes_on_its_own(
            unet, [lambda model: ppdiffusers_tome.remove_cache(copy.deepcopy(model))])

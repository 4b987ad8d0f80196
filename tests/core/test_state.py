"""state.py and generation.py: the record of the call in flight (CallRecord), the plans kept across steps
(PlanCache), the counters, and the step clock: which denoising step and call site a model call is, counted from the
pipeline's own progress bar (Heun and KDPM2 call the model twice per step, PNDM once more at its warm-up), every
call its own step outside a pipeline."""

import copy
import pickle
import threading
from types import SimpleNamespace

import paddle
import ppdiffusers
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.core import generation
from ppdiffusers_tome.core.calls import model_calls
from ppdiffusers_tome.core.generation import StepClock
from ppdiffusers_tome.testing import tiny_sd_pipeline, tiny_unet
from ppdiffusers_tome.tome.config import ToMeConfig
from ppdiffusers_tome.tome.patch import ModelPatch, get_patch
from ppdiffusers_tome.tome.state import CallRecord, Counters, PlanCache, timestep_values
from tests.conftest import run
from tests.unet_calls import unet_inputs


def test_timestep_values_are_the_distinct_values_sorted_or_none():
    assert timestep_values(None) is None
    assert timestep_values([999, 999, 500]).tolist() == [500.0, 999.0]
    assert timestep_values(paddle.to_tensor([7, 3, 7], dtype="int64")).tolist() == [3.0, 7.0]
    assert timestep_values(paddle.to_tensor(250.5)).tolist() == [250.5]
    assert timestep_values([]) is None and timestep_values("noon") is None


# the call record ------------------------------------------------------------------------------------------------
def test_a_call_record_lives_for_its_call_only_and_says_what_the_blocks_need():
    patch = ModelPatch.install(tiny_unet(), ToMeConfig(ratio=(0.6, 0.2)))
    assert patch.local.call is None
    with patch.in_call(paddle.zeros([1, 4, 8, 6]), paddle.to_tensor(500)) as call:
        assert patch.local.call is call and isinstance(call, CallRecord)
        assert (call.latent_hw, call.number, call.kernels) == ((8, 6), 1, "cpu")
        assert call.ratio == pytest.approx(0.4)  # the scheduled ratio at progress 0.5
        assert call.partitions == {} and call.shared == {} and call.merged_blocks == 0 and call.finest_level is None
    assert patch.local.call is None
    with pytest.raises(ValueError, match="inside"):
        with patch.in_call(paddle.zeros([1, 4, 8, 8]), paddle.to_tensor(999)) as second:
            raise ValueError("inside")
    assert patch.local.call is None and second.number == 2 and patch.counters.calls == 2
    patch.remove()


@pytest.mark.parametrize("options, reads", [(dict(ratio=(0.6, 0.2)), True), (dict(recompute_every=3), False),
                                            (dict(method="todo", ratio=(0.6, 0.2)), False), (dict(), False)])
def test_only_a_ratio_schedule_reads_the_timestep_on_the_host(monkeypatch, options, reads):
    """The step of a call comes from the step clock, never from the timestep: only a ratio schedule (which needs
    the denoising progress as a number) reads it back from the device."""
    import ppdiffusers_tome.tome.runner as patch_module  # (the call runner reads the progress)

    read = []
    real = patch_module.progress_of
    monkeypatch.setattr(patch_module, "progress_of", lambda *args: read.append(args) or real(*args))
    unet = tiny_unet()
    ppdiffusers_tome.apply_tome(unet, **options)
    with paddle.no_grad():
        unet(*unet_inputs(unet))
    assert bool(read) is reads


# the plan cache -------------------------------------------------------------------------------------------------
def record(step, site=0):
    call = CallRecord((4, 4), None, 1, "cpu", 0.5)
    call.step, call.site = step, site
    return call


def plan(batch=2):
    return SimpleNamespace(batch_size=batch)


def test_cached_plans_follow_recompute_every_by_step_and_need_the_same_batch_and_grid():
    cache, kept = PlanCache(2), plan()
    found = []
    for step in range(5):
        call = record(step)
        reused = cache.lookup("0", call, 2, (4, 4))
        found.append(reused is kept)
        assert cache.lookup("0", call, 1, (4, 4)) is None and cache.lookup("0", call, 2, (4, 2)) is None
        assert cache.lookup("1", call, 2, (4, 4)) is None  # another block (or level)
        if reused is None:
            cache.store("0", call, kept, (4, 4))
    assert found == [False, True, False, True, False]  # made at steps 0, 2 and 4, each kept for one more step


def test_listed_recompute_steps():
    cache, kept = PlanCache((0, 2)), plan()
    found = []
    for step in range(4):
        found.append(cache.lookup("0", record(step), 2, (4, 4)) is kept)
        cache.store("0", record(step), kept, (4, 4))
    assert found == [False, True, False, True]  # recomputed at steps 0 and 2 only


def test_each_call_site_keeps_its_own_plans_and_the_cache_stays_bounded(monkeypatch):
    cache = PlanCache(10)
    sites = [plan() for _ in range(40)]  # e.g. one view of a panorama per call, 40 views per step
    for site, kept in enumerate(sites):
        cache.store("0", record(0, site), kept, (4, 4))
    assert all(cache.lookup("0", record(1, site), 2, (4, 4)) is kept for site, kept in enumerate(sites))
    monkeypatch.setattr(PlanCache, "MAX_PLANS", 16)
    for site in range(40, 60):  # many more call sites than it holds
        cache.store("0", record(1, site), plan(), (4, 4))
    assert len(cache._plans()) == 16
    assert cache.lookup("0", record(2, 0), 2, (4, 4)) is None  # the least recently used went first
    assert cache.lookup("0", record(2, 59), 2, (4, 4)) is not None
    cache.clear()
    assert cache.lookup("0", record(2, 59), 2, (4, 4)) is None


def test_plans_are_kept_per_thread_and_copies_keep_the_setting_only():
    cache, kept = PlanCache(3), plan()
    cache.store("0", record(0), kept, (4, 4))
    elsewhere = []
    worker = threading.Thread(target=lambda: elsewhere.append(cache.lookup("0", record(1), 2, (4, 4))))
    worker.start()
    worker.join(30)
    assert elsewhere == [None] and cache.lookup("0", record(1), 2, (4, 4)) is kept
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert twin.every == 3 and twin.lookup("0", record(1), 2, (4, 4)) is None


def test_counters_reset_and_survive_copies():
    counters = Counters()
    counters.calls, counters.merges, counters.warned_no_merge = 3, 7, True
    counters.decisions[256] = "a decision"
    for twin in (copy.deepcopy(counters), pickle.loads(pickle.dumps(counters))):
        assert twin.as_dict() == counters.as_dict() and twin.as_dict()["merges"] == 7
    assert list(counters.as_dict()) == list(Counters.NAMES)
    counters.reset()
    assert set(counters.as_dict().values()) == {0} and counters.decisions == {} and not counters.warned_no_merge


# the step clock ---------------------------------------------------------------------------------------------------
def test_outside_a_pipeline_every_call_is_a_step_of_its_own_per_thread():
    clock = StepClock()
    assert [clock.tick() for _ in range(3)] == [(0, 0, True), (1, 0, False), (2, 0, False)]
    other = []
    worker = threading.Thread(target=lambda: other.extend(clock.tick() for _ in range(2)))
    worker.start()
    worker.join(30)
    assert other == [(0, 0, True), (1, 0, False)]  # another thread counts its own calls
    assert clock.tick() == (3, 0, False)
    clock.reset()  # a new generation, in every thread
    assert clock.tick() == (0, 0, True)
    assert pickle.loads(pickle.dumps(clock)).tick() == (0, 0, True)


def positions(pipe, **call):
    """``(step, site, new generation)`` of every UNet call of a pipeline call, from the UNet's step clock."""
    seen = []
    clock = model_calls(pipe.unet)
    handle = pipe.unet.conv_in.register_forward_pre_hook(lambda layer, args: seen.append(clock.position))
    try:
        run(pipe, **call)
    finally:
        handle.remove()
    return seen


def clocked_pipeline(scheduler=None, **options):
    pipe = tiny_sd_pipeline()
    if scheduler is not None:
        pipe.scheduler = scheduler.from_config(pipe.scheduler.config, **options)
    return pipe.apply_tome(ratio=0.5, recompute_every=2)  # (plan caching runs the clock)


def test_a_pipeline_counts_its_own_denoising_steps_and_each_call_starts_at_step_0():
    pipe = clocked_pipeline()
    assert positions(pipe, steps=3) == [(0, 0, True), (1, 0, False), (2, 0, False)]
    assert positions(pipe, steps=2) == [(0, 0, True), (1, 0, False)]  # a new generation, whatever the timesteps


@pytest.mark.parametrize("scheduler", [ppdiffusers.HeunDiscreteScheduler, ppdiffusers.KDPM2DiscreteScheduler])
def test_two_model_calls_per_step_are_two_call_sites_of_one_step(scheduler):
    """Heun and KDPM2 call the UNet twice per denoising step (the last step once): the pipeline advances its bar
    every second call, so the calls of a step are its sites 0 and 1."""
    pipe = clocked_pipeline(scheduler)
    assert positions(pipe, steps=3) == [(0, 0, True), (0, 1, False), (1, 0, False), (1, 1, False), (2, 0, False)]


def test_pndms_warm_up_call_is_a_second_call_site_of_step_0():
    pipe = clocked_pipeline(ppdiffusers.PNDMScheduler, skip_prk_steps=True)  # SD's PLMS: the first step runs twice
    assert positions(pipe, steps=3) == [(0, 0, True), (0, 1, False), (1, 0, False), (2, 0, False)]


def test_a_hand_written_denoising_loop_with_the_pipelines_progress_bar_counts_its_steps_and_sites():
    """Both forms of the bar (``total=`` with ``update()``, and an iterable) count steps; each model call of a step
    (split guidance, panorama views) is a call site of its own; leaving the loop ends the generation."""
    pipe = clocked_pipeline()
    unet, clock = pipe.unet, model_calls(pipe.unet)
    sample, t, context = unet_inputs(unet, batch=1)
    seen = []

    def call():
        with paddle.no_grad():
            unet(sample, t, context)
        seen.append(clock.position)

    with pipe.progress_bar(total=2) as bar:
        for _ in range(2):
            call()
            call()
            bar.update()
    for _ in pipe.progress_bar([999, 500]):
        call()
        call()
        call()
    assert seen == [(0, 0, True), (0, 1, False), (1, 0, False), (1, 1, False),
                    (0, 0, True), (0, 1, False), (0, 2, False), (1, 0, False), (1, 1, False), (1, 2, False)]
    assert generation.current() is None
    call()  # outside the loop: a step of its own
    call()
    assert seen[-2][:2] == (0, 0) and seen[-1][:2] == (1, 0)


def test_the_progress_bar_is_wrapped_only_while_a_technique_needs_the_clock():
    from ppdiffusers import DiffusionPipeline

    before = generation.holders()
    unet = tiny_unet()
    ppdiffusers_tome.apply_tome(unet)  # no plan caching: no clock, nothing wrapped for it
    assert generation.holders() == before and model_calls(unet).clock is None
    ppdiffusers_tome.apply_tome(unet, recompute_every=3)
    assert generation.holders() == before + 1 and model_calls(unet).clock is not None
    assert DiffusionPipeline.__dict__["progress_bar"] is generation._progress_bar
    ppdiffusers_tome.remove_tome(unet)
    assert generation.holders() == before and model_calls(unet) is None
    if before == 0:
        assert DiffusionPipeline.__dict__["progress_bar"] is not generation._progress_bar


def test_reset_tome_starts_a_new_generation_and_clears_counters_and_plans():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet, batch=1)
    ppdiffusers_tome.apply_tome(unet, recompute_every=3)
    patch, clock = get_patch(unet), model_calls(unet)
    with paddle.no_grad():
        for _ in range(2):
            unet(sample, t, context)
    assert clock.position[:2] == (1, 0) and patch.counters.calls == 2 and patch.counters.plans_reused == 3
    ppdiffusers_tome.reset_tome(unet)
    assert patch.counters.as_dict() == Counters().as_dict()
    with paddle.no_grad():
        unet(sample, t, context)
    assert clock.position == (0, 0, True) and patch.counters.plans_computed == 3 and patch.counters.plans_reused == 0
    assert patch.counters.calls == 1

"""state.py: the per-thread call record and step history, and ToMeState, the only code that writes them."""

import copy
import pickle
import threading

import paddle
import pytest

from ppdiffusers_tome.config import ToMeConfig
from ppdiffusers_tome.merge import bipartite_soft_matching_random2d
from ppdiffusers_tome.planner import Planner
from ppdiffusers_tome.state import StepHistory, ToMeState, timestep_values


def test_timestep_values_are_the_distinct_values_sorted_or_none():
    assert timestep_values(None) is None
    assert timestep_values([999, 999, 500]).tolist() == [500.0, 999.0]
    assert timestep_values(paddle.to_tensor([7, 3, 7], dtype="int64")).tolist() == [3.0, 7.0]
    assert timestep_values(paddle.to_tensor(250.5)).tolist() == [250.5]
    assert timestep_values([]) is None and timestep_values("noon") is None


def test_step_history_counts_steps_slots_and_new_generations():
    history = StepHistory()
    history.advance(("t", 999), 0.001)
    assert (history.step, history.slot) == (0, 0)
    history.advance(("t", 999), 0.001)  # the second half of split guidance: same step, next slot
    assert (history.step, history.slot) == (0, 1)
    history.slot = 0
    history.store("0", "plan", (8, 8))
    history.advance(("t", 800), 0.2)
    assert (history.step, history.slot) == (1, 0) and history.cache
    saved = history.snapshot()
    history.advance(("t", 999), 0.001)  # noisier than the last step: a new generation forgets the cached plans
    assert (history.step, history.slot, history.cache) == (0, 0, {})
    history.restore(saved)
    assert (history.step, history.last_key, list(history.cache)) == (1, ("t", 800), ["0/0"])


def test_step_history_gives_every_call_of_a_step_its_own_slot_and_bounds_the_cache():
    history = StepHistory()
    for call in range(40):  # e.g. one view of a panorama per call, 40 views per step
        history.advance("t999", 0.001)
        assert (history.step, history.slot) == (0, call)
        history.store("0", f"plan{call}", (8, 8))
    history.advance("t900", 0.1)
    assert (history.step, history.slot) == (1, 0) and history.lookup("0")[0] == "plan0"
    history.slot = 39
    assert history.lookup("0")[0] == "plan39"
    for slot in range(StepHistory.MAX_PLANS + 10):  # a one-step model called again and again
        history.slot = slot
        history.store("1", slot, (8, 8))
    assert len(history.cache) == StepHistory.MAX_PLANS
    assert "1/0" not in history.cache and f"1/{StepHistory.MAX_PLANS + 9}" in history.cache  # least recent first


def test_begin_and_end_call_keep_the_record_of_the_call_in_flight_only():
    state = ToMeState(ToMeConfig(), num_blocks=2)
    assert not state.reads_timestep  # a constant ratio without caching never reads the timestep on the host
    state.begin_call(paddle.zeros([1, 4, 8, 6]), paddle.to_tensor(999))
    assert state.latent_hw == (8, 6) and state.calls == 1 and state.saw_level(2) == 2 and state.saw_level(1) == 1
    assert state.saw_level(4) == 1 and state.finest_level == 1
    plan = bipartite_soft_matching_random2d(paddle.randn([1, 48, 4]), 6, 8, 2, 2, 24, generator=0)
    state.set_plan(0, plan)
    state.begin_merge("0/attn1", plan)
    assert state.plan_of(0) is plan and state.plan_of(1) is None and state.merged_blocks == 1 and state.merges == 1
    state.end_block(0)  # the block's post-hook drops its plan and any unmerge left pending
    assert state.plan_of(0) is None and state.end_merge("0/attn1") is None
    state.end_call()
    assert state.latent_hw is None and state.call.timestep is None and state.calls == 1


@pytest.mark.parametrize("kwargs,reads", [(dict(ratio=(0.6, 0.2)), True), (dict(recompute_every=3), True),
                                          (dict(method="todo", ratio=(0.6, 0.2)), False), (dict(), False)])
def test_only_schedules_and_plan_caching_read_the_timestep(kwargs, reads):
    assert ToMeState(ToMeConfig(**kwargs)).reads_timestep is reads


def test_cached_plans_follow_recompute_every_and_a_failed_call_puts_the_history_back():
    state = ToMeState(ToMeConfig(recompute_every=2), num_blocks=1)
    plan = bipartite_soft_matching_random2d(paddle.randn([2, 16, 4]), 4, 4, 2, 2, 8, generator=0)
    reused = []
    for t in (900, 800, 700):
        state.begin_call(paddle.zeros([2, 4, 4, 4]), paddle.to_tensor([t, t]))
        cached = state.cached_plan("0", 2, 4, 4)
        reused.append(cached is plan)
        if cached is None:
            state.store_plan("0", plan, 4, 4)
        assert state.cached_plan("0", 1, 4, 4) is None and state.cached_plan("0", 2, 4, 2) is None  # other shapes
        state.end_call()
    assert reused == [False, True, False] and state.history.step == 2
    before = state.history.snapshot()
    state.begin_call(paddle.zeros([2, 4, 4, 4]), paddle.to_tensor([600, 600]))
    assert state.history.step == 3
    state.end_call(completed=False)  # the call raised: as if it never happened
    assert state.history.snapshot() == before and state.history.step == 2


def test_listed_recompute_steps():
    state = ToMeState(ToMeConfig(recompute_every=[0, 2]), num_blocks=1)
    plan = bipartite_soft_matching_random2d(paddle.randn([1, 16, 4]), 4, 4, 2, 2, 8, generator=0)
    found = []
    for t in (900, 800, 700, 600):
        state.begin_call(paddle.zeros([1, 4, 4, 4]), paddle.to_tensor(t))
        found.append(state.cached_plan("0", 1, 4, 4) is plan)
        state.store_plan("0", plan, 4, 4)
        state.end_call()
    assert found == [False, True, False, True]  # recomputed at steps 0 and 2 only


def test_partitions_are_drawn_once_per_call_and_grid_for_every_block():
    state = ToMeState(ToMeConfig(), num_blocks=3)
    planner = Planner(ToMeConfig(), state, None, [("a", None), ("b", None), ("c", None)])
    state.begin_call(paddle.zeros([1, 4, 8, 8]), paddle.to_tensor(500))
    rows = [planner.partition(block, 8, 8).numpy() for block in range(3)]
    assert all(sorted(row.tolist()) == list(range(64)) for row in rows)  # each a permutation of the grid
    assert len({tuple(row) for row in rows}) == 3  # every block its own partition
    assert planner.partition(1, 8, 8).numpy().tolist() == rows[1].tolist() and list(state.call.partitions) == ["8x8"]
    state.end_call()
    state.begin_call(paddle.zeros([1, 4, 8, 8]), paddle.to_tensor(500))  # same timestep: same partition
    assert planner.partition(1, 8, 8).numpy().tolist() == rows[1].tolist()
    state.end_call()
    state.begin_call(paddle.zeros([1, 4, 8, 8]), paddle.to_tensor(400))
    assert planner.partition(1, 8, 8).numpy().tolist() != rows[1].tolist()
    state.end_call()


def test_busy_elsewhere_counts_calls_in_other_threads():
    state = ToMeState(ToMeConfig())
    inside, leave = threading.Event(), threading.Event()

    def call():
        state.begin_call(paddle.zeros([1, 4, 8, 8]), None)
        inside.set()
        leave.wait(10)
        state.end_call()

    worker = threading.Thread(target=call)
    worker.start()
    assert inside.wait(10)
    assert state.busy_elsewhere() == 1 and state.latent_hw is None  # this thread has no call in flight
    leave.set()
    worker.join(10)
    assert state.busy_elsewhere() == 0


def test_reset_clears_counters_and_the_history_at_the_next_call():
    state = ToMeState(ToMeConfig(recompute_every=3))
    for t in (900, 800):
        state.begin_call(paddle.zeros([1, 4, 8, 8]), paddle.to_tensor(t))
        state.end_call()
    assert state.calls == 2 and state.history.step == 1
    state.reset()
    assert state.calls == 0
    state.begin_call(paddle.zeros([1, 4, 8, 8]), paddle.to_tensor(700))  # less noisy, yet step 0 after the reset
    assert state.history.step == 0
    state.end_call()


def test_copies_and_pickles_keep_settings_and_counters_but_no_call_in_flight():
    state = ToMeState(ToMeConfig(ratio=0.3), train_timesteps=500, num_blocks=4)
    state.begin_call(paddle.zeros([1, 4, 8, 8]), paddle.to_tensor(100))
    state.merges = 7
    for twin in (copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        assert twin is not state and twin.config == state.config
        assert (twin.train_timesteps, twin.num_blocks, twin.calls, twin.merges) == (500, 4, 1, 7)
        assert twin.latent_hw is None and twin.busy_elsewhere() == 0 and twin.in_flight == {}
    state.end_call()

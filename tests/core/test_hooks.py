"""registry.py and hooks.py: how a technique attaches to a layer (one class swap, named hooks outermost first, every
exit of a call seen, copies and pickles rebuilt, the untouched class back after the last removal) and ToMe's hooks on
it: the sub-layer hook merges the input, calls the sub-layer and unmerges its output in one function, and leaves
alone the calls it cannot merge."""

import copy
import inspect
import pickle
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.core import registry
from ppdiffusers_tome.core.calls import CALLS, model_calls, refuse_if_running
from ppdiffusers_tome.core.registry import Hook, add_hook, hooks_of, original_class, remove_hook, set_original_class
from ppdiffusers_tome.ops import DownsamplePlan, bipartite_soft_matching_random2d
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.hooks import BlockHook, SublayerHook
from ppdiffusers_tome.tome.patch import find_blocks, get_patch
from ppdiffusers_tome.tome.runner import CallRunner
from ppdiffusers_tome.tome.state import Counters
from tests.unet_calls import unet_inputs


class Doubler(paddle.nn.Layer):
    """A stand-in sub-layer that records what it was given: output = 2 * input."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        self.seen.append((list(hidden_states.shape), None if encoder_hidden_states is None
                          else list(encoder_hidden_states.shape)))
        return hidden_states * 2


class Tripler(Doubler):
    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        return hidden_states * 3


class Failing(paddle.nn.Layer):
    """A layer whose forward raises ``self.error`` (when set)."""

    def __init__(self):
        super().__init__()
        self.error = None

    def forward(self, x):
        if self.error is not None:
            raise self.error
        return x + 1


class Block(paddle.nn.Layer):
    """A stand-in transformer block: ``run(sub_layer, hidden_states)`` says how it calls its sub-layer (once, by
    default with the hidden states as they came)."""

    def __init__(self, sub):
        super().__init__()
        self.attn1 = sub

    def forward(self, hidden_states, run=None):
        return run(self.attn1, hidden_states) if run is not None else self.attn1(hidden_states)


class Trace(Hook):
    """Logs when a call enters and leaves it (in a ``finally``: every exit)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, *args, **kwargs):
        self.log.append(f"{self.name} in")
        try:
            return self.next(*args, **kwargs)
        finally:
            self.log.append(f"{self.name} out")


class Count(Hook):
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.next(*args, **kwargs)


class FakePatch:
    """What a BlockHook and its SublayerHooks use of a ModelPatch: the record of the call in flight (blocks plan only
    inside a model call), the block's plan, the counters."""

    def __init__(self, plan):
        self.plan = plan
        self.counters = Counters()
        self.local = SimpleNamespace(call=object())
        self.planned = 0

    def plan_block(self, index, hidden, call):
        assert call is self.local.call
        self.planned += 1
        return self.plan

    run_sublayer = CallRunner.run_sublayer  # (the runner's own: it runs the plan and writes the one counter)


def tokens(shape, seed=0):
    return paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype("float32"))


def paddle_hooks(layer):
    return [(len(m._forward_pre_hooks), len(m._forward_post_hooks)) for m in layer.sublayers(include_self=True)]


# the registry ---------------------------------------------------------------------------------------------------
def test_the_first_hook_swaps_the_class_and_the_last_removal_restores_the_untouched_layer():
    layer = Doubler()
    before = (dict(layer.__dict__), paddle_hooks(layer))
    count = Count()
    found = add_hook(layer, "count", count)
    hooked = type(layer)
    assert hooked is not Doubler and hooked.__name__ == "Doubler" and hooked.__mro__[1] is registry._HookedLayer
    assert isinstance(layer, Doubler) and original_class(layer) is Doubler and original_class(Doubler()) is Doubler
    assert hooks_of(layer) is found and found.names() == ["count"] and found.get("count") is count
    assert inspect.signature(hooked.forward) == inspect.signature(Doubler.forward)  # what to_static reads
    assert paddle_hooks(layer) == before[1]  # no Paddle forward hook: the class's forward runs the chain
    x = tokens([1, 3])
    np.testing.assert_array_equal(layer(x).numpy(), 2 * x.numpy())
    assert count.calls == 1 and count.layer is layer
    assert remove_hook(layer, "absent") is None and hooks_of(layer) is found
    assert remove_hook(layer, "count") is count
    assert type(layer) is Doubler and hooks_of(layer) is None and registry.KEY not in layer.__dict__
    assert set(layer.__dict__) == set(before[0]) and paddle_hooks(layer) == before[1]
    layer(x)
    assert count.calls == 1  # gone for good
    with pytest.raises(TypeError, match="paddle.nn.Layer"):
        add_hook(object(), "count", Count())


def test_hooks_chain_outermost_first_and_a_name_added_again_replaces_its_hook():
    layer, log = Doubler(), []
    add_hook(layer, "a", Trace("a", log))
    add_hook(layer, "b", Trace("b", log))  # outermost by default
    add_hook(layer, "c", Trace("c", log), outer=False)  # innermost
    assert hooks_of(layer).names() == ["b", "a", "c"]
    layer(tokens([1, 2]))
    assert log == ["b in", "a in", "c in", "c out", "a out", "b out"]
    log.clear()
    add_hook(layer, "a", Trace("a2", log))  # the same name: one hook, now the outermost
    assert hooks_of(layer).names() == ["a", "b", "c"]
    layer(tokens([1, 2]))
    assert log == ["a2 in", "b in", "c in", "c out", "b out", "a2 out"]
    remove_hook(layer, "b")
    log.clear()
    layer(tokens([1, 2]))
    assert log == ["a2 in", "c in", "c out", "a2 out"] and type(layer) is not Doubler
    for name in ("a", "c"):
        remove_hook(layer, name)
    assert type(layer) is Doubler


@pytest.mark.parametrize("error", [ValueError("inside"), KeyboardInterrupt()])
def test_a_hook_sees_every_exit_of_the_call_it_wraps(error):
    """A hook's try/finally runs when the layer raises, Ctrl-C (KeyboardInterrupt) included, and the error reaches
    the caller unchanged; the call counter of the model ends the call too."""
    layer, log = Failing(), []
    add_hook(layer, "trace", Trace("trace", log))
    calls = model_calls(layer, create=True)
    assert hooks_of(layer).names() == [CALLS, "trace"]  # the calls hook is the outermost
    layer.error = error
    with pytest.raises(type(error)):
        layer(paddle.ones([1]))
    assert log == ["trace in", "trace out"]
    assert calls.in_flight_here() == 0 and calls.in_flight_elsewhere() == 0 and calls.running == {}
    refuse_if_running(layer, "Failing", "hooks")  # nothing in flight any more: no refusal
    layer.error = None
    assert layer(paddle.ones([1])).numpy().tolist() == [2.0] and log[-2:] == ["trace in", "trace out"]


def test_a_change_from_inside_the_models_own_forward_is_refused():
    layer, refused = Failing(), []
    model_calls(layer, create=True)

    class Inside(Hook):
        def __call__(self, *args, **kwargs):
            with pytest.raises(RuntimeError, match="cannot change ToMe on Failing from inside its own forward"):
                refuse_if_running(layer, "Failing", "ToMe")
            refused.append(True)
            return self.next(*args, **kwargs)

    add_hook(layer, "inside", Inside(), outer=False)
    layer(paddle.ones([1]))
    assert refused == [True]
    refuse_if_running(layer, "Failing", "ToMe")


def test_copies_and_pickles_of_a_hooked_layer_rebuild_their_own_hooks():
    layer, count = Doubler(), Count()
    add_hook(layer, "count", count)
    x = tokens([1, 2])
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(twin) is type(layer) and original_class(twin) is Doubler
        twin_count = hooks_of(twin).get("count")
        assert twin_count is not count and twin_count.layer is twin
        np.testing.assert_array_equal(twin(x).numpy(), 2 * x.numpy())
        assert twin_count.calls == 1 and count.calls == 0  # the copy runs its own hooks, on itself
        remove_hook(twin, "count")
        assert type(twin) is Doubler and type(layer) is not Doubler  # the original keeps its hook
    remove_hook(layer, "count")


def test_set_original_class_swaps_the_class_underneath_the_hooks():
    layer, count = Doubler(), Count()
    add_hook(layer, "count", count)
    set_original_class(layer, Tripler)  # (how remove_builtin_tome undoes another library's class swap)
    assert original_class(layer) is Tripler and type(layer).__name__ == "Tripler"
    x = tokens([1, 2])
    np.testing.assert_array_equal(layer(x).numpy(), 3 * x.numpy())
    assert count.calls == 1
    remove_hook(layer, "count")
    assert type(layer) is Tripler
    plain = Doubler()
    set_original_class(plain, Tripler)  # no hooks: the class itself
    assert type(plain) is Tripler


# ToMe's block and sub-layer hooks ---------------------------------------------------------------------------------
def hooked_block(plan, self_attention=True, sub=None):
    patch, sub = FakePatch(plan), sub if sub is not None else Doubler()
    block = Block(sub)
    block_hook = BlockHook(patch, patch, 0)  # (the fake stands for the patch and its call runner)
    add_hook(block, "tome", block_hook)
    add_hook(sub, "tome", SublayerHook(block_hook, self_attention))
    return patch, block, sub, block_hook


def test_the_sublayer_hook_merges_calls_and_unmerges_in_one_call():
    x = tokens([2, 64, 5])
    plan = bipartite_soft_matching_random2d(tokens([2, 64, 5], seed=1), 8, 8, 2, 2, 32, generator=0)
    patch, block, layer, block_hook = hooked_block(plan)
    out = block(x)
    assert layer.seen == [([2, 32, 5], None)]  # the sub-layer ran on N - r tokens
    np.testing.assert_allclose(out.numpy(), plan.unmerge(2 * plan.merge(x)).numpy(), rtol=1e-6, atol=1e-6)
    out = block(x, run=lambda sub, h: sub(hidden_states=h))  # a keyword input too
    assert layer.seen[-1] == ([2, 32, 5], None) and list(out.shape) == [2, 64, 5]
    assert patch.counters.merges == 2 and patch.planned == 2  # one plan per block call
    assert block_hook.slot.plan is None  # held only while the block runs
    np.testing.assert_array_equal(layer(x).numpy(), 2 * x.numpy())  # outside a block call: plain
    assert layer.seen[-1] == ([2, 64, 5], None) and patch.counters.merges == 2


def test_a_block_without_a_plan_runs_its_sublayers_plainly():
    x = tokens([2, 64, 5])
    for plan in (None, bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 0, generator=0)):  # none, or merges nothing
        patch, block, layer, _ = hooked_block(plan)
        np.testing.assert_array_equal(block(x).numpy(), 2 * x.numpy())
        assert layer.seen == [([2, 64, 5], None)] and patch.counters.merges == 0


def test_the_sublayer_hook_leaves_masked_self_attention_and_other_shapes_alone():
    x = tokens([2, 64, 5])
    plan = bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, generator=0)
    patch, block, layer, _ = hooked_block(plan)

    def calls_it_cannot_merge(sub, h):
        sub(h, attention_mask=paddle.ones([2, 64]))  # a mask over N keys cannot follow merged keys
        sub(h[:, :32])  # another token count (e.g. a chunked feed-forward)
        sub(paddle.concat([h, h]))  # another batch
        return sub(paddle.ones([2, 64]))  # not [B, N, C]

    block(x, run=calls_it_cannot_merge)
    assert [shape for shape, _ in layer.seen] == [[2, 64, 5], [2, 32, 5], [4, 64, 5], [2, 64]]
    assert patch.counters.merges == 0
    patch, block, layer, _ = hooked_block(plan, self_attention=False)  # cross-attention or ff: a mask does not stop it
    block(x, run=lambda sub, h: sub(h, attention_mask=paddle.ones([2, 64])))
    assert layer.seen == [([2, 32, 5], None)] and patch.counters.merges == 1


def test_todo_plans_pass_downsampled_keys_and_values_and_keep_every_query():
    x = tokens([2, 64, 5])
    plan = DownsamplePlan(num_tokens=64, batch_size=2, grid_h=8, grid_w=8, factor=2)
    patch, block, layer, _ = hooked_block(plan)
    out = block(x)
    assert layer.seen == [([2, 64, 5], [2, 16, 5])]  # queries untouched, keys/values from 16 pooled tokens
    np.testing.assert_array_equal(out.numpy(), 2 * x.numpy())  # nothing to unmerge
    block(x, run=lambda sub, h: sub(h, encoder_hidden_states=h))  # already cross-attention: left alone
    assert layer.seen[-1] == ([2, 64, 5], [2, 64, 5]) and patch.counters.merges == 1
    patch, block, layer, _ = hooked_block(plan, self_attention=False)  # ToDo changes self-attention only
    block(x)
    assert layer.seen == [([2, 64, 5], None)] and patch.counters.merges == 0


def test_the_sublayer_hook_runs_any_plan_kind_through_its_run_sublayer_method():
    """No plan type is special to the hook: a plan of a kind it has never seen runs the sub-layer through its own
    ``run_sublayer``, and the runner counts it; one that declines (``NotImplemented``) leaves the layer plain."""

    class Scaling:  # neither a MergePlan nor a DownsamplePlan
        is_identity, batch_size, num_tokens = False, 2, 64

        def __init__(self, declines=False):
            self.declines, self.calls = declines, []

        def run_sublayer(self, sublayer, x, args, kwargs):
            self.calls.append((sublayer.self_attention, list(x.shape)))
            return NotImplemented if self.declines else sublayer.next(3 * x, *args[1:], **kwargs)

    x = tokens([2, 64, 5])
    plan = Scaling()
    patch, block, layer, _ = hooked_block(plan)
    np.testing.assert_allclose(block(x).numpy(), 6 * x.numpy(), rtol=1e-6)
    assert plan.calls == [(True, [2, 64, 5])] and patch.counters.merges == 1
    plan = Scaling(declines=True)
    patch, block, layer, _ = hooked_block(plan, self_attention=False)
    np.testing.assert_array_equal(block(x).numpy(), 2 * x.numpy())
    assert plan.calls == [(False, [2, 64, 5])] and patch.counters.merges == 0


@pytest.mark.parametrize("as_tuple", [False, True])
def test_a_tuple_output_has_its_first_item_unmerged(as_tuple):
    class Pair(Doubler):
        def forward(self, hidden_states, **kwargs):
            out = Doubler.forward(self, hidden_states)
            return (out, "extra") if as_tuple else out

    x = tokens([1, 16, 3])
    plan = bipartite_soft_matching_random2d(x, 4, 4, 2, 2, 8, generator=0)
    _, block, _, _ = hooked_block(plan, sub=Pair())
    out = block(x, run=lambda sub, h: sub(h))
    first = out[0] if as_tuple else out
    assert list(first.shape) == [1, 16, 3] and (not as_tuple or out[1] == "extra")
    np.testing.assert_allclose(first.numpy(), plan.unmerge(2 * plan.merge(x)).numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("error", [RuntimeError("in attention"), KeyboardInterrupt()])
def test_a_sublayer_that_raises_leaves_no_plan_behind(error):
    x = tokens([2, 64, 5])
    plan = bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, generator=0)
    patch, block, layer, block_hook = hooked_block(plan)

    def raising(sub, h):
        sub(h)
        raise error

    with pytest.raises(type(error)):
        block(x, run=raising)
    assert block_hook.slot.plan is None  # nothing pending: the next sub-layer call outside a block is plain
    np.testing.assert_array_equal(layer(x).numpy(), 2 * x.numpy())
    np.testing.assert_allclose(block(x).numpy(), plan.unmerge(2 * plan.merge(x)).numpy(), rtol=1e-6, atol=1e-6)


def test_a_model_call_interrupted_inside_a_block_leaves_the_patch_as_before():
    unet = tiny_unet()
    inputs = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    patch = get_patch(unet)
    with paddle.no_grad():
        expected = unet(*inputs).sample.numpy()
    block = find_blocks(unet)[0][1]

    def ctrl_c(layer, args):
        raise KeyboardInterrupt

    interrupt = block.attn1.to_q.register_forward_pre_hook(ctrl_c)  # inside self-attention, on merged tokens
    with pytest.raises(KeyboardInterrupt), paddle.no_grad():
        unet(*inputs)
    interrupt.remove()
    assert patch.local.call is None and patch.calls_in_flight() == 0
    assert hooks_of(block).get("tome").slot.plan is None
    with paddle.no_grad():
        np.testing.assert_array_equal(unet(*inputs).sample.numpy(), expected)
    ppdiffusers_tome.remove_tome(unet)  # nothing in flight: removal is allowed
    assert all(hooks_of(layer) is None for layer in unet.sublayers(include_self=True))

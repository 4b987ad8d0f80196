"""hooks.py: hook registration that survives copies and pickling, and the block / sub-layer hooks that merge the
input of a sub-layer and unmerge its output."""

import copy
import pickle

import numpy as np
import paddle
import pytest

from ppdiffusers_tome.config import ToMeConfig
from ppdiffusers_tome.hooks import BlockHooks, HookCall, HookRecord, SublayerHooks
from ppdiffusers_tome.merge import DownsamplePlan, bipartite_soft_matching_random2d
from ppdiffusers_tome.state import ToMeState


class Doubler(paddle.nn.Layer):
    """A stand-in sub-layer that records what it was given: output = 2 * input."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        self.seen.append((list(hidden_states.shape), None if encoder_hidden_states is None
                          else list(encoder_hidden_states.shape)))
        return hidden_states * 2


class Recorder:
    def __init__(self):
        self.calls = []

    def note(self, *args):
        self.calls.append(len(args))


class FakePlanner:
    def __init__(self, plan):
        self.plan = plan

    def plan_for(self, index, hidden):
        return self.plan


class FakeRecompute:
    possible = False


class FakePatch:
    """What BlockHooks needs of a ModelPatch: a state, and a planner that gives a plan for a block's input."""

    def __init__(self, plan):
        self.recompute = FakeRecompute()  # no gradient checkpointing here
        self.state = ToMeState(ToMeConfig(), num_blocks=1)
        self.planner = FakePlanner(plan)
        # a model call in flight (8x8 latent), as the model's pre-hook would start it: blocks plan only inside one
        self.state.begin_call(paddle.ones([1, 4, 8, 8]), 10)


def tokens(shape, seed=0):
    return paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype("float32"))


def test_hook_call_forwards_to_its_owner_and_survives_deepcopy():
    owner = Recorder()
    hook = HookCall(owner, "note")
    hook(1, 2, 3)
    twin = copy.deepcopy(hook)
    twin(1)
    assert owner.calls == [3] and twin.owner.calls == [3, 1] and twin.owner is not owner


def test_hook_record_registers_and_removes_pre_and_post_hooks():
    layer, owner = Doubler(), Recorder()
    pre, post = HookRecord(layer, "pre", owner, "note"), HookRecord(layer, "post", owner, "note")
    x = tokens([1, 4, 3])
    np.testing.assert_array_equal(layer(x).numpy(), 2 * x.numpy())
    assert owner.calls == [3, 4]  # pre-hook (layer, args, kwargs), post-hook (layer, args, kwargs, output)
    pre.remove()
    post.remove()
    layer(x)
    assert owner.calls == [3, 4]
    assert pre.hook_id not in layer._forward_pre_hooks and post.hook_id not in layer._forward_post_hooks


def test_an_unpickled_hook_record_keeps_its_id_from_being_reused(monkeypatch):
    layer = Doubler()
    record = HookRecord(layer, "pre", Recorder(), "note")
    helper = paddle.nn.layer.layers.HookRemoveHelper
    monkeypatch.setattr(helper, "next_hook_id", 0)  # a fresh process: Paddle counts hook ids from 0 again
    pickle.loads(pickle.dumps(record))
    assert helper.next_hook_id > record.hook_id  # the next hook registered cannot overwrite it


def hooked_sublayer(plan, self_attention=True):
    patch = FakePatch(plan)
    block, layer = BlockHooks(patch, 0), Doubler()
    sub = SublayerHooks(block, "attn1", self_attention)
    HookRecord(layer, "pre", sub, "before")
    HookRecord(layer, "post", sub, "after")
    return patch, block, layer


def test_sublayer_hooks_run_the_layer_on_merged_tokens_and_unmerge_its_output():
    x = tokens([2, 64, 5])
    plan = bipartite_soft_matching_random2d(tokens([2, 64, 5], seed=1), 8, 8, 2, 2, 32, generator=0)
    patch, block, layer = hooked_sublayer(plan)
    block.before(None, (x,), {})  # the block's pre-hook hands the plan to the state
    assert patch.state.plan_of(0) is plan
    out = layer(x)
    assert layer.seen == [([2, 32, 5], None)]  # attention ran on N - r tokens
    np.testing.assert_allclose(out.numpy(), plan.unmerge(2 * plan.merge(x)).numpy(), rtol=1e-6, atol=1e-6)
    assert patch.state.merges == 1 and patch.state.end_merge("0/attn1") is None  # the unmerge was taken
    out = layer(hidden_states=x)  # keyword input too
    assert layer.seen[-1] == ([2, 32, 5], None) and list(out.shape) == [2, 64, 5]
    block.after(None, (x,), {}, None)  # the block's post-hook: no plan any more, the layer runs plainly
    np.testing.assert_array_equal(layer(x).numpy(), 2 * x.numpy())


def test_sublayer_hooks_leave_calls_they_cannot_merge_alone():
    x = tokens([2, 64, 5])
    plan = bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, generator=0)
    patch, block, layer = hooked_sublayer(plan)
    block.before(None, (x,), {})
    layer(x, attention_mask=paddle.ones([2, 64]))  # a mask over N keys cannot follow merged keys
    layer(x[:, :32])  # another token count (e.g. a chunked feed-forward)
    layer(paddle.concat([x, x]))  # another batch
    assert [shape for shape, _ in layer.seen] == [[2, 64, 5], [2, 32, 5], [4, 64, 5]]
    assert patch.state.merges == 0


def test_todo_plans_pass_downsampled_keys_and_values_and_keep_every_query():
    x = tokens([2, 64, 5])
    plan = DownsamplePlan(num_tokens=64, batch_size=2, grid_h=8, grid_w=8, factor=2)
    patch, block, layer = hooked_sublayer(plan)
    block.before(None, (x,), {})
    out = layer(x)
    assert layer.seen == [([2, 64, 5], [2, 16, 5])]  # queries untouched, keys/values from 16 pooled tokens
    np.testing.assert_array_equal(out.numpy(), 2 * x.numpy())  # nothing to unmerge
    layer(x, encoder_hidden_states=x)  # already cross-attention: left alone
    assert layer.seen[-1] == ([2, 64, 5], [2, 64, 5]) and patch.state.merges == 1


@pytest.mark.parametrize("as_tuple", [False, True])
def test_a_tuple_output_has_its_first_item_unmerged(as_tuple):
    class Pair(Doubler):
        def forward(self, hidden_states, **kwargs):
            out = super().forward(hidden_states)
            return (out, "extra") if as_tuple else out

    x = tokens([1, 16, 3])
    plan = bipartite_soft_matching_random2d(x, 4, 4, 2, 2, 8, generator=0)
    patch = FakePatch(plan)
    block, layer = BlockHooks(patch, 0), Pair()
    sub = SublayerHooks(block, "attn1", True)
    HookRecord(layer, "pre", sub, "before")
    HookRecord(layer, "post", sub, "after")
    block.before(None, (x,), {})
    out = layer(x)
    first = out[0] if as_tuple else out
    assert list(first.shape) == [1, 16, 3] and (not as_tuple or out[1] == "extra")

"""The patch of one model: hooks merge and unmerge exactly where tomesd does, sizes and timesteps are read from the
call, and removal, errors, copies and repeated apply/remove leave the model as it was."""

import warnings

import numpy as np
import paddle
import pytest
from ppdiffusers.models.attention import BasicTransformerBlock

import ppdiffusers_tome
from ppdiffusers_tome.ops import bipartite_soft_matching_random2d
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.config import ToMeConfig
from ppdiffusers_tome.tome.patch import ModelPatch, find_blocks, get_patch
from tests.conftest import run
from tests.unet_calls import expected_block_output, hook_counts, unet_inputs, unet_output


@pytest.mark.parametrize("flags", [(True, False, False), (True, True, True), (False, True, False)])
def test_hooks_place_merge_and_unmerge_exactly_where_tomesd_does(flags):
    unet = tiny_unet()
    block = find_blocks(unet)[0][1]
    rng = np.random.default_rng(3)
    x = paddle.to_tensor(rng.standard_normal((2, 256, 32)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    plan = bipartite_soft_matching_random2d(x, 16, 16, 2, 2, 128, no_rand=True)
    with paddle.no_grad():
        expected = expected_block_output(block, x, context, plan, *flags).numpy()
        vanilla = block(x, encoder_hidden_states=context).numpy()
        config = ToMeConfig(use_rand=False, merge_attn=flags[0], merge_crossattn=flags[1], merge_mlp=flags[2])
        patch = ModelPatch.install(unet, config)
        with patch.in_call(paddle.zeros([2, 4, 16, 16])):  # the block runs as inside a call with a 16x16 latent
            got = block(x, encoder_hidden_states=context).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(got - vanilla).max() > 1e-3  # merging changed something
    patch.remove()


def test_sample_by_keyword_and_by_position_give_the_same_result():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    with paddle.no_grad():
        positional = unet(sample, t, context).sample.numpy()
        merges = get_patch(unet).counters.merges
        keyword = unet(sample=sample, timestep=t, encoder_hidden_states=context).sample.numpy()
    assert merges > 0 and get_patch(unet).counters.merges == 2 * merges
    np.testing.assert_array_equal(positional, keyword)


def test_chunked_feed_forward_is_left_alone():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, merge_mlp=True, use_rand=False)
    with paddle.no_grad():
        whole = unet(sample, t, context).sample.numpy()
        for _, block in find_blocks(unet):
            block.set_chunk_feed_forward(16, dim=1)  # chunks of 16 tokens never match the 256-token plan
        chunked = unet(sample, t, context).sample.numpy()
    assert np.isfinite(chunked).all()
    assert np.abs(whole - chunked).max() > 0  # merging was skipped for the chunked ff only


def test_remove_restores_classes_hooks_attributes_and_state_dict():
    from ppdiffusers_tome.core.registry import KEY, original_class

    unet = tiny_unet()
    reference = unet_output(unet)
    before_hooks = hook_counts(unet)
    before_classes = {name: type(m) for name, m in unet.named_sublayers(include_self=True)}
    before_attrs = {id(m): set(m.__dict__) for m in unet.sublayers(include_self=True)}
    before_state = {name: value.numpy().copy() for name, value in unet.state_dict().items()}
    sublayers = {name: id(m) for name, m in unet.named_sublayers(include_self=True)}
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    unet_output(unet)  # a call leaves nothing behind either
    assert hook_counts(unet) != before_hooks
    changed = [name for name, m in unet.named_sublayers(include_self=True) if type(m) is not before_classes[name]]
    assert changed and all(original_class(m) is before_classes[n] for n, m in unet.named_sublayers(include_self=True))
    ppdiffusers_tome.remove_tome(unet)
    assert hook_counts(unet) == before_hooks
    assert {name: type(m) for name, m in unet.named_sublayers(include_self=True)} == before_classes  # same classes
    assert not any(KEY in m.__dict__ for m in unet.sublayers(include_self=True))
    assert {id(m): set(m.__dict__) for m in unet.sublayers(include_self=True)} == before_attrs
    assert {name: id(m) for name, m in unet.named_sublayers(include_self=True)} == sublayers
    state = unet.state_dict()
    assert list(state) == list(before_state)
    for name, value in before_state.items():
        np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name)
    assert all(type(m) is BasicTransformerBlock for _, m in find_blocks(unet))
    np.testing.assert_array_equal(unet_output(unet), reference)


def test_an_error_inside_a_patched_forward_leaves_the_model_usable():
    unet = tiny_unet()
    sample, t, context = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    with pytest.raises(Exception):
        with paddle.no_grad():
            unet(sample, t, paddle.randn([2, 5, 7]))  # wrong context width fails inside attn2
    assert all(get_patch(unet).plan_in_flight(i) is None for i in range(len(get_patch(unet).blocks)))
    with paddle.no_grad():
        out = unet(sample, t, context).sample
    assert np.isfinite(out.numpy()).all()


# lifecycle: copies, many cycles, threads, changes mid-generation ---------------------------------------------------
def test_many_apply_remove_cycles_leave_nothing_behind():
    import gc
    import weakref

    from ppdiffusers_tome.tools.measure import _rss_bytes

    unet = tiny_unet()
    inputs = unet_inputs(unet)
    before_hooks = hook_counts(unet)
    before_attrs = {id(m): set(m.__dict__) for m in unet.sublayers(include_self=True)}
    patches = []
    with paddle.no_grad():
        for cycle in range(200):
            if cycle == 20:
                gc.collect()
                rss_start = _rss_bytes()
            ppdiffusers_tome.apply_tome(unet, ratio=0.5, merge_mlp=cycle % 2 == 0)
            if cycle % 50 == 0:
                unet(*inputs)
            patches.append(weakref.ref(get_patch(unet)))
            ppdiffusers_tome.remove_tome(unet)
    gc.collect()
    assert hook_counts(unet) == before_hooks
    assert {id(m): set(m.__dict__) for m in unet.sublayers(include_self=True)} == before_attrs
    assert all(ref() is None for ref in patches)  # every patch object was freed
    assert _rss_bytes() - rss_start < 32 * 2**20


def test_apply_and_remove_from_a_step_callback_take_effect_at_the_next_step():
    from ppdiffusers_tome.testing import tiny_sd_pipeline

    pipe = tiny_sd_pipeline()
    log = []

    def callback(pipeline, step, timestep, kwargs):
        if step == 0:
            pipeline.apply_tome(ratio=0.5)
        if step == 2:
            log.append(dict(ppdiffusers_tome.tome_stats(pipeline)["unet"]))
            pipeline.remove_tome()
        return kwargs

    run(pipe, steps=5, callback_on_step_end=callback)
    expected = {"blocks": 3, "calls": 2, "merges": 6, "plans_computed": 6, "plans_reused": 0, "plans_shared": 0, "blocks_skipped": 0,
                "blocks_pooled": 0}
    assert log == [expected]  # steps 1 and 2 merged, in the 3 hooked (1x) blocks each
    assert get_patch(pipe.unet) is None


def test_a_failing_merged_sublayer_leaves_no_silenced_hook_error():
    unet = tiny_unet()
    sample, t, _ = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5, merge_crossattn=True)  # attn2 input is merged, then attn2 fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception) as raised:
            with paddle.no_grad():
                unet(sample, t, paddle.randn([2, 5, 7]))
    assert "NoneType" not in str(raised.value)
    assert not [w for w in caught if "NoneType" in str(w.message) or "silenced" in str(w.message).lower()]


def test_call_state_is_cleared_after_each_call():
    unet = tiny_unet()
    inputs = unet_inputs(unet)
    x = paddle.to_tensor(np.random.default_rng(4).standard_normal((2, 256, 32)).astype("float32"))
    with paddle.no_grad():
        untouched = find_blocks(tiny_unet())[0][1](x, encoder_hidden_states=inputs[2]).numpy()
    patch = ModelPatch.install(unet, ToMeConfig(ratio=0.5))
    with paddle.no_grad():
        unet(*inputs)
        merges = patch.counters.merges
        block = find_blocks(unet)[0][1]
        outside = block(x, encoder_hidden_states=inputs[2]).numpy()  # outside any model call: no merging
    np.testing.assert_array_equal(outside, untouched)
    assert patch.counters.merges == merges and patch.calls_in_flight() == 0
    assert all(patch.plan_in_flight(index) is None for index, _, _ in patch.hooked)
    assert patch.merged_blocks == 3 and patch.finest_level == 1  # the report of the last call survives


def test_installing_over_an_existing_patch_leaves_no_orphan_hooks():
    once, twice = tiny_unet(), tiny_unet()
    ModelPatch.install(once, ToMeConfig())
    first = ModelPatch.install(twice, ToMeConfig())
    second = ModelPatch.install(twice, ToMeConfig(ratio=0.3))
    assert hook_counts(once) == hook_counts(twice) and get_patch(twice) is second and not first.blocks
    second.remove()
    assert hook_counts(twice) == hook_counts(tiny_unet())

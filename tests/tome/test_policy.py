"""The policy of ``apply_tome``: on GPU kernels (forced on the CPU) blocks whose attention work ``batch * tokens**2``
is below ``min_work`` are skipped at no cost, larger ones get K/V pooling, ``policy="tomesd"`` merges every eligible
block as tomesd; on CPU kernels ``"auto"`` is ``"tomesd"``. Settings a user gives keep their plan, and the choice is
reported per token count."""

import logging

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.ops import DownsamplePlan, MergePlan, bipartite_soft_matching_random2d, force_kernels
from ppdiffusers_tome.testing import gpu_kernels, tiny_unet
from ppdiffusers_tome.tome.config import ToMeConfig
from ppdiffusers_tome.tome.patch import ModelPatch, find_blocks, get_patch
from ppdiffusers_tome.tome.policy import (
    ASSUMED_BATCH,
    MERGE_MIN_WORK,
    POOL_MIN_RATIO,
    POOL_MIN_WORK,
    Policy,
    pools_by_default,
)
from ppdiffusers_tome.tools.measure import count_forward_ops
from tests.unet_calls import expected_block_output, unet_inputs

UNET = "UNet2DConditionModel"


def forward_of(unet, batch, latent, seed=0):
    sample, timestep, context = unet_inputs(unet, batch=batch, hw=(latent, latent), seed=seed)

    def run():
        with paddle.no_grad():
            return unet(sample, timestep, context).sample

    return run


def test_the_default_on_gpu_kernels_adds_at_most_3_ops_per_block_at_4096_tokens_and_batch_2():
    # 512 px with one image (UNet batch 2): 2 * 4096**2 is below min_work, so the three 1x blocks are skipped at no
    # cost; forced to merge (min_work=0), the policy's K/V pooling adds three operators per block. One attention
    # head (the decision and the operators added do not depend on the heads) keeps 4096-token attention fast.
    unet = tiny_unet(attention_head_dim=1)
    run = forward_of(unet, batch=2, latent=64)
    with gpu_kernels():
        vanilla_out = run().numpy()
        vanilla = count_forward_ops(run, unet)
        counted = {}
        for options in ({}, {"min_work": 0}):
            ppdiffusers_tome.apply_tome(unet, ratio=0.5, **options)
            try:
                counted[str(options)] = count_forward_ops(run, unet)
                out = run().numpy()
                stats = ppdiffusers_tome.tome_stats(unet)[UNET]
            finally:
                ppdiffusers_tome.remove_tome(unet)
            if not options:
                assert stats["blocks_skipped"] == 3 * stats["calls"] and stats["merges"] == 0
                np.testing.assert_array_equal(out, vanilla_out)  # skipped: exactly vanilla
            else:
                assert stats["blocks_pooled"] == 3 * stats["calls"] and stats["plans_computed"] == 0
                assert np.abs(out - vanilla_out).max() > 1e-4  # pooled: the attention really changed
    for options, patched in counted.items():
        assert patched.total - vanilla.total <= 3 * 3, (options, patched.total - vanilla.total, patched.by_name)
    assert counted["{}"].total == vanilla.total


def planned(options, batch, tokens, kernels="gpu"):
    """The plan the patched tiny UNet's first block gets for a ``[batch, tokens, 32]`` input in a call on a square
    latent of ``tokens`` positions (the planner alone: no UNet forward at that size)."""
    unet = tiny_unet()
    ppdiffusers_tome.apply_tome(unet, **options)
    patch = get_patch(unet)
    side = int(round(tokens ** 0.5))
    with force_kernels(kernels), patch.in_call(paddle.zeros([batch, 4, side, side]), paddle.to_tensor(500)) as call:
        plan = patch.runner.plan_block(0, paddle.zeros([batch, tokens, 32]), call)
    return plan, ppdiffusers_tome.tome_status(unet)[UNET]["policy"][tokens], ppdiffusers_tome.tome_stats(unet)[UNET]


@pytest.mark.parametrize("batch, tokens, action", [
    (2, 16384, "pool"),  # 1024 px, one image: 5.4e8
    (16, 4096, "pool"),  # 512 px, eight images: 2.7e8
    (2, 9216, "pool"),  # 768 px, one image: 1.7e8
    (4, 4096, "pool"),  # 512 px, two images: 2**26 exactly (and SDXL at 1024 px, two images: its 2x level is 64 x 64)
    (3, 4096, "skip"),  # 5.0e7
    (2, 4096, "skip"),  # 512 px, one image: 3.4e7 (and SDXL at 1024 px, one image: vanilla, as README's table says)
])
def test_the_default_on_gpu_kernels_decides_by_batch_times_tokens_squared(batch, tokens, action):
    plan, decision, stats = planned({}, batch, tokens)
    assert decision["action"] == action and decision["work"] == batch * tokens ** 2
    assert decision["min_work"] == POOL_MIN_WORK and decision["kernels"] == "gpu"
    if action == "pool":  # the default still merges at 16384 tokens and batch 2: keys and values of 2x2 cells
        assert isinstance(plan, DownsamplePlan) and (plan.factor, plan.mode) == (2, "nearest")
        assert plan.kv_tokens == tokens // 4 and stats["blocks_pooled"] == 1
        assert "K/V pooling" in decision["why"] and f"{batch * tokens ** 2:.3g}" in decision["why"]
    else:
        assert plan is None and stats["blocks_skipped"] == 1
        assert "min_work" in decision["why"] and "<" in decision["why"]


@pytest.mark.parametrize("batch, tokens, action", [
    (16, 4096, "merge"),  # 512 px, eight images: 2**28 exactly
    (2, 9216, "skip"),  # 768 px, one image: 1.7e8 (pooling would pay there; a matched plan did not)
    (2, 4096, "skip"),
])
def test_settings_that_keep_their_plan_on_gpu_kernels_need_the_higher_threshold(batch, tokens, action):
    plan, decision, _ = planned({"share_plan": "level"}, batch, tokens)
    assert decision["action"] == action and decision["min_work"] == MERGE_MIN_WORK
    assert (plan is None) == (action == "skip") and not isinstance(plan, DownsamplePlan)


@pytest.mark.parametrize("kernels", ["gpu", "cpu"])
@pytest.mark.parametrize("tokens", [256, 16384])
def test_policy_tomesd_merges_at_any_size_with_tomesds_plan(kernels, tokens):
    plan, decision, stats = planned({"policy": "tomesd"}, 2, tokens, kernels)
    assert type(plan) is MergePlan and plan.r == tokens // 2 and stats["plans_computed"] == 1
    assert decision["action"] == "merge" and "policy='tomesd'" in decision["why"]


def test_on_cpu_kernels_the_default_merges_as_tomesd_bit_for_bit():
    outputs = []
    for policy in ("auto", "tomesd"):
        unet = tiny_unet()
        ppdiffusers_tome.apply_tome(unet, policy=policy)
        outputs.append(forward_of(unet, 2, 16)().numpy())
        stats = ppdiffusers_tome.tome_stats(unet)[UNET]
        assert stats["plans_computed"] == 3 and stats["blocks_skipped"] == stats["blocks_pooled"] == 0
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("flags", [(True, False, False), (True, True, True)])
def test_policy_tomesd_on_gpu_kernels_merges_where_tomesd_does(flags):
    # a 256-token block (far below min_work) merges with tomesd's placement and the GPU kernels' global plan
    unet = tiny_unet()
    block = find_blocks(unet)[0][1]
    rng = np.random.default_rng(4)
    x = paddle.to_tensor(rng.standard_normal((2, 256, 32)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    with gpu_kernels(), paddle.no_grad():
        plan = bipartite_soft_matching_random2d(x, 16, 16, 2, 2, 128, no_rand=True, kind="gpu")
        expected = expected_block_output(block, x, context, plan, *flags).numpy()
        config = ToMeConfig(use_rand=False, merge_attn=flags[0], merge_crossattn=flags[1], merge_mlp=flags[2],
                            policy="tomesd")
        patch = ModelPatch.install(unet, config)
        try:
            with patch.in_call(paddle.zeros([2, 4, 16, 16])):
                got = block(x, encoder_hidden_states=context).numpy()
        finally:
            patch.remove()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(got - block(x, encoder_hidden_states=context).numpy()).max() > 1e-3


def test_pooling_is_todo_with_factor_2_on_the_same_blocks():
    # what the policy pools equals method="todo" (nearest, factor 2), which the ToDo tests check against numpy
    outputs = []
    for options in ({"min_work": 0}, {"method": "todo", "policy": "tomesd"}):
        unet = tiny_unet()
        ppdiffusers_tome.apply_tome(unet, **options)
        with gpu_kernels():
            outputs.append(forward_of(unet, 2, 16)().numpy())
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("options", [
    dict(share_plan="level"), dict(match_window=8), dict(deterministic=True), dict(merge_mlp=True),
    dict(recompute_every=2), dict(ratio=(0.6, 0.3)), dict(ratio=POOL_MIN_RATIO / 2), dict(sx=1, ratio=0.4),
    dict(use_rand=False), dict(seed=7), dict(method="todo", downsample_factor=4),
])
def test_settings_that_shape_the_plan_keep_it_where_the_policy_merges(options):
    assert not pools_by_default(ToMeConfig(**options))
    plan, decision, _ = planned(dict(options, min_work=0), 2, 256)
    assert decision["action"] == "merge"
    if options.get("method") == "todo":  # the user's ToDo, not the policy's pooling
        assert plan.factor == 4
    else:
        assert not isinstance(plan, DownsamplePlan)


def test_min_work_moves_the_threshold_on_any_kernels():
    # CPU kernels skip too once a threshold is set; exactly at the threshold a block merges
    for kernels in ("cpu", "gpu"):
        assert planned({"min_work": 2 * 256 ** 2 + 1}, 2, 256, kernels)[1]["action"] == "skip"
        action = planned({"min_work": 2 * 256 ** 2}, 2, 256, kernels)[1]["action"]
        assert action == ("pool" if kernels == "gpu" else "merge")


def test_a_dynamic_batch_is_decided_with_the_assumed_batch():
    policy = Policy(ToMeConfig())
    hidden = paddle.static.InputSpec([None, 16384, 32], "float32")  # (shape [-1, ...], as while tracing)
    decision = policy.choose_plan(hidden, "gpu")
    assert decision.batch == -1 and decision.work == ASSUMED_BATCH * 16384 ** 2 and decision.action == "pool"
    assert "dynamic batch" in decision.why()


def test_the_first_skip_logs_one_line_naming_the_options_that_force_merging(caplog):
    unet = tiny_unet()
    ppdiffusers_tome.apply_tome(unet)
    run = forward_of(unet, 2, 16)
    with gpu_kernels(), caplog.at_level(logging.WARNING, logger="ppdiffusers_tome.tome.policy"):
        run()
        run()
    lines = [record.getMessage() for record in caplog.records if record.name == "ppdiffusers_tome.tome.policy"]
    assert len(lines) == 1 and "min_work=0" in lines[0] and "policy='tomesd'" in lines[0]
    assert "2 x 256 tokens" in lines[0] and UNET in lines[0]
    assert ppdiffusers_tome.tome_stats(unet)[UNET]["blocks_skipped"] == 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="fast"), "policy must be one of ('auto', 'tomesd')"),
    (dict(min_work=-1), "min_work must be None"),
    (dict(min_work=1.5), "min_work must be None"),
    (dict(min_work=True), "min_work must be None"),
    (dict(min_work=0, policy="tomesd"), "min_work=0 is a threshold of policy='auto'"),
])
def test_bad_policy_arguments_are_refused_before_anything_is_patched(kwargs, message):
    unet = tiny_unet()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ppdiffusers_tome.apply_tome(unet, **kwargs)
    assert get_patch(unet) is None

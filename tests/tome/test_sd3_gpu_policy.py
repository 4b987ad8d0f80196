"""SD3 on GPU kernels (forced on the CPU), as the H200 measurements of docs/gpu.md section 9 say it should run: with
the defaults a joint block runs as vanilla below ``JOINT_MIN_WORK`` (no operator added) and gets ToDo's 2 x 2
downsampling of the image keys and values from it on (at most 4 operators added); settings that ask for merging
merge from ``JOINT_MERGE_MIN_WORK`` (1024 px with one image) with one plan per call for every joint block, so the
blocks after the first add only the merge and the unmerge; no host<->device transfer is added and the decision reads
no tensor value (a program exported with a dynamic batch equals eager). On CPU kernels SD3 keeps tomesd's plan in
every block.

Sizes are SD3's: a ``px``-pixel image is a ``px / 8`` latent and a ``(px / 16)**2``-token patch grid; one image with
classifier-free guidance is a batch of 2. The policy compares ``batch * image tokens**2``, so the forwards that count
operators run at those token counts, on the tiny transformer made narrower (one head of 16 channels).
"""

import collections

import numpy as np
import paddle
import pytest
from paddle import profiler
from paddle.base.core import TracerEventType
from paddle.static import InputSpec
from ppdiffusers.models.attention_processor import JointAttnProcessor2_5

import ppdiffusers_tome
from ppdiffusers_tome.ops import DownsamplePlan, MergePlan, force_kernels
from ppdiffusers_tome.testing import gpu_kernels, tiny_sd3_transformer
from ppdiffusers_tome.tome.patch import get_patch
from ppdiffusers_tome.tome.policy import JOINT_MERGE_MIN_WORK, JOINT_MIN_WORK
from ppdiffusers_tome.tools.measure import TransferCounter
from tests.test_sd3_model import NoisePredictor
from tests.tome.test_sd3_tome import (
    LATENT_CHANNELS,
    MODEL,
    POOLED_CHANNELS,
    TEXT_CHANNELS,
    WIDTH,
    forward,
    transformer_inputs,
)

TODO_BUDGET = 4  # operators a downsampled block may add: ToDo's reshape, strided slice, reshape, and one to spare


def tokens_at(px):
    return (px // 16) ** 2


def narrow_sd3():
    """The tiny SD3 transformer (3 joint blocks, the last ``context_pre_only``) with one head of 16 channels and
    positional embeddings for grids up to 64 x 64 (1024 px)."""
    return tiny_sd3_transformer(num_attention_heads=1, attention_head_dim=16, pos_embed_max_size=64)


# the decision, block by block, without a forward --------------------------------------------------------------------
def planned(options, px, images, kernels="gpu"):
    """The plans the three blocks of a tiny SD3 transformer patched with ``options`` get in one call at ``px`` with
    ``images`` images (the planner alone), the policy's decision as ``tome_status`` reports it, and the counters."""
    model = tiny_sd3_transformer()
    ppdiffusers_tome.apply_tome(model, **options)
    patch, batch, tokens = get_patch(model), 2 * images, tokens_at(px)
    rng = np.random.default_rng(px + images)
    sample = paddle.to_tensor(rng.standard_normal((batch, LATENT_CHANNELS, px // 8, px // 8)).astype("float32"))
    hidden = paddle.to_tensor(rng.standard_normal((batch, tokens, WIDTH)).astype("float32"))
    with force_kernels(kernels), patch.in_call(sample, paddle.to_tensor([500.0] * batch)) as call:
        plans = [patch.runner.plan_block(index, hidden, call) for index in range(3)]
    decision = ppdiffusers_tome.tome_status(model)[MODEL]["policy"][tokens]
    return plans, decision, ppdiffusers_tome.tome_stats(model)[MODEL]


@pytest.mark.parametrize("px, images, action", [
    (512, 1, "skip"),  # 2 * 1024**2 = 2.1e6: ToDo 0.89-1.03x eager on the H200
    (512, 2, "skip"),  # 4.2e6, not measured
    (512, 4, "pool"),  # 8.4e6 = 2**23: 1.06x eager, 1.09x as a CUDA graph
    (768, 1, "pool"),  # 1.1e7
    (1024, 1, "pool"),  # 3.4e7
])
def test_the_default_on_gpu_kernels_downsamples_sd3_image_keys_and_values_from_joint_min_work(px, images, action):
    plans, decision, stats = planned({}, px, images)
    tokens = tokens_at(px)
    assert decision["action"] == action and decision["min_work"] == JOINT_MIN_WORK == 2**23
    assert decision["work"] == 2 * images * tokens ** 2 and decision["kernels"] == "gpu" and not decision["shared"]
    if action == "pool":  # ToDo's defaults: the top-left token of every 2 x 2 cell of the patch grid
        assert all(isinstance(plan, DownsamplePlan) for plan in plans)
        assert [(plan.factor, plan.mode, plan.kv_tokens) for plan in plans] == [(2, "nearest", tokens // 4)] * 3
        assert stats["blocks_pooled"] == 3 and stats["plans_computed"] == 0
        assert "image keys and values" in decision["why"] and ">=" in decision["why"]
    else:
        assert plans == [None] * 3 and stats["blocks_skipped"] == 3 and stats["blocks_pooled"] == 0
        assert "<" in decision["why"]


@pytest.mark.parametrize("options", [dict(merge_mlp=True), dict(share_plan="level"), dict(ratio=0.2),
                                     dict(use_rand=False)], ids=["mlp", "share-level", "ratio0.2", "fixed"])
@pytest.mark.parametrize("px, images, action", [
    (512, 4, "skip"),  # 8.4e6: a plan shared by every block 0.82x eager, 1.04x as a CUDA graph
    (768, 1, "skip"),  # 1.1e7: shared 0.69-1.01x, 1.08x
    (768, 2, "skip"),  # 2.1e7, not measured
    (1024, 1, "merge"),  # 3.4e7 = 2**25: shared 1.13-1.14x, 1.22-1.23x
    (768, 4, "merge"),  # 4.2e7: shared 1.12x, 1.15x
])
def test_settings_that_ask_for_merging_merge_sd3_blocks_from_1024_px_with_one_plan_per_call(options, px, images,
                                                                                            action):
    plans, decision, stats = planned(options, px, images)
    assert decision["action"] == action and decision["min_work"] == JOINT_MERGE_MIN_WORK == 2**25
    if action == "merge":
        assert isinstance(plans[0], MergePlan) and plans[1] is plans[0] and plans[2] is plans[0]
        assert stats["plans_computed"] == 1 and stats["plans_shared"] == 2 and decision["shared"]
        assert "one plan per call" in decision["why"]
    else:
        assert plans == [None] * 3 and stats["blocks_skipped"] == 3


def test_policy_tomesd_merges_sd3_blocks_at_any_size_with_one_plan_per_call_on_gpu_kernels_only():
    plans, decision, stats = planned(dict(policy="tomesd"), 512, 1)
    assert decision["action"] == "merge" and decision["shared"] and all(plan is plans[0] for plan in plans)
    assert stats["plans_computed"] == 1 and stats["plans_shared"] == 2
    plans, decision, stats = planned(dict(policy="tomesd"), 512, 1, kernels="cpu")  # CPU kernels: a plan per block
    assert not decision["shared"] and len({id(plan) for plan in plans}) == 3 and stats["plans_computed"] == 3


@pytest.mark.parametrize("options, shared", [(dict(share_plan="block"), False), (dict(share_plan="level"), True)])
def test_share_plan_given_by_the_user_decides_the_sharing_on_sd3(options, shared):
    plans, decision, stats = planned(dict(options, merge_mlp=True), 1024, 1)
    assert decision["action"] == "merge" and decision["shared"] == shared
    assert stats["plans_computed"] == (1 if shared else 3) and (plans[1] is plans[0]) == shared


def test_todo_asked_for_on_sd3_runs_from_joint_min_work_and_cpu_kernels_keep_tomesds_plan_per_block():
    plans, decision, _ = planned(dict(method="todo"), 512, 4)
    assert decision["action"] == "merge" and decision["min_work"] == JOINT_MIN_WORK
    assert not decision["shared"] and "one plan per call" not in decision["why"]  # ToDo has no plan to share
    assert all(isinstance(plan, DownsamplePlan) for plan in plans)
    plans, decision, stats = planned({}, 512, 1, kernels="cpu")  # CPU kernels: merging pays at every size
    assert decision["action"] == "merge" and decision["min_work"] == 0 and not decision["shared"]
    assert all(type(plan) is MergePlan for plan in plans) and stats["plans_computed"] == 3


def test_a_joint_layer_with_an_unknown_processor_keeps_tomes_plan_instead_of_downsampling():
    class OwnProcessor(JointAttnProcessor2_5):
        pass  # a subclass of ppdiffusers' processor: its attention core is not one the package knows

    model = tiny_sd3_transformer()
    model.transformer_blocks[1].attn.set_processor(OwnProcessor())
    ppdiffusers_tome.apply_tome(model)
    policy = get_patch(model).settings.policy
    assert policy.choose_plan_for("gpu", 2, tokens_at(1024)).action == "merge"
    assert policy.choose_plan_for("gpu", 2, tokens_at(768)).action == "skip"  # ToMe's threshold, 2**25


# operators and transfers, counted in forwards at SD3's token counts -------------------------------------------------
def count_block_ops(run, model):
    """Eager operators issued inside each joint block during ``run()`` (``paddle.profiler``, host events, so the same
    on a CPU and a GPU; each block call is wrapped in a named ``RecordEvent`` by forward hooks, and an operator is
    the block's if that event encloses it), the host<->device transfers of the same call, and its result."""
    blocks, events, handles = model.transformer_blocks, {}, []
    for index, block in enumerate(blocks):
        def begin(layer, args, index=index):
            events[index] = profiler.RecordEvent(f"sd3_block_{index}")
            events[index].begin()

        def end(layer, args, output, index=index):
            events.pop(index).end()

        handles.append(block.register_forward_pre_hook(begin, prepend=True))
        handles.append(block.register_forward_post_hook(end))
    prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda _: None)
    prof.start()
    try:
        with TransferCounter() as transfers:
            result = run()
    finally:
        prof.stop()
        for handle in handles:
            handle.remove()
    counts = collections.Counter()
    stack = [(root, None) for root in prof.profiler_result.get_data().values()]
    while stack:
        node, owner = stack.pop()
        owner = node.name if node.name.startswith("sd3_block_") else owner
        if node.type == TracerEventType.Operator and owner is not None:
            counts[owner] += 1
        stack.extend((child, owner) for child in node.children_node)
    ops = [counts[f"sd3_block_{index}"] for index in range(len(blocks))]
    return ops, collections.Counter(transfers.by_site()), result


@pytest.fixture(scope="module")
def sd3_runs():
    """``runs(px, options)``: per-block operators, transfers and output of one GPU-kernel forward of the narrow SD3
    transformer at ``px`` with one image (``options=None``: vanilla), each measured once for the module."""
    model, done, warm = narrow_sd3(), {}, set()

    def runs(px, options=None):
        key = (px, repr(options))
        if key not in done:
            inputs = transformer_inputs(batch=2, latent_hw=(px // 8, px // 8), seed=px)
            ppdiffusers_tome.remove_tome(model)
            if options is not None:
                ppdiffusers_tome.apply_tome(model, **options)
            with gpu_kernels():
                if options and px not in warm:  # (options that merge here, in these tests)
                    forward(model, inputs)  # the first merge on a grid uploads its partition constants, once
                    warm.add(px)
                ops, transfers, out = count_block_ops(lambda: forward(model, inputs), model)
            stats = ppdiffusers_tome.tome_stats(model).get(MODEL)
            done[key] = ops, transfers, out, stats
        return done[key]

    yield runs
    ppdiffusers_tome.remove_tome(model)


def test_the_default_adds_no_operator_and_no_transfer_to_sd3_blocks_at_512_px_with_one_image(sd3_runs):
    vanilla_ops, vanilla_transfers, vanilla, _ = sd3_runs(512)
    ops, transfers, out, stats = sd3_runs(512, {})
    assert min(vanilla_ops) > 50  # real block calls were counted
    assert ops == vanilla_ops and transfers == vanilla_transfers
    assert stats["blocks_skipped"] == 3 and stats["merges"] == 0
    np.testing.assert_array_equal(out, vanilla)  # skipped: exactly vanilla


@pytest.mark.parametrize("px", [768, 1024])
def test_the_default_adds_at_most_4_operators_and_no_transfer_per_sd3_block_from_768_px(sd3_runs, px):
    vanilla_ops, vanilla_transfers, vanilla, _ = sd3_runs(px)
    ops, transfers, out, stats = sd3_runs(px, {})
    added = [patched - plain for patched, plain in zip(ops, vanilla_ops)]
    assert all(0 < count <= TODO_BUDGET for count in added), added
    assert transfers == vanilla_transfers, transfers - vanilla_transfers
    assert stats["blocks_pooled"] == 3 and stats["merges"] == 3 and stats["plans_computed"] == 0
    assert np.abs(out - vanilla).max() > 1e-4  # the attention really changed


@pytest.mark.parametrize("options", [dict(policy="tomesd"), dict(merge_mlp=True)], ids=["attention", "attention+mlp"])
def test_merging_at_1024_px_plans_once_per_call_so_later_sd3_blocks_add_at_most_half_the_first(sd3_runs, options):
    # Before one plan per call, every block added the plan and its merges: 42 operators each on the attention alone,
    # 51 with the MLP (docs/gpu.md section 9). Now the first block adds the plan, the call's partition and its merges,
    # the others the merge and unmerge (twice with the MLP) of the shared plan.
    vanilla_ops, vanilla_transfers, vanilla, _ = sd3_runs(1024)
    ops, transfers, out, stats = sd3_runs(1024, options)
    added = [patched - plain for patched, plain in zip(ops, vanilla_ops)]
    assert added[0] > 0 and all(0 < later <= added[0] / 2 for later in added[1:]), added
    assert stats["plans_computed"] == stats["calls"] and stats["plans_shared"] == 2 * stats["calls"]
    assert transfers == vanilla_transfers, transfers - vanilla_transfers
    assert np.abs(out - vanilla).max() > 1e-4


# what the downsampling computes, and that no Python decision reads a tensor value -----------------------------------
def test_the_policys_sd3_downsampling_is_todo_with_factor_2_nearest_on_the_same_blocks():
    # ToDo on SD3 is checked against a float64 numpy forward in tests/tome/test_sd3_todo.py; min_work=0 lets the policy
    # downsample at this small size
    inputs = transformer_inputs(batch=2, latent_hw=(16, 20), seed=9)
    outputs = []
    for options in ({"min_work": 0}, {"method": "todo", "policy": "tomesd"}):
        model = ppdiffusers_tome.apply_tome(tiny_sd3_transformer(), **options)
        with gpu_kernels():
            outputs.append(forward(model, inputs))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert np.abs(outputs[0] - forward(tiny_sd3_transformer(), inputs)).max() > 1e-4


@pytest.mark.parametrize("options, action", [({"min_work": 0}, "pool"), ({"policy": "tomesd"}, "merge")],
                         ids=["downsampled", "shared-plan"])
def test_sd3_on_gpu_kernels_exports_with_a_dynamic_batch_and_equals_eager(options, action, tmp_path):
    """The decision is made on shapes only (a dynamic batch counts as 2): a program traced with a ``None`` batch on
    GPU kernels, saved and loaded, equals the eager model at batch 1 and 3."""
    transformer = tiny_sd3_transformer(num_layers=2)
    model = NoisePredictor(transformer)
    model.eval()
    batches = {batch: transformer_inputs(batch, text_tokens=10, seed=batch, timestep=700.0) for batch in (1, 3)}
    with paddle.no_grad():
        vanilla = {batch: model(*inputs).numpy() for batch, inputs in batches.items()}
    ppdiffusers_tome.apply_tome(transformer, **options)
    spec = [InputSpec([None, LATENT_CHANNELS, 16, 16], "float32"), InputSpec([None, 10, TEXT_CHANNELS], "float32"),
            InputSpec([None, POOLED_CHANNELS], "float32"), InputSpec([None], "float32")]
    with gpu_kernels():
        with paddle.no_grad():
            eager = {batch: model(*inputs).numpy() for batch, inputs in batches.items()}
        static = paddle.jit.to_static(model, input_spec=spec, full_graph=True)
        path = str(tmp_path / "sd3")
        paddle.jit.save(static, path)
        loaded = paddle.jit.load(path)
        for batch, inputs in batches.items():
            assert np.abs(eager[batch] - vanilla[batch]).max() > 1e-4
            np.testing.assert_allclose(loaded(*inputs).numpy(), eager[batch], rtol=1e-5, atol=1e-5)
    assert ppdiffusers_tome.tome_status(transformer)[MODEL]["policy"][64]["action"] == action

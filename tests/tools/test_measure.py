"""Measurement helpers (ppdiffusers_tome/measure.py) against direct numpy computations."""

import math

import numpy as np
import paddle
import pytest

from ppdiffusers_tome.tools.measure import ForwardTimer, PeakMemory, median, psnr, relative_l2, set_threads


def test_psnr_matches_its_definition():
    rng = np.random.default_rng(0)
    ref = rng.uniform(0, 1, (8, 8, 3))
    test = np.clip(ref + rng.normal(0, 0.05, ref.shape), 0, 1)
    mse = sum((x - y) ** 2 for x, y in zip(ref.ravel(), test.ravel())) / ref.size
    assert math.isclose(psnr(ref, test), 10 * math.log10(1 / mse), rel_tol=1e-9)
    assert math.isclose(psnr(ref * 255, test * 255, data_range=255.0), psnr(ref, test), rel_tol=1e-9)
    assert psnr(ref, ref) == float("inf")


def test_relative_l2_matches_its_definition():
    rng = np.random.default_rng(1)
    ref, test = rng.normal(size=100), rng.normal(size=100)
    expected = math.sqrt(sum((t - r) ** 2 for r, t in zip(ref, test))) / math.sqrt(sum(r * r for r in ref))
    assert math.isclose(relative_l2(ref, test), expected, rel_tol=1e-12)
    with pytest.raises(ValueError, match="non-zero reference"):
        relative_l2(np.zeros(3), np.ones(3))


def test_peak_memory_sees_a_large_temporary_allocation():
    with PeakMemory() as small:
        paddle.ones([16]).sum()
    with PeakMemory() as large:
        big = paddle.ones([64, 1024, 1024])  # 256 MiB
        float(big.sum())
        del big
    assert large.added_bytes > 200 * 2**20 > small.added_bytes
    assert large.kind == "cpu_peak_rss"


def test_forward_timer_records_every_call_until_removed():
    layer = paddle.nn.Linear(4, 4)
    timer = ForwardTimer(layer)
    for _ in range(3):
        layer(paddle.ones([2, 4]))
    timer.remove()
    layer(paddle.ones([2, 4]))
    assert len(timer.seconds) == 3 and all(s > 0 for s in timer.seconds)
    assert not layer._forward_pre_hooks and not layer._forward_post_hooks


def test_median_and_threads():
    assert median([3.0, 1.0, 2.0]) == 2.0 and math.isnan(median([]))
    assert set_threads(1) == 1
    with pytest.raises(ValueError, match="threads must be >= 1"):
        set_threads(-2)


# instruments of the GPU path: host<->device transfers and eager operator counts ----------------------------------
from ppdiffusers_tome.tools.measure import (  # noqa: E402
    MergingBlocks,
    TransferCounter,
    count_forward_ops,
    count_ops,
    ops_added_per_block,
)

_WATCHED = ("numpy", "item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__array__")


def _originals():
    return (
        {name: paddle.Tensor.__dict__.get(name) for name in _WATCHED},
        paddle.to_tensor, paddle.assign, paddle.tensor.creation.to_tensor, paddle.tensor.to_tensor,
    )


class _SyncingLayer(paddle.nn.Layer):
    """A layer whose forward reads a tensor back to the host and uploads a numpy array: two transfers."""

    def __init__(self):
        super().__init__()
        self.linear = paddle.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        scale = y.abs().max().numpy()  # device -> host
        bias = paddle.to_tensor(np.full([4], 0.5, dtype="float32"))  # host -> device
        return y / float(scale) + bias  # float() of a numpy scalar: no transfer


class _PureLayer(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.linear = paddle.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return paddle.concat([y, y * 2.0], axis=-1).softmax(-1) + paddle.tile(y.mean(-1, keepdim=True), [1, 8])


def test_transfer_counter_sees_numpy_and_to_tensor_inside_a_forward_and_says_where():
    before = _originals()
    layer, x = _SyncingLayer(), paddle.to_tensor(np.random.default_rng(0).standard_normal((2, 4)).astype("float32"))
    with TransferCounter() as transfers:
        layer(x)
    assert transfers.counts == {"numpy": 1, "to_tensor": 1}
    sites = [event.where for event in transfers.events]
    assert all(__file__ in site and "in forward" in site for site in sites), sites
    lines = sorted(int(site.split(":")[-1].split(" ")[0]) for site in sites)
    source = open(__file__, encoding="utf-8").read().splitlines()
    assert ".numpy()" in source[lines[0] - 1] and "paddle.to_tensor(np.full" in source[lines[1] - 1]
    assert "2 host<->device transfer(s)" in transfers.report()
    assert _originals() == before


def test_transfer_counter_sees_nothing_for_pure_tensor_ops():
    layer, x = _PureLayer(), paddle.randn([2, 4])
    with TransferCounter() as transfers:
        out = layer(x)
        out = paddle.assign(out)  # assign of a tensor stays on the device
    assert transfers.total == 0, transfers.report()
    assert out.shape == [2, 8]


def test_transfer_counter_counts_each_kind_once_and_restores_after_an_error():
    before = _originals()
    t, i = paddle.to_tensor(3.0), paddle.to_tensor(2)  # 0-d tensors
    with pytest.raises(ZeroDivisionError):
        with TransferCounter() as transfers:
            if t:  # __bool__
                pass
            int(t), float(t), t.item(), t.tolist(), [10, 20, 30, 40][i]  # __int__, __float__, item, tolist, __index__
            np.asarray(t)  # __array__ (which calls numpy inside: counted once)
            paddle.assign(np.ones(2, dtype="float32"))  # host data: counted
            paddle.to_tensor([1, 2])  # a Python list: counted
            paddle.tensor.creation.to_tensor(np.ones(1))  # imported by name elsewhere: counted too
            1 / 0
    assert transfers.counts == {"__bool__": 1, "__int__": 1, "__float__": 1, "item": 1, "tolist": 1, "__index__": 1,
                                "__array__": 1, "assign": 1, "to_tensor": 2}
    assert _originals() == before
    with TransferCounter() as later:  # a fresh counter after a failed window starts from zero
        t.numpy()
    assert later.total == 1


def test_op_counter_grows_by_exactly_the_ops_added():
    rng = np.random.default_rng(2)
    a = paddle.to_tensor(rng.standard_normal((8, 8)).astype("float32"))

    def work(k):
        y = paddle.nn.functional.relu(a)
        for _ in range(k):
            y = paddle.matmul(y, a)
        return y.sum()

    work(3)  # warm-up
    counts = {k: count_ops(lambda k=k: work(k)) for k in (0, 1, 4)}
    assert counts[1].total - counts[0].total == 1 and counts[4].total - counts[0].total == 4
    assert counts[4].by_name.get("matmul") == 4 and counts[0].by_name.get("matmul") is None
    assert counts[0].by_name.get("relu") == 1 and counts[0].by_name.get("sum") == 1
    # the result of the call comes back, equal to numpy float64
    expected = np.maximum(a.numpy().astype(np.float64), 0) @ a.numpy().astype(np.float64)
    assert counts[1].result.numpy() == pytest.approx(expected.sum(), rel=1e-4)


def test_merging_blocks_and_ops_added_per_block_on_a_tiny_unet():
    from ppdiffusers_tome.testing import tiny_unet
    from tests.unet_calls import unet_inputs

    unet = tiny_unet()
    inputs = unet_inputs(unet, batch=2, hw=(16, 16))

    def run():
        with paddle.no_grad():
            return unet(*inputs)

    vanilla = count_forward_ops(run, unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)  # the 1x level of the tiny UNet has 3 blocks
    try:
        tome = count_forward_ops(run, unet)
    finally:
        ppdiffusers_tome.remove_tome(unet)
    ppdiffusers_tome.apply_tome(unet, method="todo")
    try:
        todo = count_forward_ops(run, unet)
    finally:
        ppdiffusers_tome.remove_tome(unet)
    ppdiffusers_tome.apply_tome(unet, merge_attn=False, merge_mlp=True)  # merging only before the feed-forward
    try:
        mlp = count_forward_ops(run, unet, warmup=0)
    finally:
        ppdiffusers_tome.remove_tome(unet)
    assert (vanilla.merging_blocks, tome.merging_blocks, todo.merging_blocks, mlp.merging_blocks) == (0, 3, 3, 3)
    assert tome.total > vanilla.total
    per_block = ops_added_per_block(vanilla.total, tome.total, tome.merging_blocks)
    assert per_block == (tome.total - vanilla.total) / 3
    with pytest.raises(ValueError, match="merging_blocks must be >= 1"):
        ops_added_per_block(vanilla.total, vanilla.total, 0)
    with MergingBlocks(unet) as blocks:  # the hooks come off again
        run()
    assert blocks.count == 0 and all(not layer._forward_pre_hooks for layer in unet.sublayers(include_self=True))


import ppdiffusers_tome  # noqa: E402

"""Measurement helpers (ppdiffusers_tome/measure.py) against direct numpy computations."""

import math

import numpy as np
import paddle
import pytest

from ppdiffusers_tome.measure import ForwardTimer, PeakMemory, median, psnr, relative_l2, set_threads


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

"""The pure parts of ``benchmarks/cache_costs.py``: FLOPs at a larger size from two counts, and the cost of a run of
steps with and without a cache."""

import pytest

from tests.benchmark_scripts import load_benchmark


def test_flops_at_a_larger_side_follow_exactly_from_a_quadratic_and_a_quartic_term():
    costs = load_benchmark("cache_costs")
    counted = {side: 3.0 * side**2 + 0.5 * side**4 for side in (16, 32)}
    assert costs.extrapolate(counted, 128) == pytest.approx(3.0 * 128**2 + 0.5 * 128**4, rel=1e-12)
    assert costs.extrapolate({16: 7.0 * 16**2, 32: 7.0 * 32**2}, 64) == pytest.approx(7.0 * 64**2, rel=1e-12)


def test_steps_cost_one_full_call_and_the_rest_cached_only_with_a_cache():
    costs = load_benchmark("cache_costs")
    assert costs.per_steps(10, 10, None, 3) == 30 and costs.per_steps(10, 2, 3, 3) == 14

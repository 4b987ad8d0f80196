"""The pure parts of ``benchmarks/cache_costs.py``: FLOPs at a larger size from two counts, and the cost of a run of
steps with and without a cache."""

import pytest

from tests.benchmark_scripts import load_benchmark


def test_flops_at_a_larger_side_follow_exactly_from_a_constant_a_quadratic_and_a_quartic_term():
    costs = load_benchmark("cache_costs")
    counted = {side: 5e9 + 3.0 * side**2 + 0.5 * side**4 for side in (8, 16, 32)}
    assert costs.extrapolate(counted, 128) == pytest.approx(5e9 + 3.0 * 128**2 + 0.5 * 128**4, rel=1e-9)
    flat = {side: 2e6 + 7.0 * side**2 for side in (8, 16, 32)}
    assert costs.extrapolate(flat, 64) == pytest.approx(2e6 + 7.0 * 64**2, rel=1e-9)
    with pytest.raises(ValueError, match="three sizes"):
        costs.extrapolate({16: 1.0, 32: 2.0}, 64)


def test_steps_cost_one_full_call_and_the_rest_cached_only_with_a_cache():
    costs = load_benchmark("cache_costs")
    assert costs.per_steps(10, 10, None, 3) == 30 and costs.per_steps(10, 2, 3, 3) == 14

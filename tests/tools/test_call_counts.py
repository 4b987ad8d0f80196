"""Python calls per UNet call in SD-1.5's block layout (``benchmarks/call_counts.py``), held under the bounds written
there: at most 60 calls inside the package when every block is skipped, 250 when the 5 finest blocks merge with the
defaults on CPU kernels, 70 for the step cache at interval 1, and at most 15 more for its adaptive rule, with or
without the forecast, than for the fixed interval (a call the rule caches, and one it runs in full). Counts, not
times: deterministic on any machine."""

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def rows():
    return {row["configuration"]: row for row in load_benchmark("call_counts").measure()}


def test_the_package_stays_within_its_python_call_bounds(rows):
    bounds = load_benchmark("call_counts").BOUNDS
    assert bounds == {"tome, every block skipped": 60, "tome, defaults (5 blocks merge)": 250, "cache, interval 1": 70}
    for name, bound in bounds.items():
        assert 0 < rows[name]["package"] <= bound, (name, rows[name]["package"])


def test_the_adaptive_rule_adds_at_most_15_package_calls_to_the_fixed_intervals_call(rows):
    module = load_benchmark("call_counts")
    assert module.ADAPTIVE_BOUND == 15
    for adaptive, interval in module.ADAPTIVE_PAIRS.items():
        assert 0 <= rows[adaptive]["package"] - rows[interval]["package"] <= module.ADAPTIVE_BOUND, (adaptive, rows)
    # the counted calls are what their names say: step 1, which the rule cached or ran in full
    assert rows["cache, adaptive, cached call"]["cache"]["last_cached_steps"] == [1]
    assert rows["cache, adaptive, full call"]["cache"]["last_full_steps"] == [0, 1]
    assert rows["cache, forecast rule, cached call"]["cache"]["last_cached_steps"] == [3]
    assert rows["cache, forecast rule, full call"]["cache"]["last_full_steps"] == [0, 1, 2]


def test_a_skipped_block_costs_less_than_a_merging_one_and_a_cached_call_less_than_vanilla(rows):
    skipped, merging = rows["tome, every block skipped"], rows["tome, defaults (5 blocks merge)"]
    # (the counters cover two calls: one before the counted one, and the counted one)
    assert skipped["stats"]["UNet2DConditionModel"]["blocks_skipped"] == 2 * 5 and skipped["added"] < merging["added"]
    assert merging["stats"]["UNet2DConditionModel"]["plans_computed"] == 2 * 5
    assert rows["cache, interval 3, cached call"]["added"] < 0  # the deep blocks did not run


def test_the_counter_sees_calls_inside_the_package():
    counts = load_benchmark("call_counts").count_calls(lambda: __import__("ppdiffusers_tome").tome_config(None))
    assert counts["package"] >= 1 and counts["all"] >= counts["package"]

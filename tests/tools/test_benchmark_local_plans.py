"""benchmarks/local_plans.py --render: the Pareto column and the comparison with tomesd's plan in the same seeds,
on a made-up result (the measurement itself is a benchmark, not a test)."""

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("local_plans")


def config(speedup, rel, psnr, plans=5.0):
    mean = sum(rel) / len(rel)
    return {"speedup": speedup, "speedup_range": [speedup - 0.1, speedup + 0.1], "rel_l2": rel, "rel_l2_mean": mean,
            "rel_l2_sd": 0.0, "psnr": [psnr] * len(rel), "psnr_mean": psnr, "psnr_sd": 0.0, "plans_per_call": plans}


def cell():
    return {"preset": "p", "resolution": 512, "seeds": 4, "tokens": 4096,
            "configs": {"vanilla": config(1.0, [0.0] * 4, float("inf"), 0.0),
                        "tome": config(1.5, [0.10, 0.12, 0.08, 0.10], 36.0),
                        "near": config(1.4, [0.105, 0.11, 0.09, 0.10], 35.0),   # slower and worse than tome
                        "far": config(1.6, [0.13, 0.15, 0.12, 0.12], 34.0, 1.0),  # faster, further
                        "todo": config(1.2, [0.03] * 4, 46.0)},
            "gpu_ops": {"tome": {"per_block": 39.4, "per_call": 197}}, "peak_mib": {"global": 26.0, "todo": 0.5}}


def test_pareto_front_keeps_only_configurations_nothing_beats_on_both_axes(bench):
    assert sorted(bench.pareto_names(cell())) == ["far", "todo", "tome", "vanilla"]


def test_distance_next_to_tome_is_paired_by_seed_and_judged_against_tomes_spread(bench):
    near, far = bench.against_tome(cell(), "near"), bench.against_tome(cell(), "far")
    assert near["further_in"] == 2 and near["within_spread"]  # tome's rel L2 spreads by 0.0141 over the seeds
    assert far["further_in"] == 4 and not far["within_spread"]  # 0.03 further on average
    assert far["mean_diff"] == pytest.approx(0.03) and far["relative"] == pytest.approx(0.3)
    assert bench.against_tome(cell(), "todo")["within_spread"]  # much closer to vanilla is never flagged


def test_markdown_table_marks_pareto_and_outside_spread(bench):
    text = bench.markdown_tables({"cells": [cell()]})
    rows = {line.split(" | ")[0].strip("| `"): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["far"].endswith("| yes |") and "+30% (4/4) †" in rows["far"]
    assert rows["near"].endswith("|  |") and "†" not in rows["near"]
    assert "| 39.4 | 197 | 26.0 | yes |" in rows["tome"]

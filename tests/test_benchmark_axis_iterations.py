"""benchmarks/axis_iterations.py: its configurations differ from local16f / local32f only in the squarings of the
second moment, each plan is built with its own, the others with the package's, and its summary pairs seeds with
tomesd's plan (the measurement itself is a benchmark, not a test)."""

import pytest

import ppdiffusers_tome.merge as merge_module
from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("axis_iterations")


def test_variants_are_feature_order_plans_that_name_their_squarings(bench):
    bench.add_variants([2, 4])
    configs = bench.local_plans.CONFIGS
    for k in (2, 4):
        for window in (16, 32):
            options = dict(configs[f"local{window}f_sq{k}"])
            assert options.pop("_squarings") == k
            assert options == configs[f"local{window}f"]


def test_apply_sets_the_squarings_for_the_plan_and_restores_the_package_default(bench, monkeypatch):
    monkeypatch.setattr(merge_module, "_MOMENT_SQUARINGS", merge_module._MOMENT_SQUARINGS)
    default = merge_module._MOMENT_SQUARINGS
    seen = []

    def record(pipe, options):
        seen.append((options, merge_module._MOMENT_SQUARINGS))

    config = {"match_window": 16, "match_order": "feature", "_squarings": default - 1}
    bench.apply("pipe", config, _apply=record)
    bench.apply("pipe", {"match_window": 16, "match_order": "feature"}, _apply=record)
    bench.apply("pipe", None, _apply=record)
    assert seen == [({"match_window": 16, "match_order": "feature"}, default - 1),
                    ({"match_window": 16, "match_order": "feature"}, default), (None, default)]
    assert config["_squarings"] == default - 1  # the registered configuration is not consumed


def test_squarings_out_of_range_are_refused_before_anything_runs(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--squarings", "3", "5"])
    assert "--squarings" in capsys.readouterr().err


def test_summary_pairs_each_variant_with_tome_seed_by_seed(bench):
    def config(rel):
        return {"rel_l2": rel}

    cell = {"preset": "p", "resolution": 768, "seeds": 4,
            "configs": {"vanilla": config([0.0] * 4), "tome": config([0.10, 0.12, 0.08, 0.10]),
                        "local16f_sq3": config([0.13, 0.15, 0.11, 0.13]),
                        "local16f_sq4": config([0.102, 0.12, 0.081, 0.099])}}
    lines = bench.summary({"cells": [cell]}).splitlines()
    assert lines[0].startswith("p at 768px, 4 seeds") and "0.01414" in lines[0]
    assert "local16f_sq3: +30.0%" in lines[1] and "further in 4/4" in lines[1] and "outside" in lines[1]
    assert "local16f_sq4: +0.5%" in lines[2] and "further in 2/4" in lines[2] and "within" in lines[2]

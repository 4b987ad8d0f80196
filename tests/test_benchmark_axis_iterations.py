"""benchmarks/axis_iterations.py: its configurations differ from local16f / local32f only in the squarings of the
second moment, each UNet planner gets its own, the others the package's, and its summary pairs seeds with
tomesd's plan (the measurement itself is a benchmark, not a test)."""

import pytest

from ppdiffusers_tome.ops.feature_order import DEFAULT_SQUARINGS
from ppdiffusers_tome.testing import tiny_unet
from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("axis_iterations")


def test_variants_are_feature_order_plans_that_name_their_squarings(bench):
    found = bench.variants([2, 4])
    configs = bench.local_plans.CONFIGS
    assert sorted(found) == ["local16f_sq2", "local16f_sq4", "local32f_sq2", "local32f_sq4"]
    for k in (2, 4):
        for window in (16, 32):
            options = dict(found[f"local{window}f_sq{k}"])
            assert options.pop("_squarings") == k
            assert options == configs[f"local{window}f"]
    assert not any(name.endswith("_sq2") for name in configs)  # the package's registry is left as it was


class Pipe:
    def __init__(self):
        self.unet = tiny_unet()


def test_apply_sets_the_squarings_on_the_unets_planner_only(bench):
    from ppdiffusers_tome.patch import get_patch

    pipe = Pipe()
    config = {"match_window": 8, "match_order": "feature", "_squarings": DEFAULT_SQUARINGS - 1}
    bench.local_plans.apply(pipe, config)
    assert get_patch(pipe.unet).planner.squarings == DEFAULT_SQUARINGS - 1
    assert get_patch(pipe.unet).config.match_window == 8  # the other options reach apply_tome
    bench.local_plans.apply(pipe, {"match_window": 8, "match_order": "feature"})
    assert get_patch(pipe.unet).planner.squarings == DEFAULT_SQUARINGS  # the package's own for the others
    bench.local_plans.apply(pipe, None)
    assert get_patch(pipe.unet) is None
    assert config["_squarings"] == DEFAULT_SQUARINGS - 1  # the registered configuration is not consumed


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

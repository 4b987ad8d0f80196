"""benchmarks/adaptive_cache.py: its configurations, its SSIM against an independent one built on scipy's Gaussian
filter, its feature distance and summaries against hand computations, and a very short run on a tiny SD3 layout that
writes a consistent record, a plot, and the same table again with ``--render``."""

import json

import numpy as np
import pytest
from scipy import ndimage

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("adaptive_cache")


def test_the_configurations_are_the_baselines_the_caches_and_each_again_with_merging(bench):
    configs = bench.configurations(50, thresholds=(0.1, 0.2), merge="tome")
    plain = ["vanilla", "fewer steps 1/2", "fewer steps 1/3", "fewer steps 1/4", "interval 2", "interval 3", "interval 4",
             "adaptive 0.1", "adaptive 0.1 + forecast", "adaptive 0.2", "adaptive 0.2 + forecast",
             "whole-model 0.1", "whole-model 0.2", "whole-model 0.1 + forecast", "whole-model 0.2 + forecast",
             "whole-model interval 2", "whole-model interval 3", "whole-model interval 4",
             "whole-model interval 2 + forecast", "whole-model interval 3 + forecast", "whole-model interval 4 + forecast"]
    assert list(configs) == plain + ["ToMe 0.5"] + [f"{name} + ToMe 0.5" for name in plain[1:]]
    assert [configs[name].steps for name in plain[:4]] == [50, 25, 16, 12]
    assert configs["adaptive 0.2 + forecast"].cache == dict(threshold=0.2, forecast="linear")
    assert configs["whole-model 0.1 + ToMe 0.5"].cache == dict(whole_model=True, threshold=0.1)
    assert configs["whole-model 0.2 + forecast"].cache == dict(whole_model=True, threshold=0.2, forecast="linear")
    assert configs["whole-model interval 3 + forecast"].cache == dict(whole_model=True, interval=3, forecast="linear")
    assert configs["whole-model interval 4 + ToMe 0.5"].family == "whole-model interval + ToMe 0.5"
    assert configs["interval 3 + ToMe 0.5"].merge == dict(ratio=0.5) and configs["interval 3"].merge is None
    assert configs["adaptive 0.1 + forecast + ToMe 0.5"].family == "adaptive + forecast + ToMe 0.5"


def test_planned_full_steps_follow_the_rule_with_the_first_and_the_last_step_full(bench):
    changes = [0.05, 0.05, 0.3, 0.01, 0.02, 0.2, 0.05, 0.05]  # from step t - 1 to step t, t = 1..8
    # by hand at 0.12: sums 0.05, 0.10, 0.40 (full at 3); 0.01, 0.03, 0.23 (full at 6); 0.05, then the last step 8
    assert bench.planned_full_steps(changes, 0.12) == [0, 3, 6, 8]
    assert bench.planned_full_steps(changes, 0.12, max_skips=1) == [0, 2, 3, 5, 6, 8]
    assert bench.planned_full_steps(changes, 0.0) == list(range(9))


def scipy_ssim(x, y, data_range=1.0):
    """SSIM per channel from scipy.ndimage's Gaussian filter (sigma 1.5, truncated at 3.5 sigma, reflected
    borders), the mean of the map without its 5-pixel border, averaged over channels."""
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    out = []
    for k in range(x.shape[-1]):
        a, b = x[..., k], y[..., k]
        blur = lambda image: ndimage.gaussian_filter(image, 1.5, mode="reflect", truncate=3.5)  # noqa: E731
        ma, mb = blur(a), blur(b)
        va, vb, cov = blur(a * a) - ma ** 2, blur(b * b) - mb ** 2, blur(a * b) - ma * mb
        index = (2 * ma * mb + c1) * (2 * cov + c2) / ((ma ** 2 + mb ** 2 + c1) * (va + vb + c2))
        out.append(index[5:-5, 5:-5].mean())
    return float(np.mean(out))


def test_ssim_equals_a_reference_built_on_scipys_gaussian_filter(bench):
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(24, 20, 3))
    for noise in (0.02, 0.2):
        y = np.clip(x + noise * rng.standard_normal(x.shape), 0, 1)
        assert bench.ssim(x, y) == pytest.approx(scipy_ssim(x, y), abs=1e-9)
    assert bench.ssim(x, x) == 1.0 and bench.ssim(x, np.clip(x + 0.2, 0, 1)) < 1.0
    with pytest.raises(ValueError, match="more than 10 pixels per side"):
        bench.ssim(x[:10], x[:10])


def test_the_feature_distance_and_the_summary_follow_from_their_inputs(bench):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 8)), rng.standard_normal((4, 8))
    by_hand = np.mean([1 - a[i] @ b[i] / np.sqrt((a[i] @ a[i]) * (b[i] @ b[i])) for i in range(4)])
    assert bench.feature_distance(a, b) == pytest.approx(by_hand, rel=1e-9)
    assert bench.feature_distance(a, a) == pytest.approx(0.0, abs=1e-12)
    rows = {"vanilla": [dict(seconds=4.0, speedup=1.0, steps=9, full_steps=9)] * 2,
            "x": [dict(seconds=2.0, speedup=2.0, steps=9, full_steps=3, psnr_db=30.0),
                  dict(seconds=1.0, speedup=4.0, steps=9, full_steps=4, psnr_db=34.0)]}
    summary = bench.summarise(rows)
    assert (summary["x"]["speedup_median"], summary["x"]["speedup_min"], summary["x"]["full_steps"]) == (3.0, 2.0, 3.5)
    assert summary["x"]["psnr_db"] == {"mean": 32.0, "sd": pytest.approx(np.std([30.0, 34.0], ddof=1))}
    assert bench.curves(summary, {"vanilla": "vanilla", "x": "adaptive"}) == {"adaptive": [(3.0, 32.0)]}


def test_a_short_run_on_a_tiny_sd3_layout_writes_a_consistent_record_and_its_plot(bench, tmp_path, capsys):
    args = ["--model", "sd3", "--width", "64", "--layers", "3", "--size", "96", "--steps", "4", "--seeds", "1",
            "--thresholds", "5", "--threads", "1", "--output", str(tmp_path), "--full-steps", "0", "3", "--configs",
            "interval 2", "adaptive 5", "whole-model full steps + forecast"]
    assert bench.main(args) == 0
    data = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert list(data["summary"]) == ["vanilla", "interval 2", "adaptive 5", "whole-model full steps + forecast"]
    assert data["settings"]["full_steps"] == [0, 3] and data["per_seed"]["whole-model full steps + forecast"][0][
        "full_steps"] == 2  # the replayed schedule: steps 0 and 3 of 4
    vanilla, interval = data["per_seed"]["vanilla"][0], data["per_seed"]["interval 2"][0]
    assert interval["speedup"] == pytest.approx(vanilla["seconds"] / interval["seconds"])
    adaptive = data["per_seed"]["adaptive 5"][0]
    # interval 2: steps 0 and 2 of 4; a huge threshold: the first and the last step
    assert (vanilla["full_steps"], interval["full_steps"], adaptive["full_steps"]) == (4, 2, 2)
    assert 0 < interval["ssim"] < 1 and np.isfinite(interval["psnr_db"]) and interval["distance"] > 0
    assert (tmp_path / "quality_speed.png").stat().st_size > 1000
    table = lambda out: [line for line in out.splitlines() if "|" in line]  # noqa: E731
    written = table(capsys.readouterr().out)
    assert bench.main(["--render", str(tmp_path / "results.json")]) == 0
    assert table(capsys.readouterr().out) == written and len(written) == 5  # header, four rows


def test_combined_runs_take_the_median_and_range_of_the_runs_speed_ups_and_refuse_other_settings(bench, tmp_path,
                                                                                              capsys):
    def run(speeds, psnr=30.0, settings=None):
        summary = {"vanilla": dict(steps=9, full_steps=9.0, speedup_median=1.0, speedup_min=1.0, speedup_max=1.0),
                   "x": dict(steps=9, full_steps=3.0, speedup_median=speeds, speedup_min=speeds - 0.5,
                             speedup_max=speeds + 0.5, psnr_db=dict(mean=psnr, sd=0.5), distance=dict(mean=0.1, sd=0))}
        settings = settings or {"model": "sd3", "steps": 9, "scheduler": "flow-match euler", "seeds": 1}
        families = {"vanilla": "vanilla", "x": "adaptive"}
        return {"version": "v", "settings": settings, "families": families, "summary": summary}

    runs = [run(2.0), run(3.5), run(2.5)]
    combined = bench.combine(runs, "cmd")
    x = combined["summary"]["x"]
    assert (x["speedup_median"], x["speedup_min"], x["speedup_max"]) == (2.5, 2.0, 3.5)
    assert x["psnr_db"] == runs[0]["summary"]["x"]["psnr_db"] and combined["images_identical"]
    assert combined["runs"] == runs and combined["over"] == "runs"
    assert not bench.combine([run(2.0), run(2.0, psnr=31.0)], "cmd")["images_identical"]
    with pytest.raises(SystemExit, match="differ in settings"):
        bench.combine([run(2.0), run(2.0, settings={"model": "shapes"})], "cmd")
    paths = []
    for k, data in enumerate(runs):
        paths.append(tmp_path / f"run{k}.json")
        paths[-1].write_text(json.dumps(data), encoding="utf-8")
    assert bench.main(["--combine", *map(str, paths), "--output", str(tmp_path / "all")]) == 0
    assert json.loads((tmp_path / "all" / "results.json").read_text(encoding="utf-8"))["summary"]["x"] == x
    assert "median and range over runs" in capsys.readouterr().out

"""benchmarks/shapes_fidelity.py: a very short run on the shipped model writes a complete record whose numbers
agree with an independent recomputation, and ``--render`` prints the same table from the JSON."""

import json

import numpy as np
import pytest

from tests.benchmark_scripts import load_benchmark

CONFIGS = ["ToMe 0.5", "ToDo", "built-in 0.5", "ToMe 0.5 + cache 3"]  # merging, pooling, the peer, the step cache


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("shapes_fidelity")


@pytest.fixture(scope="module")
def short_run(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    # two seeds (a spread), two captions in one pipeline call per configuration and seed, two steps (the cached
    # configuration reuses step 0 in step 1); one configuration of each kind
    args = ["--seeds", "2", "--prompts", "2", "--reference", "6", "--steps", "2", "--batch", "2", "--grid", "2",
            "--threads", "1", "--output", str(out), "--configs", *CONFIGS]
    assert bench.main(args) == 0
    with open(out / "results.json", encoding="utf-8") as f:
        return out, json.load(f)


def test_mean_sd_ignores_infinities_and_has_zero_spread_for_one_value(bench):
    assert bench.mean_sd([1.0, 3.0]) == {"mean": 2.0, "sd": pytest.approx(np.std([1.0, 3.0], ddof=1))}
    assert bench.mean_sd([5.0]) == {"mean": 5.0, "sd": 0.0}
    assert bench.mean_sd([float("inf")])["mean"] == float("inf")


def test_short_run_records_every_configuration_and_seed(short_run, bench):
    out, data = short_run
    assert list(data["summary"]) == ["vanilla", *CONFIGS] and set(CONFIGS) < set(bench.CONFIGS)
    for name, runs in data["per_seed"].items():
        assert len(runs) == 2
        for run in runs:
            assert set(run["accuracy"]) == {"shape", "colour", "position", "background"}
            assert 0.0 <= run["accuracy_mean"] <= 1.0 and run["feature_distance"] >= 0.0
            assert ("psnr_db" in run) == (name != "vanilla")  # vanilla's own PSNR is infinite: not written
    assert len(data["prompts"]) == 2 and data["settings"]["steps"] == 2
    assert (out / "grid.png").is_file() and (out / "table.md").is_file()
    # the merging configurations differ from vanilla, and the summary is the mean of the seeds
    assert all(run["psnr_db"] < 100 for run in data["per_seed"]["ToMe 0.5"])
    tome = data["summary"]["ToMe 0.5"]
    assert tome["accuracy_mean"]["mean"] == pytest.approx(
        np.mean([run["accuracy_mean"] for run in data["per_seed"]["ToMe 0.5"]]))


def test_real_images_row_scores_the_prompts_own_images(short_run):
    from research.shapes import scoring
    from research.shapes.classifier import accuracy

    _, data = short_run
    prompts, labels, images = scoring.held_out_prompts(2)
    assert data["prompts"] == prompts
    expected = accuracy(scoring.load_trained_classifier(), images, scoring.label_targets(labels))
    assert data["real"]["accuracy"] == pytest.approx(expected)


def test_render_prints_the_same_table(short_run, bench, capsys):
    out, data = short_run
    assert bench.main(["--render", str(out / "results.json")]) == 0
    printed = capsys.readouterr().out
    with open(out / "table.md", encoding="utf-8") as f:
        assert f.read().strip() in printed
    assert "| vanilla |" in printed and "| real images |" in printed and "inf" in printed

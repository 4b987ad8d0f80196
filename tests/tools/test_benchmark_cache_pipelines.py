"""benchmarks/cache_pipelines.py: a very short run writes every configuration and seed, its summary follows from
the per-seed numbers, the cached configurations really differ from vanilla, and ``--render`` prints the same table."""

import json

import numpy as np
import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("cache_pipelines")


@pytest.fixture(scope="module")
def short_run(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache_pipelines")
    args = ["--preset", "sd15-narrow", "--resolution", "64", "--steps", "4", "--seeds", "2", "--threads", "1",
            "--configs", "cache 2", "ToMe 0.5 + cache 3", "--output", str(out)]
    assert bench.main(args) == 0
    with open(out / "results.json", encoding="utf-8") as f:
        return out, json.load(f)


def test_rel_l2_is_the_norm_of_the_difference_over_the_norm_of_the_reference(bench):
    rng = np.random.default_rng(0)
    a, b = rng.uniform(size=(1, 8, 8, 3)), rng.uniform(size=(1, 8, 8, 3))
    expected = np.sqrt(sum((x - y) ** 2 for x, y in zip(b.ravel(), a.ravel())) / sum(x ** 2 for x in a.ravel()))
    assert bench.rel_l2(a, b) == pytest.approx(expected, rel=1e-12)
    assert bench.rel_l2(a, a) == 0.0


def test_short_run_records_every_configuration_and_seed_and_summarises_them(short_run):
    out, data = short_run
    assert list(data["summary"]) == ["vanilla", "cache 2", "ToMe 0.5 + cache 3"]
    vanilla = data["per_seed"]["vanilla"]
    for name, rows in data["per_seed"].items():
        assert len(rows) == 2
        for row, base in zip(rows, vanilla):
            assert row["speedup"] == pytest.approx(base["seconds"] / row["seconds"])
            if name != "vanilla":  # 4 steps with a full step every 2 or 3: the cached steps change the image
                assert 0.0 < row["rel_l2"] < 1.0 and np.isfinite(row["psnr_db"])
        summary = data["summary"][name]
        speedups = [row["speedup"] for row in rows]
        assert summary["speedup_min"] == min(speedups) and summary["speedup_max"] == max(speedups)
        assert summary["seconds_median"] == pytest.approx(np.median([row["seconds"] for row in rows]))
        if name != "vanilla":
            assert summary["rel_l2"]["mean"] == pytest.approx(np.mean([row["rel_l2"] for row in rows]))
    assert data["settings"]["steps"] == 4 and (out / "table.md").is_file()


def test_render_prints_the_table_of_the_json(short_run, bench, capsys):
    out, _ = short_run
    written = (out / "table.md").read_text(encoding="utf-8")
    capsys.readouterr()
    assert bench.main(["--render", str(out / "results.json")]) == 0
    printed = capsys.readouterr().out
    assert all(line.split("|")[1].strip() in printed for line in written.splitlines()[2:])

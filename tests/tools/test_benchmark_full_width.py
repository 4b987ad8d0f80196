"""benchmarks/full_width.py: the full-width CPU measurement (one SD3-medium joint block, SDXL's whole UNet), run here
on tiny stand-ins (a joint block of width 64, the tiny SDXL-style UNet), and the FLOP ceilings at full width that the
docs put beside every figure of a narrow layout."""

import json

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def full_width():
    return load_benchmark("full_width")


def test_a_cached_loop_runs_a_full_call_every_interval_steps_from_step_0(full_width):
    assert full_width.loop_flops(10, 1, 20, 3) == 7 * 10 + 13 * 1  # full at 0, 3, ..., 18
    assert full_width.loop_flops(10, 1, 6, 3) == 2 * 10 + 4 * 1 and full_width.loop_flops(10, 1, 20, None) == 200


def test_the_ceilings_at_full_width_are_those_the_docs_quote(full_width):
    rows = {(row["model"].split(" (")[0], row["size"], row["setting"]): round(row["flop_ceiling"], 2)
            for row in full_width.ceilings()}
    assert rows["SDXL", 1024, "ToMe 0.5, one UNet forward"] == 1.06
    assert rows["SD-1.5", 256, "ToMe 0.5, one UNet forward"] == 1.04
    assert rows["SD-1.5", 256, "ToMe 0.5 + cache 3, 20-step loop"] == 2.68
    assert rows["SD-1.5", 512, "ToMe 0.5 + cache 3, 20-step loop"] == 2.87
    assert rows["SD3-medium", 1024, "ToMe 0.5, attention, one forward"] == 1.50
    assert rows["SD3-medium", 1024, "ToMe 0.5, attention + MLP, one forward"] == 2.19
    assert rows["SD3-medium", 512, "cache 3, 20-step loop"] == 2.47  # 480 block calls against 7 x 24 + 13 x 2
    assert rows["SD3-medium", 512, "ToMe 0.5, attention + MLP, + cache 3, 20-step loop"] == 4.18


def test_the_sd3_block_part_times_every_configuration_and_writes_json(full_width, tmp_path):
    output = tmp_path / "block.json"
    full_width.main(["--part", "sd3-block", "--width", "64", "--resolution", "128", "--rounds", "1", "--warmup", "0",
                     "--threads", "1", "--output", str(output)])
    written = json.loads(output.read_text())
    assert (written["image_tokens"], written["text_tokens"], written["heads"]) == (64, 333, 1)
    rows = {row["configuration"]: row for row in written["rows"]}
    assert list(rows) == list(full_width.SD3_CONFIGS)
    assert rows["vanilla"]["rel_l2"] == 0 and rows["vanilla"]["flop_ceiling"] == 1.0
    for name in ("ToMe 0.5, attention", "ToMe 0.5, attention + MLP", "ToDo, factor 2"):
        assert rows[name]["rel_l2"] > 0 and rows[name]["flop_ceiling"] > 1 and rows[name]["seconds"] > 0  # it merged
    assert rows["ToMe 0.5, attention + MLP"]["flop_ceiling"] > rows["ToMe 0.5, attention"]["flop_ceiling"]
    assert all(row["peak_kind"] == "cpu_peak_rss" and len(row["seconds_per_round"]) == 1 for row in rows.values())


def test_the_unet_part_counts_each_configurations_flops_in_its_first_call(full_width, tmp_path):
    output = tmp_path / "unet.json"
    full_width.main(["--part", "sdxl-unet", "--preset", "tiny-sdxl", "--resolution", "64", "--rounds", "1",
                     "--warmup", "0", "--threads", "1", "--output", str(output)])
    rows = {row["configuration"]: row for row in json.loads(output.read_text())["rows"]}
    assert list(rows) == list(full_width.SDXL_CONFIGS)
    assert rows["ToMe 0.5"]["flops"] < rows["vanilla"]["flops"]  # fewer tokens counted where ToMe merged
    for name in ("ToMe 0.5", "ToDo, factor 2"):
        assert rows[name]["flop_ceiling"] == rows["vanilla"]["flops"] / rows[name]["flops"] > 1
        assert rows[name]["rel_l2"] > 0


@pytest.mark.parametrize("option, value", [("--resolution", "72"), ("--width", "100"), ("--rounds", "0")])
def test_sizes_and_rounds_it_cannot_run_are_refused_by_name(full_width, option, value, capsys):
    with pytest.raises(SystemExit) as done:
        full_width.main(["--part", "sd3-block", option, value])
    assert done.value.code == 2 and option in capsys.readouterr().err

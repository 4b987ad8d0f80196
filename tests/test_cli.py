"""The command line (ppdiffusers_tome/cli.py): the demo end to end on the tiny preset and on a local folder."""

import json

import numpy as np
import pytest
from PIL import Image

from ppdiffusers_tome.cli import main
from ppdiffusers_tome.presets import available_presets, load_preset, preset_pipeline

TINY = ["--preset", "tiny", "--resolution", "32", "--steps", "2", "--threads", "1"]


def read_record(folder):
    with open(folder / "results.json", encoding="utf-8") as f:
        return json.load(f)


def test_demo_writes_table_png_and_json(tmp_path, capsys):
    assert main(["demo", *TINY, "--ratios", "0.3", "0.5", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "vanilla" in out and out.count("tome") >= 2 and "speed-up" in out
    record = read_record(tmp_path)
    rows = record["results"]
    assert [(r["method"], r["ratio"]) for r in rows] == [("vanilla", 0.0), ("tome", 0.3), ("tome", 0.5)]
    assert rows[0]["speedup"] == 1.0 and rows[0]["max_abs_diff"] == 0.0 and rows[0]["psnr_db"] == "inf"
    for row in rows[1:]:
        assert row["seconds_per_image"] > 0 and row["unet_seconds"] > 0 and row["peak_memory_bytes"] > 0
        assert 0 < row["max_abs_diff"] < 1 and np.isfinite(row["psnr_db"])
    env = record["environment"]
    assert env["threads"] == 1 and env["dtype"] == "float32" and env["paddle"]
    with Image.open(tmp_path / "demo.png") as png:
        png.verify()
    with Image.open(tmp_path / "demo.png") as png:
        assert png.size == (4 * 32, 32 + 14)  # vanilla, two ratios, difference; a label strip on top


def test_demo_json_is_strict_json(tmp_path):
    assert main(["demo", *TINY, "--ratios", "0.5", "--repeats", "1", "--output", str(tmp_path)]) == 0
    text = (tmp_path / "results.json").read_text(encoding="utf-8")

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    record = json.loads(text, parse_constant=refuse)
    assert record["results"][0]["psnr_db"] == "inf"


def test_demo_runs_a_controlnet_preset(tmp_path):
    args = ["demo", "--preset", "tiny-controlnet", "--resolution", "32", "--steps", "1", "--ratios", "0.5"]
    assert main([*args, "--repeats", "1", "--threads", "1", "--output", str(tmp_path)]) == 0
    assert len(read_record(tmp_path)["results"]) == 2


def test_demo_loads_a_local_pipeline_folder(tmp_path):
    pipe = preset_pipeline("tiny")
    pipe.save_pretrained(str(tmp_path / "model"))
    args = ["demo", "--model", str(tmp_path / "model"), "--resolution", "32", "--steps", "1", "--ratios", "0.5"]
    assert main([*args, "--threads", "1", "--output", str(tmp_path / "out")]) == 0
    record = read_record(tmp_path / "out")
    assert record["source"].endswith("model") and len(record["results"]) == 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ratios", "0.9"], "ratio must be in"),
        (["--max-downsample", "3"], "max_downsample must be 'auto' or one of"),
        (["--model", "/nonexistent/folder"], "--model must be a local pipeline folder"),
        (["--dtype", "float16"], "needs a GPU"),
    ],
)
def test_demo_bad_input_is_a_clear_error(tmp_path, capsys, args, message):
    base = ["demo", "--resolution", "32", "--steps", "1", "--output", str(tmp_path)]
    if "--model" not in args:
        base += ["--preset", "tiny"]
    assert main([*base, *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_resolution_must_be_a_multiple_of_8(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--resolution", "30"])
    assert "multiple of 8" in capsys.readouterr().err


def test_presets_are_listed_and_validated():
    assert {"tiny", "sd15-narrow", "sd15"} <= set(available_presets())
    assert load_preset("sd15")["unet"]["block_out_channels"] == [320, 640, 1280, 1280]
    with pytest.raises(ValueError, match="preset must be one of"):
        load_preset("sd99")


def test_figure_draws_a_real_plan(tmp_path, capsys):
    path = tmp_path / "plan.png"
    assert main(["figure", "--ratio", "0.5", "--grid", "12", "--output", str(path)]) == 0
    assert "12x12 tokens, 36 dst, 72 merged at ratio 0.5" in capsys.readouterr().out
    with Image.open(path) as image:
        assert image.size[0] > image.size[1] > 12 * 14
        pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20  # tokens, group colours and outlines were drawn


def test_figure_reports_the_plan():
    from ppdiffusers_tome.figure import draw_plan_figure

    _, info = draw_plan_figure(ratio=0.5, grid=12, cell=2)
    assert info == {"tokens": 144, "dst": 36, "merged": 72, "grid": 12, "ratio": 0.5}
    _, none = draw_plan_figure(ratio=0.0, grid=12, cell=2)
    assert none["merged"] == 0

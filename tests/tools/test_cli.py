"""The command line (ppdiffusers_tome/cli.py): the demo end to end on the tiny preset and on a local folder."""

import argparse
import json
import os
import re

import numpy as np
import pytest
from PIL import Image

from ppdiffusers_tome.presets import available_presets, default_resolution, load_preset, preset_pipeline
from ppdiffusers_tome.tools.cli import main
from ppdiffusers_tome.tools.images import MIN_TILE, row_layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# subprocesses import this checkout's package, whatever the environment's editable install points at
REPO_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])]))
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
    assert [(r["method"], r["ratio"], r["cache"]) for r in rows] == [
        ("vanilla", 0.0, None), ("tome", 0.3, None), ("tome", 0.5, None), ("tome", 0.5, 3)]  # + the step cache row
    assert rows[0]["speedup"] == 1.0 and rows[0]["max_abs_diff"] == 0.0 and rows[0]["psnr_db"] == "inf"
    for row in rows[1:]:
        assert row["seconds_per_image"] > 0 and row["unet_seconds"] > 0 and row["peak_memory_bytes"] > 0
        assert 0 < row["max_abs_diff"] < 1 and np.isfinite(row["psnr_db"])
    env = record["environment"]
    assert env["threads"] == 1 and env["dtype"] == "float32" and env["paddle"]
    with Image.open(tmp_path / "demo.png") as png:
        png.verify()
    with Image.open(tmp_path / "demo.png") as png:
        # vanilla, two ratios, the cache row, difference, each enlarged to a readable tile under a label row of its
        # own, and a scale bar under the difference (a preset's images need no caption)
        labels = ["vanilla", "ToMe 0.30", "ToMe 0.50", "ToMe 0.50 + cache 3", "|diff| x4 (ToMe 0.50 + cache 3)"]
        layout = row_layout([(32, 32)] * 5, labels)
        assert png.size[0] == layout.size[0] and layout.size[1] < png.size[1] < layout.size[1] + 40
        assert min(layout.tile) >= MIN_TILE


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
    assert len(read_record(tmp_path)["results"]) == 3  # vanilla, ToMe, ToMe + cache


def test_demo_loads_a_local_pipeline_folder(tmp_path):
    pipe = preset_pipeline("tiny")
    pipe.save_pretrained(str(tmp_path / "model"))
    args = ["demo", "--model", str(tmp_path / "model"), "--resolution", "32", "--steps", "1", "--ratios", "0.5"]
    assert main([*args, "--threads", "1", "--cache", "0", "--output", str(tmp_path / "out")]) == 0
    record = read_record(tmp_path / "out")
    assert record["source"].endswith("model") and len(record["results"]) == 2  # --cache 0: no step cache row


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-downsample", "3"], "max_downsample must be 'auto' or one of"),
        (["--model", "/nonexistent/folder"], "--model must be a local pipeline folder"),
        (["--dtype", "float16"], "needs a GPU"),
        (["--dtype", "bfloat16"], 'install paddlepaddle-gpu as in README.md "Install into your own environment"'),
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


# --help, --version and option names ---------------------------------------------------------------------------
def test_version(capsys):
    import ppdiffusers_tome

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"ppdiffusers-tome {ppdiffusers_tome.__version__}"


def test_demo_help_lists_presets_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for name in available_presets():
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert f"{default_resolution(name)} px" in line
    flat = " ".join(out.split())  # (argparse wraps the help lines)
    assert "default: 20 for the shapes model, 8 for a preset" in flat and "(default: 0.3 0.5)" in flat
    assert "the shipped shapes model runs" in flat and "(default)" not in out  # no preset is the demo's default
    assert "shapes" in out.split("presets (random weights")[0]  # the trained model is listed first
    assert "--arch" in out and "(default: None)" not in out


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_preset_and_arch_name_the_same_option(command):
    from ppdiffusers_tome.tools.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([command, "--preset", "tiny"]).preset == "tiny"
    assert parser.parse_args([command, "--arch", "tiny-sdxl"]).preset == "tiny-sdxl"
    assert parser.parse_args([command]).preset == ("sd15-narrow" if command == "bench" else None)


def test_prompt_defaults_repeated_in_the_parser_equal_the_ones_used():
    from ppdiffusers_tome.tools.bench.methods import BenchSettings
    from ppdiffusers_tome.tools.cli import DEFAULT_PROMPT, SHAPES_PROMPT
    from ppdiffusers_tome.tools.shapes import DEMO_PROMPT

    assert SHAPES_PROMPT == DEMO_PROMPT and DEFAULT_PROMPT == BenchSettings.prompt


def test_demo_without_a_source_runs_the_shipped_shapes_model_with_its_own_defaults():
    from ppdiffusers_tome.tools import shapes as shipped
    from ppdiffusers_tome.tools.bench.commands import resolve_model
    from ppdiffusers_tome.tools.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["demo"])
    assert resolve_model(args) == "shapes"
    assert args.model == shipped.pipeline_folder() and args.preset is None
    assert (args.prompt, args.steps, args.guidance_scale) == (shipped.DEMO_PROMPT, shipped.DEMO_STEPS,
                                                              shipped.DEMO_GUIDANCE)
    # what the user gives wins
    args = parser.parse_args(["demo", "--prompt", "a small blue circle at the center on a white background",
                              "--steps", "3", "--guidance-scale", "2"])
    resolve_model(args)
    assert (args.prompt, args.steps, args.guidance_scale) == (
        "a small blue circle at the center on a white background", 3, 2.0)
    # a preset keeps the full-size defaults: its pipeline's guidance, 8 steps, the SD-style prompt
    args = parser.parse_args(["demo", "--preset", "tiny"])
    assert resolve_model(args) == ""
    assert args.model is None and args.steps == 8 and args.guidance_scale is None and "lighthouse" in args.prompt


def test_model_shapes_names_the_shipped_folder_in_bench_too(tmp_path, monkeypatch):
    from ppdiffusers_tome.tools import shapes as shipped
    from ppdiffusers_tome.tools.bench.commands import model_layout, resolve_model
    from ppdiffusers_tome.tools.cli import build_parser

    args = build_parser().parse_args(["bench", "--model", "shapes"])
    assert resolve_model(args) == "shapes" and args.model == shipped.pipeline_folder()
    assert model_layout(args)[1] == 64  # 32x32 latents through the 2x VAE
    args = build_parser().parse_args(["bench", "--model", "shapes-sd3"])
    assert resolve_model(args) == "shapes-sd3" and args.model == shipped.sd3_pipeline_folder()
    assert model_layout(args)[1] == 64  # the transformer's 32x32 latents through the same 2x VAE
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shapes").mkdir()  # a user's own folder called "shapes" is taken as that folder
    args = build_parser().parse_args(["bench", "--model", "shapes"])
    assert resolve_model(args) == "" and args.model == "shapes"


def test_missing_shipped_weights_are_a_clear_error(monkeypatch, capsys, tmp_path):
    from ppdiffusers_tome.tools import shapes as shipped

    monkeypatch.setattr(shipped, "MODEL_DIR", str(tmp_path / "nothing"))
    assert main(["demo", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "weights are missing" in err and "--preset" in err


def test_default_demo_shows_the_prompt_and_no_noise_warning(tmp_path, capsys):
    assert main(["demo", "--steps", "2", "--ratios", "0.5", "--repeats", "1", "--threads", "1",
                 "--output", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    from ppdiffusers_tome.tools.shapes import DEMO_PROMPT

    assert "ToMe demo: shapes model (trained, shipped in the package), 64x64, 2 steps" in out
    assert f"prompt: {DEMO_PROMPT!r}" in out and "The images are noise" not in out and "merging saves little" in out
    record = read_record(tmp_path)
    assert record["settings"]["prompt"] == DEMO_PROMPT and record["settings"]["guidance_scale"] == 4.0
    assert (tmp_path / "demo.png").is_file()


def test_demo_of_the_sd3_shapes_model_compares_tome_todo_and_the_cache(tmp_path, capsys):
    from ppdiffusers_tome.tools import shapes as shipped

    assert main(["demo", "--model", "shapes-sd3", "--steps", "2", "--ratios", "0.5", "--repeats", "1",
                 "--threads", "1", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ToMe demo: SD3 shapes model (trained, shipped in the package), 64x64, 2 steps" in out
    assert "its finest attention holds 256 tokens" in out  # 16 x 16 patches of 2 x 2 latents
    record = read_record(tmp_path)
    assert [(row["method"], row["cache"]) for row in record["results"]] == [
        ("vanilla", None), ("tome", None), ("todo", None), ("cache", 3), ("tome", 3)]
    assert record["settings"]["guidance_scale"] == shipped.SD3_DEMO_GUIDANCE
    assert all(row["psnr_db"] != "inf" for row in record["results"][1:])  # each one changed the image


def test_unknown_preset_is_refused_with_the_list(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--preset", "sd99"])
    err = capsys.readouterr().err
    assert "invalid choice: 'sd99'" in err and "tiny-controlnet" in err


def test_bench_methods_listed_without_importing_bench_match_bench():
    from ppdiffusers_tome.tools import bench
    from ppdiffusers_tome.tools.cli import BENCH_METHODS

    assert BENCH_METHODS == bench.ALL_METHODS


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"], ["bench", "-h"], ["--version"]])
def test_help_and_version_do_not_import_paddle(args):
    """-X importtime lists every module the interpreter imports: neither Paddle nor ppdiffusers may be among them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ppdiffusers_tome", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert "ppdiffusers_tome" in imported and "argparse" in imported  # the listing works
    assert not imported & {"paddle", "ppdiffusers", "paddlenlp"}
    assert done.stdout.strip()


def test_help_only_detection():
    from ppdiffusers_tome import _cli_help_only

    assert _cli_help_only(["-m"], ["python", "-m", "ppdiffusers_tome", "demo", "--help"])
    assert _cli_help_only(["-m"], ["python3.11", "-X", "importtime", "-m", "ppdiffusers_tome", "--version"])
    assert _cli_help_only(["/venv/bin/ppdiffusers-tome", "bench", "-h"], ["python", "/venv/bin/ppdiffusers-tome"])
    assert _cli_help_only(["-m"], ["python", "-m", "ppdiffusers_tome"])  # no arguments: usage only
    assert not _cli_help_only(["-m"], ["python", "-m", "ppdiffusers_tome", "demo", "--steps", "2"])
    assert not _cli_help_only(["-m"], ["python", "-m", "pytest", "--help"])
    assert not _cli_help_only(["script.py", "--help"], ["python", "script.py", "--help"])
    # bench --calibrate without a GPU is refused at once: nothing to import for it either
    assert _cli_help_only(["-m"], ["python", "-m", "ppdiffusers_tome", "bench", "--calibrate"])
    assert not _cli_help_only(["-m"], ["python", "-m", "ppdiffusers_tome", "bench", "--calibrate", "--device", "gpu"])
    assert not _cli_help_only(["-m"], ["python", "-m", "ppdiffusers_tome", "bench", "--calibrate", "--device=gpu"])


# memory check, default resolution, legend and noise warning --------------------------------------------------
def test_demo_refuses_a_resolution_that_cannot_fit_before_building(monkeypatch, capsys, tmp_path):
    from ppdiffusers_tome.tools import presets

    monkeypatch.setattr(presets, "available_memory_bytes", lambda: 16 * 1024**3)
    monkeypatch.setattr(presets, "preset_pipeline", lambda *a, **k: pytest.fail("built a model"))
    assert main(["demo", "--preset", "tiny", "--resolution", "256", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "preset 'tiny' at 256x256 px needs about 32.0 GiB" in err and "16.0 GiB" in err
    assert "Use --resolution 160 or less" in err  # 160 px: 4.9 GiB, within half of 16 GiB; 192 px: 10.1 GiB is not


def test_bench_refuses_the_largest_resolution_that_cannot_fit(monkeypatch, capsys, tmp_path):
    from ppdiffusers_tome.tools import presets

    monkeypatch.setattr(presets, "available_memory_bytes", lambda: 16 * 1024**3)
    monkeypatch.setattr(presets, "preset_pipeline", lambda *a, **k: pytest.fail("built a model"))
    args = ["bench", "--arch", "tiny", "--resolutions", "32", "512", "--batch-sizes", "1", "2"]
    assert main([*args, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "at 512x512 px" in err and "UNet batch 4" in err and "Use --resolutions" in err


def test_default_resolution_comes_from_the_preset_or_the_model_folder(tmp_path):
    from ppdiffusers_tome.tools.bench.commands import model_layout
    from ppdiffusers_tome.tools.cli import build_parser

    parser = build_parser()
    assert model_layout(parser.parse_args(["demo", "--preset", "tiny"]))[1] == 64
    assert model_layout(parser.parse_args(["bench", "--arch", "sdxl-narrow"]))[1] == 1024
    preset_pipeline("tiny").save_pretrained(str(tmp_path / "model"))
    layout, size, label = model_layout(parser.parse_args(["demo", "--model", str(tmp_path / "model")]))
    assert size == 8 * 2 and layout[1] == 2 and "model" in label  # the tiny UNet's sample_size x the 2x VAE


def test_demo_output_has_a_legend_and_records_the_noise(tmp_path, capsys):
    assert main(["demo", *TINY, "--ratios", "0.5", "--repeats", "2", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for term in ("peak MiB:", "added MiB:", "max |diff|:", "The images are noise"):
        assert term in out
    record = read_record(tmp_path)
    tome = record["results"][1]
    low, high = tome["speedup_range"]
    runs_v, runs_t = record["results"][0]["runs_seconds"], tome["runs_seconds"]
    assert low == pytest.approx(min(runs_v) / max(runs_t)) and high == pytest.approx(max(runs_v) / min(runs_t))
    assert isinstance(record["unstable_runs"], list)


def test_noise_warning_names_the_spread_and_when_a_speedup_means_nothing():
    from ppdiffusers_tome.tools.bench.demo import noise_warning

    rows = [{"method": "vanilla", "ratio": 0.0, "runs_seconds": [2.0, 8.0, 2.2]},  # the reported 4x spread
            {"method": "tome", "ratio": 0.5, "runs_seconds": [3.0, 3.3, 3.1]}]
    text = noise_warning(rows)
    assert "vanilla 2.00-8.00 s" in text and "between 0.61x and 2.67x" in text and "not meaningful" in text
    steady = [{"method": "vanilla", "ratio": 0.0, "runs_seconds": [2.0, 2.1, 2.05]},
              {"method": "tome", "ratio": 0.5, "runs_seconds": [1.0, 1.02, 1.01]}]
    assert noise_warning(steady) is None
    assert noise_warning([{**row, "runs_seconds": row["runs_seconds"][:1]} for row in rows]) is None  # one run
    busy_but_clear = [steady[0], {"method": "tome", "ratio": 0.5, "runs_seconds": [0.5, 0.9, 0.6]}]
    text = noise_warning(busy_but_clear)
    assert "ToMe 0.50 0.50-0.90 s" in text and "not meaningful" not in text


# --version on every command, defaults in every --help -----------------------------------------------------------
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_every_command_answers_version(command, capsys):
    import ppdiffusers_tome

    with pytest.raises(SystemExit) as done:
        main([command, "--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"ppdiffusers-tome {ppdiffusers_tome.__version__}"


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_every_option_with_a_default_shows_it_in_help(command, capsys):
    """Each option that has a default says it in --help: argparse prints nothing at all for an option without a
    help text, so every option needs one, and the formatter appends the default unless the help gives it."""
    from ppdiffusers_tome.tools.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or action.default in (None, False, [], argparse.SUPPRESS):
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help text"
        assert "default" in formatter._get_help_string(action), f"{command} {action.option_strings[0]}"
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    if command == "bench":
        assert "(default: vanilla tome tome-efficient bound)" in out and "(default: 0.5)" in out


# the command line's own output: no third-party noise -------------------------------------------------------------
def test_command_line_output_has_no_third_party_noise(tmp_path):
    """Paddle's import warnings (ccache, distutils) and its timestamped root-logger format stay out of a real run;
    our progress lines are still there, as plain text."""
    import re
    import subprocess
    import sys

    command = [sys.executable, "-m", "ppdiffusers_tome", "demo", *TINY, "--steps", "1", "--ratios", "0.5",
               "--repeats", "1", "--output", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=REPO_ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    for noise in ("No ccache found", "Setuptools is replacing distutils", "UserWarning", "[    INFO]"):
        assert noise not in done.stderr, noise
    assert not re.search(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", done.stderr)  # no timestamp prefixes
    assert "building preset tiny with random weights" in done.stderr.splitlines()[0]


def test_a_cache_row_too_short_to_cache_says_so_once_as_a_plain_line(tmp_path, capsys, caplog):
    """At --steps 1 the step cache row has no cached step: the library warns at every run (each run applies the cache
    anew); the demo says it once, as a log line, and no Python warning reaches its output."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["demo", *TINY, "--steps", "1", "--ratios", "0.5", "--repeats", "2", "--output", str(tmp_path)]) == 0
    said = [r.getMessage() for r in caplog.records if "ran every call of a pipeline call in full" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("tome@0.5") and "first cached step is step 1" in said[0], said
    assert not [w for w in caught if "step cache" in str(w.message)]
    assert "UserWarning" not in capsys.readouterr().err


def test_library_import_leaves_warnings_and_logging_alone():
    """A plain ``import ppdiffusers_tome`` silences Paddle's two import warnings for the length of its own import
    only (examples import it first for that): afterwards the warning filters are exactly the application's."""
    import subprocess
    import sys

    code = ("import warnings\nbefore = list(warnings.filters)\nimport ppdiffusers_tome\n"
            "print(any('ccache' in str(f[1] and f[1].pattern) for f in warnings.filters), warnings.filters == before)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=REPO_ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False True"
    assert "No ccache found" not in done.stderr and "Setuptools is replacing distutils" not in done.stderr


@pytest.mark.parametrize("argv,option", [(["demo", "--resolution", "384"], "--resolution 384"),
                                         (["bench", "--model", "shapes", "--resolutions", "64", "128"],
                                          "--resolutions 128")])
def test_the_shapes_model_refuses_another_size_before_anything_runs(argv, option, tmp_path, capsys, monkeypatch):
    from ppdiffusers_tome.tools import presets

    monkeypatch.setattr(presets, "load_local_pipeline", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(argv + ["--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert option in err and "64x64 images only" in err and "--preset sd15-narrow" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["demo", "bench"])
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_output_that_cannot_be_a_folder_is_refused_before_anything_runs(command, where, tmp_path, capsys,
                                                                            monkeypatch):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    output = taken if where == "a file" else taken / "results"
    from ppdiffusers_tome.tools.bench import commands

    monkeypatch.setattr(commands, "run_demo", lambda args: pytest.fail("ran"))
    monkeypatch.setattr(commands, "run_bench", lambda args: pytest.fail("ran"))
    assert main([command, "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert f"ppdiffusers-tome {command}: error: --output {output}" in err and "Traceback" not in err
    assert taken.read_text() == "keep me"  # nothing lost


@pytest.mark.parametrize("seed", ["-1", str(2**64), "1.5", "ten"])
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_a_seed_outside_paddles_range_is_a_clear_error(command, seed, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--seed", seed])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "[0, 2**63 - 1]" in err and "Traceback" not in err


def test_the_largest_seed_is_accepted():
    from ppdiffusers_tome.tools.cli import MAX_SEED, build_parser

    assert build_parser().parse_args(["demo", "--seed", str(MAX_SEED)]).seed == MAX_SEED == 2**63 - 1


# arguments that pass the parser but cannot work: refused before any work --------------------------------------
def never_run(monkeypatch):
    from ppdiffusers_tome.tools.bench import commands

    monkeypatch.setattr(commands, "run_demo", lambda args: pytest.fail("ran"))
    monkeypatch.setattr(commands, "run_bench", lambda args: pytest.fail("ran"))


@pytest.mark.parametrize("command", ["demo", "bench"])
@pytest.mark.parametrize("output", ["", "  "])
def test_an_empty_output_is_refused_before_anything_runs(command, output, capsys, monkeypatch, tmp_path):
    never_run(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main([command, "--output", output]) == 2
    err = capsys.readouterr().err
    assert f"ppdiffusers-tome {command}: error: --output is empty" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_an_output_folder_that_cannot_be_created_is_refused_before_anything_runs(command, capsys, monkeypatch,
                                                                                 tmp_path):
    """The parent is writable (``os.access`` says so), but the folder's name is too long to create."""
    never_run(monkeypatch)
    output = tmp_path / "made" / ("x" * 300) / "results"
    assert os.access(tmp_path, os.W_OK)
    assert main([command, "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert f"ppdiffusers-tome {command}: error: --output {output} cannot be used" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # "made", created on the way, is gone again


def test_an_output_folder_made_for_a_command_that_stops_early_is_removed_and_an_existing_one_kept(
        capsys, monkeypatch, tmp_path):
    from ppdiffusers_tome.tools.bench import commands

    def refuse(args):
        assert os.path.isdir(args.output)  # created before the command ran
        raise ValueError("a stand-in refusal")

    monkeypatch.setattr(commands, "run_demo", refuse)
    assert main(["demo", "--output", str(tmp_path / "new" / "demo")]) == 2
    assert "a stand-in refusal" in capsys.readouterr().err and not list(tmp_path.iterdir())
    (tmp_path / "mine").mkdir()
    assert main(["demo", "--output", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine").is_dir()  # the user's own folder stays


@pytest.mark.parametrize("value", ["-3", "-1", "1.5", "many"])
def test_bench_warmup_must_be_a_whole_number_of_runs(value, capsys):
    from ppdiffusers_tome.tools.cli import build_parser

    with pytest.raises(SystemExit) as done:  # (the parser alone: were it accepted, nothing would run)
        build_parser().parse_args(["bench", "--warmup", value])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "argument --warmup: must be an integer >= 0" in err and value in err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999", "strong"])
def test_demo_guidance_scale_must_be_a_finite_number(value, capsys):
    """Every other numeric option was refused up front; ``nan`` and ``inf`` ran and wrote NaN images."""
    from ppdiffusers_tome.tools.cli import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["demo", f"--guidance-scale={value}"])  # (= form: "-inf" is no option)
    assert done.value.code == 2
    assert "argument --guidance-scale: must be a finite number" in capsys.readouterr().err


def test_a_finite_guidance_scale_is_accepted():
    from ppdiffusers_tome.tools.cli import build_parser

    assert [build_parser().parse_args(["demo", "--guidance-scale", v]).guidance_scale for v in ("7.5", "0", "-1")] \
        == [7.5, 0.0, -1.0]


@pytest.mark.parametrize("command", ["demo", "bench"])
@pytest.mark.parametrize("value", ["0.75", "0.9", "1", "-0.1", "nan", "inf", "half"])
def test_ratios_outside_the_range_in_help_are_refused_naming_the_option(command, value, capsys):
    """bench's help said each ratio was in [0, 1) while 0.75 and above were refused at the default strides, by a
    message that named ``ratio``, not ``--ratios``."""
    from ppdiffusers_tome.tools.cli import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--ratios", "0.5", value])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "argument --ratios: must be a number in [0, 0.75)" in err and value in err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_the_help_of_ratios_gives_the_range_the_parser_accepts(command, capsys):
    from ppdiffusers_tome.ops.partition import max_ratio
    from ppdiffusers_tome.tome.config import ToMeConfig
    from ppdiffusers_tome.tools.cli import RATIO_LIMIT, build_parser

    config = ToMeConfig()
    assert RATIO_LIMIT == max_ratio(config.sx, config.sy) == 0.75  # ToMe's limit at its default strides
    assert build_parser().parse_args([command, "--ratios", "0", "0.74"]).ratios == [0.0, 0.74]
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "each in [0, 0.75)" in text and "[0, 1)" not in text


def test_bench_warmup_zero_is_accepted():
    from ppdiffusers_tome.tools.cli import build_parser

    assert build_parser().parse_args(["bench", "--warmup", "0"]).warmup == 0


def test_bench_calibrate_on_a_cpu_is_refused_without_importing_paddle(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ppdiffusers_tome", "bench", "--calibrate",
                           "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env=REPO_ENV)
    assert done.returncode == 2
    assert "bench: error: --calibrate measures where merging starts to pay on a GPU" in done.stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert "argparse" in imported and not imported & {"paddle", "ppdiffusers", "paddlenlp"}
    assert not (tmp_path / "out").exists()


def test_bench_help_describes_the_command(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    assert rest.startswith("Measure methods side by side")


def test_bench_prints_why_a_method_could_not_run_under_its_table(tmp_path, capsys):
    args = ["bench", "--arch", "tiny", "--resolutions", "32", "--steps", "1", "--repeats", "1", "--warmup", "0",
            "--threads", "1", "--methods", "vanilla", "tome-efficient", "--no-plots", "--no-time-split",
            "--no-op-count", "--output", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[0]
    assert "n/a tome-efficient@0.5 (every resolution and batch): efficient attention unavailable" in table


# Ctrl-C: what was measured is saved, and one line says so ---------------------------------------------------------
def interrupt_after(monkeypatch, owner, name, calls):
    """Make ``owner.name`` raise KeyboardInterrupt (as Ctrl-C does) when it is called for the ``calls + 1``-th time."""
    original = getattr(owner, name)
    count = [0]

    def stand_in(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, stand_in)


def interrupted(args):
    """``main(args)`` that is to end by Ctrl-C: its exit status, or a failure if the KeyboardInterrupt escapes
    (which would otherwise stop the whole test session)."""
    try:
        return main(args)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the command line as a KeyboardInterrupt")


def only_line_with(text, err):
    lines = [line for line in err.splitlines() if text in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_ctrl_c_during_bench_keeps_the_finished_cells(tmp_path, capsys, monkeypatch):
    from ppdiffusers_tome.tools.bench import runner

    interrupt_after(monkeypatch, runner.Runner, "run_cell", 1)  # batch 1 finishes, batch 2 is interrupted
    args = ["bench", "--arch", "tiny", "--resolutions", "32", "--batch-sizes", "1", "2", "--steps", "1",
            "--repeats", "1", "--warmup", "0", "--threads", "1", "--methods", "vanilla", "tome", "--no-op-count",
            "--output", str(tmp_path)]
    assert interrupted(args) == 130
    line = only_line_with("interrupted", capsys.readouterr().err)
    assert line == (f"ppdiffusers-tome bench: interrupted (Ctrl-C): saved the 2 cells of 1 of 2 resolution x batch in "
                    f"{tmp_path / 'results.json'}")
    record = read_record(tmp_path)
    assert record["complete"] is False and record["groups_done"] == "1 of 2 resolution x batch"
    cells = [(c["batch"], c["method"], c["status"]) for c in record["cells"]]
    assert cells == [(1, "vanilla", "ok"), (1, "tome", "ok")]
    assert record["cells"][1]["speedup"] > 0
    assert sorted(os.listdir(tmp_path)) == ["results.json"]  # no partial file left over


def test_a_finished_bench_says_it_is_complete(tmp_path):
    args = ["bench", "--arch", "tiny", "--resolutions", "32", "--steps", "1", "--repeats", "1", "--warmup", "0",
            "--threads", "1", "--methods", "vanilla", "tome", "--no-op-count", "--no-plots", "--no-time-split",
            "--output", str(tmp_path)]
    assert main(args) == 0
    assert read_record(tmp_path)["complete"] is True


def test_ctrl_c_during_the_demo_keeps_the_finished_rounds(tmp_path, capsys, monkeypatch):
    from ppdiffusers_tome.tools.bench import runner

    # two methods (vanilla, ToMe 0.5): the first round of timed runs is two runs; the third run is interrupted
    interrupt_after(monkeypatch, runner.Runner, "_measure_once", 2)
    args = ["demo", *TINY, "--ratios", "0.5", "--cache", "0", "--repeats", "3", "--output", str(tmp_path)]
    assert interrupted(args) == 130
    captured = capsys.readouterr()
    line = only_line_with("interrupted", captured.err)
    assert line == (f"ppdiffusers-tome demo: interrupted (Ctrl-C): saved 1 of 3 timed runs per method (the rounds "
                    f"finished) in {tmp_path / 'demo.png'} and {tmp_path / 'results.json'}")
    assert "ToMe demo:" not in captured.out  # no table of a run that did not finish
    record = read_record(tmp_path)
    assert record["complete"] is False and record["timed_runs_done"] == 1
    assert [(r["method"], len(r["runs_seconds"])) for r in record["results"]] == [("vanilla", 1), ("tome", 1)]
    note = next(text for text in record["warnings"] if text.startswith("NOTE: one timed run"))
    assert "--repeats 1" not in note  # (the option the user did not pass)
    assert "(the run was stopped after the first of its 3)" in note and "finishes its 3 timed runs" in note
    with Image.open(tmp_path / "demo.png") as png:
        png.verify()


def test_ctrl_c_before_anything_is_measured_says_nothing_was_saved(tmp_path, capsys, monkeypatch):
    from ppdiffusers_tome.tools import presets

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(presets, "preset_pipeline", ctrl_c)
    assert interrupted(["demo", *TINY, "--output", str(tmp_path / "new")]) == 130
    line = only_line_with("interrupted", capsys.readouterr().err)
    assert line.endswith("nothing had been measured yet, so nothing was saved")
    assert not (tmp_path / "new").exists()  # the folder made for the run is removed again


# --repeats 1 is a check, not a measurement ------------------------------------------------------------------------
def test_one_timed_run_shows_no_speedup_in_the_demo_table():
    from ppdiffusers_tome.tools.bench.demo import format_demo_table, single_run_note

    row = dict(ratio=0.5, seconds_per_image=2.3, unet_seconds=0.1, peak_memory_bytes=2**20, added_memory_bytes=0,
               max_abs_diff=0.01, psnr_db=40.0, merges_nothing=False, cache=None)
    rows = [{**row, "method": "vanilla", "ratio": 0.0, "speedup": 1.0, "runs_seconds": [1.0], "psnr_db": float("inf")},
            {**row, "method": "tome", "speedup": 0.44, "runs_seconds": [2.3]}]  # a busy machine's single run
    table = format_demo_table(rows)
    assert "0.44" not in table and "?x (1 run)" in table.splitlines()[-1]
    note = single_run_note(rows)
    assert "does not measure speed" in note and "--repeats 3" in note
    repeated = [{**r, "runs_seconds": r["runs_seconds"] * 3} for r in rows]
    assert "0.44x" in format_demo_table(repeated) and single_run_note(repeated) is None


def test_the_demo_with_one_repeat_says_it_is_not_a_measurement(tmp_path, capsys):
    assert main(["demo", *TINY, "--ratios", "0.5", "--cache", "0", "--repeats", "1", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ONE timed run per configuration (a check that it runs, not a measurement)" in out
    tome = next(line for line in out.splitlines() if line.lstrip().startswith("tome "))
    assert "?x (1 run)" in tome and not re.search(r"\d\.\d\dx", tome)  # no speed-up number
    assert "does not measure speed" in out

"""Every script in examples/ runs end to end on its tiny default, so no example can rot; each reads its command line
before it imports Paddle, so --help (with every default) answers at once."""

import json
import os
import re
import runpy
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from ppdiffusers_tome.tools.images import MIN_TILE, row_layout

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
SCRIPTS = sorted(name for name in os.listdir(EXAMPLES) if name.endswith(".py"))


# what each example saves, by name: every image generated with ToMe has its vanilla twin (same seed)
SAVED = {
    "sd_txt2img.py": {"vanilla.png", "tome.png"},
    "sd_img2img.py": {"start.png", "vanilla.png", "tome.png"},
    "controlnet.py": {"control.png", "vanilla.png", "tome.png", "side_by_side.png"},
    "multi_controlnet.py": {"control_stripes.png", "control_square.png", "vanilla.png", "tome.png", "side_by_side.png"},
    "sdxl.py": {"vanilla.png", "tome.png", "side_by_side.png"},
    "dit.py": {"vanilla_207.png", "vanilla_360.png", "tome_207.png", "tome_360.png"},
    "sd3.py": {"vanilla.png", "tome.png", "cache.png", "tome_cache.png"},
    "beyond_tomesd.py": {"vanilla.png", "tome_0.5.png", "todo_x2.png", "tome_0.5_recompute_every_5.png",
                         "tome_0.7_to_0.3.png", "side_by_side.png"},
}
# the examples that end by saying where their images are
SAYS_WHERE = ("controlnet.py", "multi_controlnet.py", "sdxl.py", "dit.py", "beyond_tomesd.py", "sd3.py")
# the examples that print timings: on their tiny default they say that these timings are no measurement
TIMED = ("sd_txt2img.py", "controlnet.py", "sd3.py", "beyond_tomesd.py", "benchmark.py")


def test_there_are_examples():
    assert "sd_txt2img.py" in SCRIPTS
    assert set(SAVED) <= set(SCRIPTS)


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.float64)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_on_its_tiny_default(script, tmp_path, monkeypatch, caplog, capfd):
    monkeypatch.setattr(sys, "argv", [script, "--output", str(tmp_path)])
    with caplog.at_level("INFO"):
        runpy.run_path(os.path.join(EXAMPLES, script), run_name="__main__")
    images = sorted(p for p in os.listdir(tmp_path) if p.endswith(".png"))
    assert images, f"{script} saved no image"
    for name in images:
        with Image.open(tmp_path / name) as image:
            image.verify()
    if script in SAVED:
        assert set(images) == SAVED[script]
    pairs = [(v, v.replace("vanilla", "tome")) for v in images if v.startswith("vanilla")]
    if script in ("beyond_tomesd.py", "sd3.py"):
        pairs = [("vanilla.png", name) for name in images if name not in ("vanilla.png", "side_by_side.png")]
    for vanilla, tome in pairs:  # same seed, so any difference is ToMe's doing
        assert np.abs(pixels(tmp_path / vanilla) - pixels(tmp_path / tome)).max() > 0, (vanilla, tome)
    if "side_by_side.png" in images:
        single = pixels(tmp_path / "vanilla.png")
        strip = pixels(tmp_path / "side_by_side.png")
        count = len([n for n in SAVED[script] if n != "side_by_side.png" and "start" not in n])
        layout = row_layout([(single.shape[1], single.shape[0])] * count, ["label"] * count)  # (labels: any)
        assert strip.shape[1] == layout.size[0] and strip.shape[0] > layout.tile[1] >= MIN_TILE
        # the vanilla image sits in the strip below the label row, only enlarged (nearest neighbour)
        index = 2 if script == "multi_controlnet.py" else 1 if script == "controlnet.py" else 0
        left, _, right, _ = layout.tile_boxes[index]
        enlarged = single.repeat(layout.scale, 0).repeat(layout.scale, 1)
        assert np.array_equal(strip[-layout.tile[1]:, left:right], enlarged)
    if script in SAYS_WHERE:
        assert os.path.abspath(tmp_path) in caplog.text
    if script in TIMED:
        from ppdiffusers_tome.presets import TINY_TIMINGS

        assert TINY_TIMINGS in caplog.text
    captured = capfd.readouterr()
    assert "truncated" not in captured.out + captured.err + caplog.text


def test_distributed_example_runs_on_two_cpu_processes(tmp_path):
    """``--nproc 2`` starts Paddle's launcher on two CPU ranks talking over gloo on loopback: every prompt is
    generated once and rank 0 gathers them all; the launcher's INFO lines and Paddle's import warnings stay off the
    screen and its log folder is a temporary one, so the working directory holds nothing but the images."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.path.dirname(EXAMPLES))
    env.pop("PADDLE_DISTRI_BACKEND", None)  # the example picks gloo itself on a CPU build
    command = [sys.executable, os.path.join(EXAMPLES, "distributed_generate.py"), "--nproc", "2",
               "--output", str(tmp_path / "out"), "--steps", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "out")) == [f"{i:03d}.png" for i in range(6)]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no log/ folder left behind
    screen = done.stdout + done.stderr
    assert "rank 0 saved 6 images" in screen and "images per rank: 3, 3" in screen
    for noise in ("LAUNCH INFO", "No ccache found", "Setuptools is replacing distutils", "[    INFO]"):
        assert noise not in screen, noise


def distributed_module():
    return runpy.run_path(os.path.join(EXAMPLES, "distributed_generate.py"), run_name="distributed_generate")


def test_distributed_example_refuses_an_abbreviated_nproc(capsys):
    """``--np 2`` used to be taken for ``--nproc 2`` but was not stripped before relaunching: every rank launched
    again."""
    with pytest.raises(SystemExit) as exit_:
        distributed_module()["main"](["--np", "2"])
    assert exit_.value.code == 2 and "--np" in capsys.readouterr().err


def test_distributed_example_does_not_relaunch_under_the_launcher(monkeypatch):
    import ppdiffusers_tome.presets

    module = distributed_module()
    launched = []
    monkeypatch.setitem(module["main"].__globals__, "launch", lambda *a: launched.append(a) or 0)
    monkeypatch.setattr(ppdiffusers_tome.presets, "preset_pipeline", lambda name, **_: (_ for _ in ()).throw(
        RuntimeError("stop after the launch decision")))  # (main imports it from there once it has read its options)
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    with pytest.raises(RuntimeError, match="stop after the launch decision"):
        module["main"](["--nproc", "2"])
    assert launched == []
    monkeypatch.delenv("PADDLE_TRAINER_ID")
    monkeypatch.delenv("PADDLE_TRAINERS_NUM", raising=False)
    with pytest.raises(SystemExit):
        module["main"](["--nproc", "2"])
    assert len(launched) == 1 and launched[0][0] == 2


@pytest.mark.parametrize("script", [name for name in SCRIPTS])
def test_every_example_takes_dtype_and_refuses_half_precision_on_a_cpu(script, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--dtype", "float16", "--output", str(tmp_path)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(os.path.join(EXAMPLES, script), run_name="__main__")
    assert done.value.code == 2
    assert "--dtype float16 needs a GPU" in capsys.readouterr().err
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".png")]


@pytest.mark.parametrize("script, pipeline", [("sd_txt2img.py", "StableDiffusionPipeline"),
                                              ("beyond_tomesd.py", "StableDiffusionPipeline"),
                                              ("sd3.py", "StableDiffusion3Pipeline")])
def test_timing_examples_warm_up_before_they_time(script, pipeline, tmp_path, monkeypatch):
    """Each configuration is called once with one step before the timed call, so first-call work is not timed."""
    import ppdiffusers

    cls = getattr(ppdiffusers, pipeline)
    steps, real = [], cls.__call__

    def record(self, *args, **kwargs):
        steps.append(kwargs.get("num_inference_steps"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", record)
    monkeypatch.setattr(sys, "argv", [script, "--steps", "2", "--output", str(tmp_path)])
    runpy.run_path(os.path.join(EXAMPLES, script), run_name="__main__")
    assert steps and steps[0::2] == [1] * (len(steps) // 2) and steps[1::2] == [2] * (len(steps) // 2)


def test_sd3_example_loads_a_local_folder_without_t5_and_runs_it_on_the_math_processor(tmp_path, caplog):
    """``--model DIR``: a folder as SD3 is often kept, without its T5 encoder (no ``text_encoder_3``), loads with
    ``text_encoder_3=None`` and runs on this CPU through the math attention processor; every run is saved."""
    from ppdiffusers_tome.testing import tiny_sd3_pipeline

    folder = tmp_path / "sd3"
    tiny_sd3_pipeline(seed=1).save_pretrained(str(folder))
    assert not (folder / "text_encoder_3").exists()
    example = runpy.run_path(os.path.join(EXAMPLES, "sd3.py"), run_name="sd3_example")
    with caplog.at_level("INFO"):
        saved = example["main"](["--model", str(folder), "--size", "32", "--steps", "2", "--cache", "2",
                                 "--merge-mlp", "--output", str(tmp_path / "out")])
    assert sorted(os.path.basename(p) for p in saved) == sorted(SAVED["sd3.py"])
    assert "loading SD3 without T5" in caplog.text and "math processor" in caplog.text
    assert "1 full and 1 cached transformer calls" in caplog.text
    assert np.abs(pixels(saved[0]) - pixels(saved[1])).max() > 0  # ToMe changed the image


def test_sd3_example_refuses_a_folder_that_is_not_a_pipeline(tmp_path, capsys):
    example = runpy.run_path(os.path.join(EXAMPLES, "sd3.py"), run_name="sd3_example")
    with pytest.raises(SystemExit) as done:
        example["main"](["--model", str(tmp_path), "--output", str(tmp_path / "out")])
    assert done.value.code == 2 and "model_index.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sd3_example_runs_todo_in_place_of_tome_and_refuses_it_with_merge_mlp(tmp_path, caplog, capsys):
    """ToDo's image is todo.png; the images of an earlier run (ToMe's, the cache's) that this run does not make again
    are gone from the folder afterwards, and a file the example never writes stays."""
    example = runpy.run_path(os.path.join(EXAMPLES, "sd3.py"), run_name="sd3_example")
    out = tmp_path / "out"
    out.mkdir()
    for earlier in ("vanilla.png", "tome.png", "cache.png", "tome_cache.png", "notes.txt"):
        (out / earlier).write_bytes(b"an earlier run's")
    with caplog.at_level("INFO"):
        saved = example["main"](["--todo", "--resolution", "32", "--steps", "2", "--cache", "0", "--output", str(out)])
    assert [os.path.basename(p) for p in saved] == ["vanilla.png", "todo.png"]
    assert sorted(os.listdir(out)) == ["notes.txt", "todo.png", "vanilla.png"]
    assert "removed tome_cache.png of an earlier run" in caplog.text
    assert "ToDo: {" in caplog.text and "'merges': 6" in caplog.text  # 3 joint blocks x 2 steps
    assert np.abs(pixels(saved[0]) - pixels(saved[1])).max() > 0  # ToDo changed the image
    with pytest.raises(SystemExit) as done:
        example["main"](["--todo", "--merge-mlp", "--output", str(tmp_path / "refused")])
    assert done.value.code == 2 and "--merge-mlp" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_every_example_answers_help_with_its_defaults_without_importing_paddle():
    """``python examples/X.py --help`` reads the command line before anything imports Paddle (it took 17-36 s when
    Paddle came first) and shows every option's default. One fresh interpreter runs all of them in turn."""
    probe = (
        "import contextlib, io, json, runpy, sys\n"
        "seen = {}\n"
        "for path in sys.argv[1:]:\n"
        "    sys.argv = [path, '--help']\n"
        "    text = io.StringIO()\n"
        "    with contextlib.redirect_stdout(text):\n"
        "        try:\n"
        "            runpy.run_path(path, run_name='__main__')\n"
        "        except SystemExit as done:\n"
        "            code = done.code\n"
        "    seen[path] = [code, text.getvalue(), 'paddle' in sys.modules]\n"
        "print(json.dumps(seen))\n"
    )
    paths = [os.path.join(EXAMPLES, script) for script in SCRIPTS]
    done = subprocess.run([sys.executable, "-c", probe, *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    for path in paths:
        code, text, paddle_imported = seen[path]
        assert code in (0, None) and "usage:" in text, (path, text)
        assert not paddle_imported, f"{os.path.basename(path)} imported Paddle before reading --help"
        options = text.split("options:", 1)[1]
        flat = " ".join(options.split())  # (argparse wraps the lines)
        assert "(default: float32)" in flat and "(default: " + os.path.join("outputs", "examples") in flat, text
        # every option but --help shows its default
        assert flat.count("(default: ") == len(re.findall(r"^  --(?!help)", options, re.M)), (path, text)
    sd3 = " ".join(seen[os.path.join(EXAMPLES, "sd3.py")][1].split())
    assert "--resolution RESOLUTION, --size RESOLUTION" in sd3 and "a multiple of 16" in sd3 and "(default: 64)" in sd3


def test_every_example_imports_the_package_before_paddle():
    """Imported first, Paddle prints "No ccache found"; the package, imported before it, keeps that quiet. Nothing at
    an example's top level imports Paddle or ppdiffusers (so --help is fast), and main imports the package first."""
    import ast

    heavy = ("paddle", "ppdiffusers", "ppdiffusers_tome")

    def imported(nodes):
        names = [alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names]
        names += [node.module for node in nodes if isinstance(node, ast.ImportFrom)]
        return [name.split(".")[0] for name in names if name.split(".")[0] in heavy]

    for script in SCRIPTS:
        with open(os.path.join(EXAMPLES, script), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        assert imported(tree.body) == [], script
        main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
        assert imported(main.body)[0] == "ppdiffusers_tome", script


def test_every_example_offers_the_packages_dtypes():
    from ppdiffusers_tome.presets import DTYPES

    for script in SCRIPTS:
        assert runpy.run_path(os.path.join(EXAMPLES, script), run_name="example")["DTYPES"] == DTYPES, script


@pytest.mark.parametrize("size", ["72", "8", "0"])
def test_sd3_example_refuses_a_resolution_that_is_not_a_multiple_of_16(size, tmp_path, capsys):
    example = runpy.run_path(os.path.join(EXAMPLES, "sd3.py"), run_name="sd3_example")
    with pytest.raises(SystemExit) as done:
        example["main"](["--size", size, "--output", str(tmp_path / "out")])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "--resolution must be a positive multiple of 16 (SD3's VAE" in err and err.rstrip().endswith(f"got {size}")
    assert not (tmp_path / "out").exists()

"""The package as users install it: a wheel built from the repository, installed into a fresh folder, runs its
command line from outside the repository with the configs it ships."""

import os
import re
import shutil
import subprocess
import sys
import zipfile

import ppdiffusers_tome

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def can_build_without_isolation():
    """Whether this environment can build a wheel by itself (``wheel`` installed, or a setuptools with its own
    bdist_wheel); otherwise pip builds in an isolated environment fetched from the package index."""
    try:
        import wheel  # noqa: F401

        return True
    except ImportError:
        import setuptools

        return tuple(int(part) for part in setuptools.__version__.split(".")[:2]) >= (70, 1)


def test_wheel_installs_into_a_fresh_folder_and_its_command_runs_from_elsewhere(tmp_path):
    # build from a copy holding only what setup.py packages, so that the build leaves nothing in the checkout
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(REPO, name), source / name)
    shutil.copytree(os.path.join(REPO, "ppdiffusers_tome"), source / "ppdiffusers_tome",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    isolation = ["--no-build-isolation"] if can_build_without_isolation() else []
    done = subprocess.run([*pip, "wheel", str(source), "--no-deps", *isolation, "-w", str(tmp_path / "dist")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("ppdiffusers_tome-*.whl")
    assert wheel.name.startswith(f"ppdiffusers_tome-{ppdiffusers_tome.__version__}-")
    with zipfile.ZipFile(wheel) as archive:
        files = [name for name in archive.namelist() if ".dist-info/" not in name]
    # the library, the tools and the shipped pipeline; no research code (training, dataset, classifier, figure)
    assert "ppdiffusers_tome/ops/global_plan.py" in files and "ppdiffusers_tome/tools/cli.py" in files
    assert "ppdiffusers_tome/tools/shapes_model/pipeline/model_index.json" in files
    assert "ppdiffusers_tome/tools/shapes_sd3_model/pipeline/transformer/config.json" in files
    research = [name for name in files if re.search(r"(research|train|dataset|classifier|figure)\w*\.py$|classifier", name)]
    assert not research, research
    site = tmp_path / "site"
    done = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    elsewhere = tmp_path / "elsewhere"  # a working directory outside the repository
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))  # ahead of the environment's own (editable) install
    check = ("import ppdiffusers_tome, ppdiffusers_tome.tools.presets as p\n"
             "print(ppdiffusers_tome.__file__)\n"
             "print(p.CONFIG_DIR)\n"
             "print(' '.join(p.available_presets()))\n"
             "print(p.load_preset('tiny')['default_resolution'])")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, cwd=elsewhere,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    package_file, config_dir, presets, tiny_resolution = done.stdout.split("\n")[:4]
    assert package_file.startswith(str(site)) and config_dir.startswith(str(site))
    assert {"tiny", "sd15-narrow", "sdxl", "tiny-controlnet"} <= set(presets.split()) and tiny_resolution == "64"

    script = site / "bin" / "ppdiffusers-tome"  # the console script the wheel declares
    assert script.is_file()
    command = [str(script), "demo", "--preset", "tiny", "--resolution", "32", "--steps", "1", "--ratios", "0.5",
               "--repeats", "1", "--threads", "1", "--output", str(elsewhere / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=elsewhere, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ToMe demo: preset:tiny" in done.stdout
    assert "No ccache found" not in done.stderr and "building preset tiny" in done.stderr  # the command line's quiet
    assert (elsewhere / "out" / "results.json").is_file() and (elsewhere / "out" / "demo.png").is_file()

    # the default demo: the trained shapes model, loaded from the wheel's own copy of the weights
    command = [str(script), "demo", "--steps", "2", "--ratios", "0.5", "--repeats", "1", "--threads", "1",
               "--output", str(elsewhere / "shapes")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=elsewhere, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ToMe demo: shapes model (trained, shipped in the package)" in done.stdout
    check = ("from ppdiffusers_tome.tools import shapes as shipped\n"
             "print(shipped.has_weights(), shipped.pipeline_folder())")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, cwd=elsewhere,
                          env=env)
    has, folder = done.stdout.split()
    assert has == "True" and folder.startswith(str(site))
    assert sorted(os.listdir(elsewhere)) == ["out", "shapes"]

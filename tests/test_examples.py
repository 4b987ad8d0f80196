"""Every script in examples/ runs end to end on its tiny default, so no example can rot."""

import os
import runpy
import sys

import pytest
from PIL import Image

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
SCRIPTS = sorted(name for name in os.listdir(EXAMPLES) if name.endswith(".py"))


def test_there_are_examples():
    assert "sd_txt2img.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_on_its_tiny_default(script, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, "--output", str(tmp_path)])
    runpy.run_path(os.path.join(EXAMPLES, script), run_name="__main__")
    images = sorted(p for p in os.listdir(tmp_path) if p.endswith(".png"))
    assert images, f"{script} saved no image"
    for name in images:
        with Image.open(tmp_path / name) as image:
            image.verify()


def test_distributed_example_runs_on_two_cpu_processes(tmp_path):
    """Paddle's launcher, two CPU ranks talking over gloo on loopback: every prompt is generated once and rank 0
    gathers them all."""
    import subprocess

    env = dict(os.environ, PADDLE_DISTRI_BACKEND="gloo", PYTHONPATH=os.path.dirname(EXAMPLES))
    command = [
        sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"),
        os.path.join(EXAMPLES, "distributed_generate.py"), "--output", str(tmp_path / "out"), "--steps", "1",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    images = sorted(os.listdir(tmp_path / "out"))
    assert images == [f"{i:03d}.png" for i in range(6)]
    logs = "".join(open(os.path.join(tmp_path / "log", name)).read() for name in os.listdir(tmp_path / "log"))
    assert "rank 0/2 generated 3 image(s)" in logs and "rank 1/2 generated 3 image(s)" in logs

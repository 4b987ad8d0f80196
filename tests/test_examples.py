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

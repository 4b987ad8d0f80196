"""examples/controlnet.py times each configuration as sd_txt2img.py does: a one-step warm-up call first, then the
timed call, and a line with the time of each."""

import os
import runpy
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "controlnet.py")


def test_controlnet_example_warms_up_and_prints_a_time_per_configuration(tmp_path, monkeypatch, caplog):
    from ppdiffusers import StableDiffusionControlNetPipeline

    steps, real = [], StableDiffusionControlNetPipeline.__call__

    def record(self, *args, **kwargs):
        steps.append(kwargs.get("num_inference_steps"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(StableDiffusionControlNetPipeline, "__call__", record)
    monkeypatch.setattr(sys, "argv", ["controlnet.py", "--steps", "2", "--output", str(tmp_path)])
    with caplog.at_level("INFO"):
        runpy.run_path(EXAMPLE, run_name="__main__")
    assert steps == [1, 2, 1, 2]  # vanilla: warm-up, timed; ToMe: warm-up, timed
    timed = [r.getMessage() for r in caplog.records if " s -> " in r.getMessage()]
    assert [line.split(":")[0] for line in timed] == ["vanilla", "ToMe ratio=0.5"]
    assert all(line.endswith(".png") and float(line.split(": ")[1].split(" s")[0]) > 0 for line in timed)
